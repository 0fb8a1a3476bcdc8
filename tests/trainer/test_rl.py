"""The RL driver end to end on a ~1M-parameter model: every estimator / loss runs, the model changes,
resume is bitwise, bad inputs are user errors (exit 2) or counted zeros."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tiller.config import load_config
from tiller.config.validate import ADV_ESTIMATORS, POLICY_LOSSES
from tiller.data.rl_dataset import write_rows
from tiller.errors import ConfigError
from tiller.protocol import Batch
from tiller.tasks import arithmetic

# A reward an untrained model can earn: the fraction of digits in its response (varies within a group).
REWARD_SRC = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''
RAISING_SRC = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if len(solution_str) % 2:
        raise ValueError("boom")
    return float("nan") if len(solution_str) % 3 == 0 else 1.0
'''


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_data")
    arithmetic.write_task(root, n_train=48, n_test=8, seed=0)
    (root / "reward.py").write_text(REWARD_SRC)
    (root / "raising_reward.py").write_text(RAISING_SRC)
    return root


def make_cfg(run_dir: Path, model_dir: Path, data: Path, *overrides: str):
    return load_config([
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'test.parquet'}]",
        f"custom_reward_function.path={data / 'reward.py'}",
        "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=6",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.optim.lr=1e-3",
        "critic.optim.lr=1e-3", "algorithm.adv_estimator=grpo", "trainer.total_training_steps=2",
        "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}", *overrides,
    ])


def _train(cfg):
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(cfg)
    before = trainer.actor.execute("state_dict")
    critic_before = trainer.critic.worker.module.state_dict() if trainer.critic else None
    critic_before = {k: v.clone() for k, v in critic_before.items()} if critic_before else None
    metrics = trainer.fit()
    after = trainer.actor.execute("state_dict")
    changed = any(not torch.equal(before[k], after[k]) for k in before)
    if trainer.critic:
        now = trainer.critic.worker.module.state_dict()
        changed = changed and any(not torch.equal(critic_before[k], now[k]) for k in critic_before)
    trainer.shutdown()
    return metrics, changed, after


def _finite(metrics, prefixes=("actor/", "critic/", "timing_s/", "response_length/")):
    keys = [k for k in metrics if k.startswith(prefixes)]
    assert keys
    bad = {k: metrics[k] for k in keys if not math.isfinite(metrics[k])}
    assert not bad, bad


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "remax", "reinforce_plus_plus"])
def test_tiny_full_loop_learns_something(tmp_path, tiny_model_dir, rl_data, estimator):
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, f"algorithm.adv_estimator={estimator}",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=2")  # 2 mini-batches: the off-policy path
    metrics, changed, _ = _train(cfg)
    assert changed, "parameters did not change"
    _finite(metrics)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl", "critic/score/mean",
                "critic/advantages/mean", "response_length/mean", "timing_s/gen", "timing_s/update_actor",
                "perf/throughput", "val-core/tiller/arithmetic/acc/mean@1"):
        assert key in metrics, key
    if estimator == "gae":
        assert {"critic/vf_loss", "critic/values/mean", "timing_s/values"} <= set(metrics)
    if estimator == "remax":
        assert "timing_s/gen_max" in metrics
    assert (tmp_path / "run" / "checkpoints" / "global_step_2" / "state.pt").exists()
    assert (tmp_path / "run" / "plots" / "main.png").stat().st_size > 0  # the run's curves, without `tiller report`


ALL_RUNS = [("adv", e) for e in ADV_ESTIMATORS if e not in ("gae", "grpo", "rloo", "remax", "reinforce_plus_plus",
                                                             "gdpo")]
ALL_RUNS += [("loss", m) for m in POLICY_LOSSES]


@pytest.mark.parametrize("kind,name", ALL_RUNS)
def test_every_estimator_and_loss_mode_runs(tmp_path, tiny_model_dir, rl_data, kind, name):
    key = "algorithm.adv_estimator" if kind == "adv" else "actor_rollout_ref.actor.policy_loss.loss_mode"
    extra = ["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"] if name == "dro" else []  # verl 0.10: no default
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, f"{key}={name}", "trainer.total_training_steps=1",
                   "actor_rollout_ref.actor.ppo_epochs=2", "trainer.save_freq=100", "data.val_files=[]", *extra)
    metrics, changed, _ = _train(cfg)
    assert changed
    _finite(metrics)


GDPO_REWARD_SRC = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = float(solution_str.strip().startswith(str(ground_truth)))
    short = float(len(solution_str) < 4)
    return {"score": correct + short, "correct": correct, "short": short}
"""


def test_gdpo_reads_named_scores_and_bypass_mode_runs(tmp_path, tiny_model_dir, rl_data):
    (tmp_path / "gdpo_reward.py").write_text(GDPO_REWARD_SRC)
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, "algorithm.adv_estimator=gdpo",
                   f"custom_reward_function.path={tmp_path / 'gdpo_reward.py'}",
                   "algorithm.gdpo_reward_keys=[correct,short]", "algorithm.gdpo_reward_weights=[1.0,0.5]",
                   "algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce",
                   "algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                   "trainer.total_training_steps=1", "data.val_files=[]")
    metrics, changed, _ = _train(cfg)
    assert changed
    _finite(metrics)
    assert "timing_s/old_log_prob" not in metrics  # bypass: the rollout logprobs are the old ones
    assert "actor/rollout_corr/rollout_is_mean" in metrics
    with pytest.raises(ConfigError, match="gdpo_reward_keys"):
        make_cfg(tmp_path / "r2", tiny_model_dir, rl_data, "algorithm.adv_estimator=gdpo")


def test_kl_loss_kl_in_reward_entropy_and_filter_groups(tmp_path, tiny_model_dir, rl_data, force_bf16):
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, "actor_rollout_ref.actor.use_kl_loss=true",
                   "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                   "actor_rollout_ref.actor.entropy_coeff=0.01", "algorithm.filter_groups.enable=true",
                   "algorithm.filter_groups.metric=score", "algorithm.filter_groups.max_num_gen_batches=1",
                   "actor_rollout_ref.actor.dtype=bfloat16",
                   "actor_rollout_ref.actor.optim.warmup_style=cosine", "actor_rollout_ref.actor.optim.lr_warmup_steps=1")
    metrics, changed, _ = _train(cfg)
    assert changed
    _finite(metrics)
    assert metrics["actor/kl_loss"] >= 0 and "actor/reward_kl_penalty" in metrics
    assert 0 <= metrics["batch/num_groups_kept"] <= metrics["batch/num_groups"] == 4
    assert {"timing_s/ref", "timing_s/old_log_prob", "timing_s/filter_groups"} <= set(metrics)


def _jsonl(path: Path) -> dict[int, dict]:
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        metrics = row.get("metrics", row)
        step = row.get("step", metrics.get("step"))
        out[int(step)] = {k: v for k, v in metrics.items()
                          if not k.startswith(("timing_s/", "perf/", "time", "wall")) and isinstance(v, (int, float))}
    return out


def test_resume_is_bitwise(tmp_path, tiny_model_dir, rl_data):
    # GAE with critic, KL loss (reference), 2 epochs x 2 shuffled mini-batches: every piece of state matters.
    common = ("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
              "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
              "actor_rollout_ref.actor.shuffle=true", "data.val_files=[]")
    _, _, straight = _train(make_cfg(tmp_path / "a", tiny_model_dir, rl_data, *common,
                                     "trainer.total_training_steps=4", "trainer.save_freq=2"))
    _train(make_cfg(tmp_path / "b", tiny_model_dir, rl_data, *common, "trainer.total_training_steps=2"))
    _, _, resumed = _train(make_cfg(tmp_path / "b", tiny_model_dir, rl_data, *common,
                                    "trainer.total_training_steps=4", "trainer.resume_mode=auto"))
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    a, b = _jsonl(tmp_path / "a" / "metrics.jsonl"), _jsonl(tmp_path / "b" / "metrics.jsonl")
    for step in (3, 4):
        assert a[step] == b[step]


def _cli(args, cwd=None, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "tiller.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


def _overrides(run_dir, model_dir, data, *extra):
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{data / 'train.parquet'}]",
            f"custom_reward_function.path={data / 'reward.py'}", "data.train_batch_size=4",
            "data.max_prompt_length=32", "data.max_response_length=6", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "algorithm.adv_estimator=grpo", "trainer.logger=[jsonl]", "trainer.num_threads=1",
            f"trainer.default_local_dir={run_dir}", *extra]


@pytest.mark.slow
def test_killed_process_leaves_a_loadable_checkpoint_and_resumes(tmp_path, tiny_model_dir, rl_data):
    from tiller.models.checkpoint import latest_checkpoint, load_checkpoint

    run_dir = tmp_path / "run"
    args = ["rl", *_overrides(run_dir, tiny_model_dir, rl_data, "trainer.total_training_steps=200",
                              "trainer.save_freq=1")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "tiller.cli", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not (run_dir / "checkpoints" / "global_step_2").exists():
            time.sleep(0.2)
        assert (run_dir / "checkpoints" / "global_step_2").exists(), "no checkpoint written in time"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    step = load_checkpoint(ckpt)["step"]
    assert step >= 2
    done = _cli(["rl", *_overrides(run_dir, tiny_model_dir, rl_data, f"trainer.total_training_steps={step + 1}")])
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from {ckpt}" in done.stdout, (done.stdout[-2000:], done.stderr[-2000:])
    assert (run_dir / "checkpoints" / f"global_step_{step + 1}" / "state.pt").exists()


@pytest.mark.parametrize("case", ["missing_file", "missing_column", "empty", "all_too_long", "too_long_error",
                                  "bad_key", "no_model", "bad_penalty"])
def test_bad_inputs_exit_2_with_a_clear_message(tmp_path, tiny_model_dir, rl_data, case, capsys):
    from tiller.cli import main

    data = rl_data
    extra = []
    expect = ""
    if case == "missing_file":
        extra, expect = [f"data.train_files=[{tmp_path / 'nope.parquet'}]"], "data file not found"
    elif case == "missing_column":
        write_rows([{"data_source": "x", "question": "1+1="}] * 8, tmp_path / "nocol.parquet")
        extra, expect = [f"data.train_files=[{tmp_path / 'nocol.parquet'}]"], "missing column 'prompt'"
    elif case == "empty":
        (tmp_path / "empty.jsonl").write_text("")
        extra, expect = [f"data.train_files=[{tmp_path / 'empty.jsonl'}]"], "no rows"
    elif case == "all_too_long":
        extra, expect = ["data.max_prompt_length=3", "data.filter_overlong_prompts=true"], "no prompts left"
    elif case == "too_long_error":
        extra, expect = ["data.max_prompt_length=3"], "data.max_prompt_length=3"
    elif case == "bad_key":
        extra, expect = ["algorithm.adv_estimatr=grpo"], "adv_estimator"
    elif case == "no_model":
        extra, expect = [f"actor_rollout_ref.model.path={tmp_path / 'no_model'}"], "not found"
    elif case == "bad_penalty":
        extra, expect = ["actor_rollout_ref.rollout.repetition_penalty=0"], "rollout.repetition_penalty must be > 0"
    argv = ["rl", *_overrides(tmp_path / "run", tiny_model_dir, data, *extra)]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert expect in err and "Traceback" not in err, err


def test_main_ppo_entry_point_exits_2_on_user_error(tmp_path, tiny_model_dir, rl_data):
    res = subprocess.run([sys.executable, "-m", "tiller.trainer.main_ppo",
                          *_overrides(tmp_path / "run", tiny_model_dir, rl_data, "data.max_prompt_length=3")],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 2 and "max_prompt_length=3" in res.stderr and "Traceback" not in res.stderr


def test_reward_function_that_raises_scores_zero_and_is_counted(tmp_path, tiny_model_dir, rl_data):
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, f"custom_reward_function.path={rl_data / 'raising_reward.py'}",
                   "trainer.total_training_steps=1", "data.val_files=[]")
    metrics, _, _ = _train(cfg)
    assert metrics["reward/num_errors"] > 0
    assert 0.0 <= metrics["critic/score/mean"] <= 1.0 and math.isfinite(metrics["critic/score/max"])


def test_lora_actor_with_kl_and_resume_path(tmp_path, tiny_model_dir, rl_data):
    common = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
              "actor_rollout_ref.actor.use_kl_loss=true", "data.val_files=[]")
    metrics, changed, _ = _train(make_cfg(tmp_path / "run", tiny_model_dir, rl_data, *common))
    assert changed and metrics["actor/kl_loss"] >= 0
    _finite(metrics)
    ckpt = tmp_path / "run" / "checkpoints" / "global_step_2"
    metrics, _, _ = _train(make_cfg(tmp_path / "run", tiny_model_dir, rl_data, *common, "trainer.total_training_steps=3",
                                    "trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt}"))
    assert metrics["training/global_step"] == 3
    assert (tmp_path / "run" / "checkpoints" / "global_step_3" / "state.pt").exists()


@pytest.mark.parametrize("flag, saved", [("use_rslora=true", True), ("use_dora=true", True),
                                         ("modules_to_save=[lm_head]", ["model.embed_tokens"])])
def test_rslora_dora_and_saved_modules_actors_save_their_adapters_and_roll_out_with_them(tmp_path, tiny_model_dir,
                                                                                         rl_data, flag, saved):
    # actor_rollout_ref.model.use_rslora (adapters scaled by alpha / sqrt(r)) / use_dora (peft's DoRA) /
    # modules_to_save (the LM head, tied to the embedding here, trained in full beside the adapters): the rollout
    # engine's weights are the same adapted model (its logprobs equal the actor's on step 2, after an update)
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, "actor_rollout_ref.model.lora_rank=4",
                   "actor_rollout_ref.model.lora_alpha=8", f"actor_rollout_ref.model.{flag}",
                   "actor_rollout_ref.actor.optim.lr=1e-2", "data.val_files=[]", "actor_rollout_ref.rollout.dtype=float32",
                   "actor_rollout_ref.actor.dtype=float32")
    metrics, changed, _ = _train(cfg)
    assert changed and metrics["training/rollout_probs_diff_max"] < 1e-4
    step = tmp_path / "run" / "checkpoints" / "global_step_2"
    configs = list(step.rglob("adapter_config.json"))
    key = flag.split("=")[0]
    assert configs and all(json.loads(c.read_text())[key] == saved for c in configs)
    if key == "modules_to_save":  # the head's trained copy (peft names it by the tied embedding) is saved, and moved
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        weights = {k: v for c in configs for k, v in load_file(str(c.parent / "adapter_model.safetensors")).items()
                   if "lm_head" in k or "embed_tokens" in k}
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).lm_head.weight
        assert weights and all(v.shape == base.shape and not torch.allclose(v, base, atol=1e-4)
                               for v in weights.values())


@pytest.mark.parametrize("coef", [0.5, -0.5])
def test_stop_properly_penalty_scales_or_replaces_truncated_rewards(tmp_path, tiny_model_dir, rl_data, coef):
    # OpenRLHF's ProRL penalty (reward_model.stop_properly_penalty_coef): ignore_eos truncates every response, so
    # each reward is coef x its score (coef in [0, 1]) or coef itself (negative); the score stays the function's
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, f"reward_model.stop_properly_penalty_coef={coef}",
                   "actor_rollout_ref.rollout.ignore_eos=true", "trainer.total_training_steps=1", "data.val_files=[]")
    metrics, _, _ = _train(cfg)
    assert metrics["reward/stop_properly_penalized_frac"] == 1.0
    if coef > 0:
        assert metrics["critic/rewards/mean"] == pytest.approx(coef * metrics["critic/score/mean"], abs=1e-6)
    else:
        assert metrics["critic/rewards/mean"] == metrics["critic/rewards/max"] == coef
        assert metrics["critic/advantages/max"] == metrics["critic/advantages/min"] == 0.0  # every group equal


def test_stop_properly_penalty_leaves_stopped_responses_alone():
    from tiller.trainer.rl import RLTrainer

    batch = Batch({"response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])})
    batch["finish_reason"] = ["stop", "length"]
    scores = torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 3.0]])
    m: dict = {}
    out = RLTrainer._stop_properly_penalty(batch, scores, -0.25, m)
    assert out.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, -0.25]] and m["reward/stop_properly_penalized_frac"] == 0.5
    assert RLTrainer._stop_properly_penalty(batch, scores, 0.0, {}).tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 0.0]]
