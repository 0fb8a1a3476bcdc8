"""Bad input across the command line: every case exits 2 (the input) or 1 (the machine) with one error line that
names the key, file or cause, and no traceback. Most cases fail before a model is loaded; none trains."""

from __future__ import annotations

import json
import shutil

import pytest

from tiller.cli import main


@pytest.fixture(scope="module")
def ws(tmp_path_factory, tiny_model_dir):
    """A scratch dir: good data files, broken ones, a model dir without a tokenizer, a truncated checkpoint."""
    from tiller.tasks import arithmetic

    root = tmp_path_factory.mktemp("bad")
    arithmetic.write_task(root / "arith", n_train=8, n_test=4, seed=0)
    (root / "nogt.jsonl").write_text(json.dumps({"data_source": "tiller/arithmetic", "prompt": "1+1="}) + "\n")
    (root / "noprompt.jsonl").write_text(json.dumps({"data_source": "tiller/arithmetic", "question": "1+1="}) + "\n")
    (root / "nosource.jsonl").write_text(json.dumps({"prompt": "1+1=", "ground_truth": "2"}) + "\n")
    (root / "empty.jsonl").write_text("")
    (root / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "response": "x"}\n')
    (root / "broken.jsonl").write_text('{"prompt": "1+1=", "response": \n')
    (root / "sft.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "response": str(i + 1)}) + "\n"
                                            for i in range(8)))
    (root / "pairs_nochosen.jsonl").write_text(json.dumps({"prompt": "1+1=", "rejected": "3"}) + "\n")
    (root / "kto.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1),
                                                         "label": i % 2 == 0}) + "\n" for i in range(8)))
    (root / "kto_nolabel.jsonl").write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    (root / "list.yaml").write_text("- a\n- b\n")
    (root / "str.yaml").write_text("hello\n")
    (root / "latin1.yaml").write_bytes(b"data:\n  train_batch_size: \xe9\n")
    (root / "invalid.yaml").write_text("data: [unclosed\n")
    (root / "afile").write_text("x")
    (root / "reward_exit.py").write_text("import sys\nsys.exit(3)\n")
    (root / "reward_raises.py").write_text("raise RuntimeError('boom at import')\n")
    (root / "reward_ok.py").write_text("def compute_score(*a, **k):\n    return 1.0\nnot_callable = 3\n")
    notok = root / "model_no_tokenizer"
    notok.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, notok / name)
    trunc = root / "model_truncated"
    shutil.copytree(tiny_model_dir, trunc)
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 3])
    badcfg = root / "model_bad_config"
    shutil.copytree(tiny_model_dir, badcfg)
    (badcfg / "config.json").write_text("{not json")
    (root / "metrics_run").mkdir()
    (root / "metrics_run" / "metrics.jsonl").write_text('{"step": 1, "a": \n')
    ck = root / "ckpt_run" / "checkpoints" / "global_step_1"
    ck.mkdir(parents=True)
    (ck / "state.pt").write_bytes(b"truncated")
    return root


def _rl(ws, *extra):
    return ["rl", f"data.train_files=[{ws / 'arith' / 'train.parquet'}]", "data.max_prompt_length=32",
            "data.max_response_length=4", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "trainer.total_training_steps=1", "trainer.logger=[jsonl]", f"trainer.default_local_dir={ws}/run_rl",
            *extra]


def _sft(ws, job, *extra):
    return [job, "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2", "data.max_length=32",
            "trainer.total_training_steps=1", "trainer.logger=[jsonl]", f"trainer.default_local_dir={ws}/run_{job}",
            *extra]


CONFIG = [
    (["config", "show", "algorithm.adv_estimater=grpo"], 2, "adv_estimator"),
    (["config", "show", "algorithm.adv_estimator=grpp"], 2, "adv_estimator"),
    (["config", "show", "data.train_batch_size=0"], 2, "data.train_batch_size"),
    (["config", "show", "data.max_prompt_length=-4"], 2, "data.max_prompt_length"),
    (["config", "show", "data.max_response_length=0"], 2, "data.max_response_length"),
    (["config", "show", "actor_rollout_ref.rollout.n=0"], 2, "rollout.n"),
    (["config", "show", "actor_rollout_ref.actor.optim.lr=-1"], 2, "optim.lr"),
    (["config", "show", "actor_rollout_ref.actor.optim.optimizer=Adamm"], 2, "optim.optimizer"),
    (["config", "show", "critic.optim.optimizer_impl=nope.optim"], 2, "critic.optim.optimizer_impl"),
    (["config", "show", "+actor_rollout_ref.actor.optim.override_optimizer_config.amsgrd=true"], 2,
     "optim.override_optimizer_config"),
    (["config", "show", "actor_rollout_ref.actor.ppo_epochs=0"], 2, "ppo_epochs"),
    (["config", "show", "actor_rollout_ref.actor.clip_ratio_c=0.5"], 2, "clip_ratio_c"),
    (["config", "show", "trainer.resume_mode=resume_path"], 2, "resume_from_path"),
    (["config", "show", "trainer.logger=[console,foo]"], 2, "trainer.logger"),
    (["config", "show", "actor_rollout_ref.rollout.name=sglang"], 2, "rollout.name"),
    (["config", "show", "reward_model.reward_manager=fancy"], 2, "reward_manager"),
    (["config", "show", "actor_rollout_ref.actor.loss_agg_mode=mean"], 2, "loss_agg_mode"),
    (["config", "show", "actor_rollout_ref.actor.dtype=float8"], 2, "dtype"),
    (["config", "show", "trainer.total_training_steps=0"], 2, "total_training_steps"),
    (["config", "show", "trainer.total_epochs=-1"], 2, "total_epochs"),
    (["config", "show", "data.val_batch_size=0"], 2, "val_batch_size"),
    (["config", "show", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1"], 2, "rollout.n"),
    (["config", "show", "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4"], 2,
     "ppo_mini_batch_size"),
    (["config", "show", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0"], 2, "ppo_micro_batch_size_per_gpu"),
    (["config", "show", "critic.ppo_micro_batch_size_per_gpu=-1"], 2, "critic.ppo_micro_batch_size_per_gpu"),
    (["config", "show", "critic.forward_micro_batch_size_per_gpu=0"], 2, "critic.forward_micro_batch_size_per_gpu"),
    (["config", "show", "critic.ppo_mini_batch_size=5"], 2, "critic.ppo_mini_batch_size"),
    (["config", "show", "reward_model.timeout=0"], 2, "reward_model.timeout"),
    (["config", "show", "--preset", "nope"], 2, "preset"),
    (["config", "show", "--config", "{ws}/missing.yaml"], 2, "missing.yaml"),
    (["config", "show", "--config", "{ws}/list.yaml"], 2, "list.yaml"),
    (["config", "show", "--config", "{ws}/str.yaml"], 2, "str.yaml"),
    (["config", "show", "--config", "{ws}/latin1.yaml"], 2, "UTF-8"),
    (["config", "show", "--config", "{ws}/invalid.yaml"], 2, "YAML"),
    (["config", "show", "data.train_batch_size=abc"], 2, "train_batch_size"),
    (["config", "show", "actor_rollout_ref.rollout.temperature=hot"], 2, "temperature"),
    (["config", "show", "nonsense"], 2, "nonsense"),
]


def _rl_case(extra: list[str], code: int, word: str):
    return ("rl", extra, code, word)


RL = [
    _rl_case(["actor_rollout_ref.model.path={ws}/nowhere"], 2, "nowhere"),
    _rl_case(["actor_rollout_ref.model.path={model}", "data.train_files=[{ws}/missing.parquet]"], 2, "missing.parquet"),
    _rl_case(["actor_rollout_ref.model.path={model}", "data.train_files=[{ws}/empty.jsonl]"], 2, "empty.jsonl"),
    _rl_case(["actor_rollout_ref.model.path={model}", "data.train_files=[{ws}/noprompt.jsonl]"], 2, "prompt"),
    _rl_case(["actor_rollout_ref.model.path={model}", "data.train_files=[{ws}/nosource.jsonl]"], 2, "data_source"),
    _rl_case(["actor_rollout_ref.model.path={model}", "data.train_files=[{ws}/nogt.jsonl]"], 2, "ground truth"),
    _rl_case(["actor_rollout_ref.model.path={model}", "data.train_files=[{ws}/latin1.jsonl]"], 2, "latin1.jsonl"),
    _rl_case(["actor_rollout_ref.model.path={model}", "data.train_files=[{ws}/broken.jsonl]"], 2, "broken.jsonl"),
    _rl_case(["actor_rollout_ref.model.path={ws}/model_no_tokenizer"], 2, "tokenizer"),
    _rl_case(["actor_rollout_ref.model.path={ws}/model_bad_config"], 2, "model_bad_config"),
    _rl_case(["actor_rollout_ref.model.path={ws}/model_truncated"], 2, "model_truncated"),
    _rl_case(["actor_rollout_ref.model.path={model}", "custom_reward_function.path={ws}/missing_reward.py"], 2,
             "missing_reward.py"),
    _rl_case(["actor_rollout_ref.model.path={model}", "custom_reward_function.path={ws}/reward_exit.py"], 2,
             "sys.exit"),
    _rl_case(["actor_rollout_ref.model.path={model}", "custom_reward_function.path={ws}/reward_raises.py"], 2,
             "boom at import"),
    _rl_case(["actor_rollout_ref.model.path={model}", "custom_reward_function.path={ws}/reward_ok.py",
              "custom_reward_function.name=absent"], 2, "absent"),
    _rl_case(["actor_rollout_ref.model.path={model}", "custom_reward_function.path={ws}/reward_ok.py",
              "custom_reward_function.name=not_callable"], 2, "not callable"),
    _rl_case(["actor_rollout_ref.model.path={model}", "data.train_batch_size=64",
              "actor_rollout_ref.actor.ppo_mini_batch_size=64"], 2, "train_batch_size"),
    _rl_case(["actor_rollout_ref.model.path={model}", "data.max_prompt_length=2"], 2, "max_prompt_length"),
    _rl_case(["actor_rollout_ref.model.path={model}", "trainer.resume_mode=resume_path",
              "trainer.resume_from_path={ws}/nockpt"], 2, "nockpt"),
]

OTHER = [
    ("sft", ["data.train_files=[{ws}/sft.jsonl]"], 2, "model.partial_pretrain"),
    ("sft", ["model.partial_pretrain={model}"], 2, "data.train_files"),
    ("sft", ["model.partial_pretrain={model}", "data.train_files=[{ws}/missing.jsonl]"], 2, "missing.jsonl"),
    ("sft", ["model.partial_pretrain={model}", "data.train_files=[{ws}/noprompt.jsonl]"], 2, "prompt"),
    ("sft", ["model.partial_pretrain={model}", "data.train_files=[{ws}/sft.jsonl]", "data.train_batch_size=0"], 2,
     "train_batch_size"),
    ("sft", ["model.partial_pretrain={model}", "data.train_files=[{ws}/sft.jsonl]", "data.micro_batch_size_per_gpu=3"],
     2, "micro_batch_size_per_gpu"),
    ("sft", ["model.partial_pretrain={model}", "data.train_files=[{ws}/sft.jsonl]", "optim.lr=-1"], 2, "optim.lr"),
    ("sft", ["model.partial_pretrain={ws}/nowhere", "data.train_files=[{ws}/sft.jsonl]"], 2, "nowhere"),
    ("sft", ["model.partial_pretrain={ws}/model_truncated", "data.train_files=[{ws}/sft.jsonl]"], 2, "model_truncated"),
    ("rm", ["model.partial_pretrain={ws}/model_truncated", "data.train_files=[{ws}/sft.jsonl]"], 2, "model_truncated"),
    ("sft", ["model.partial_pretrain={model}", "data.train_files=[{ws}/sft.jsonl]", "data.max_length=0"], 2,
     "max_length"),
    ("sft", ["model.partial_pretrain={model}", "data.train_files=[{ws}/sft.jsonl]", "trainer.logger=[nope]"], 2,
     "trainer.logger"),
    ("rm", ["model.partial_pretrain={model}", "data.train_files=[{ws}/pairs_nochosen.jsonl]"], 2, "chosen"),
    ("dpo", ["model.partial_pretrain={model}", "data.train_files=[{ws}/pairs_nochosen.jsonl]"], 2, "chosen"),
    ("dpo", ["model.partial_pretrain={model}", "data.train_files=[{ws}/sft.jsonl]", "algorithm.loss=magic"], 2,
     "algorithm.loss"),
    ("dpo", ["model.partial_pretrain={model}", "data.train_files=[{ws}/sft.jsonl]", "algorithm.beta=-1"], 2, "beta"),
    ("kto", ["model.partial_pretrain={model}", "data.train_files=[{ws}/kto_nolabel.jsonl]"], 2, "label"),
    ("kto", ["model.partial_pretrain={model}", "data.train_files=[{ws}/kto.jsonl]", "algorithm.desirable_weight=-1"],
     2, "desirable_weight"),
]

COMMANDS = [
    (["generate", "--data", "{ws}/missing.parquet", "--out", "{ws}/g.jsonl", "--model", "{model}"], 2, "missing"),
    (["generate", "--data", "{ws}/arith/test.parquet", "--out", "{ws}/g.txt", "--model", "{model}"], 2, "g.txt"),
    (["generate", "--data", "{ws}/arith/test.parquet", "--out", "{ws}/afile/g.jsonl", "--model", "{model}",
      "data.max_response_length=2"], 1, "afile"),
    (["generate", "--data", "{ws}/arith/test.parquet", "--out", "{ws}/g.jsonl"], 2, "model"),
    (["eval", "data.val_files=[{ws}/arith/test.parquet]"], 2, "model.path"),
    (["eval", "actor_rollout_ref.model.path={model}", "data.val_files=[{ws}/missing.parquet]"], 2, "missing"),
    (["export", "{ws}/nowhere", "--to", "{ws}/out"], 2, "nowhere"),
    (["export", "{ws}/ckpt_run", "--to", "{ws}/out"], 2, "model"),
    (["report", "{ws}/nowhere"], 2, "nowhere"),
    (["report", "{ws}/metrics_run"], 2, "metrics"),
    (["data", "gsm8k", "--src", "{ws}/nowhere", "--out", "{ws}/d"], 2, "nowhere"),
    (["data", "nosuchtask", "--out", "{ws}/d"], 2, "nosuchtask"),
    (["nosuchcommand"], 2, "nosuchcommand"),
    (["serve", "{ws}/nowhere"], 2, "nowhere"),
    (["serve-rm", "{ws}/nowhere"], 2, "nowhere"),
]


def _fill(args, ws, model):
    return [a.replace("{ws}", str(ws)).replace("{model}", str(model)) for a in args]


def _check(capsys, argv, code, word):
    try:
        got = main(argv)
    except SystemExit as exit_:  # argparse's own errors (usage line + error line)
        got = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert got == code, f"{argv}: exit {got}, stderr:\n{err}"
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert errors and word.lower() in errors[-1].lower(), f"{argv}: {word!r} not in {errors[-1:]}\n{err}"


@pytest.mark.parametrize("argv, code, word", CONFIG, ids=[f"config-{i}" for i in range(len(CONFIG))])
def test_config(capsys, ws, tiny_model_dir, argv, code, word):
    _check(capsys, _fill(argv, ws, tiny_model_dir), code, word)


@pytest.mark.parametrize("job, extra, code, word", RL, ids=[f"rl-{i}" for i in range(len(RL))])
def test_rl(capsys, ws, tiny_model_dir, job, extra, code, word):
    argv = _rl(ws)
    extra = _fill(extra, ws, tiny_model_dir)
    _check(capsys, argv + extra, code, word)


@pytest.mark.parametrize("job, extra, code, word", OTHER, ids=[f"{c[0]}-{i}" for i, c in enumerate(OTHER)])
def test_offline_jobs(capsys, ws, tiny_model_dir, job, extra, code, word):
    _check(capsys, _sft(ws, job) + _fill(extra, ws, tiny_model_dir), code, word)


@pytest.mark.parametrize("argv, code, word", COMMANDS, ids=[f"{c[0][0]}-{i}" for i, c in enumerate(COMMANDS)])
def test_commands(capsys, ws, tiny_model_dir, argv, code, word):
    argv = _fill(argv, ws, tiny_model_dir)
    _check(capsys, argv, code, word)
