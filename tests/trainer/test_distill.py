"""On-policy distillation end to end: a fresh ~1M student learns from a teacher warmed 60 steps on the arithmetic task;
its per-token reverse KL to the teacher on its own samples falls. Config: verl's `distillation.*` layout resolves
onto `algorithm.distill.*`; bad values are errors naming the key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tiller.config import load_config
from tiller.errors import ConfigError
from tiller.tasks import arithmetic


@pytest.fixture(scope="module")
def distill_setup(tiny_model_dir, tmp_path_factory):
    """(student dir = the fresh tiny model, teacher dir = the same model after 60 supervised steps, data dir)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiller.trainer.demo import warm_up

    root = tmp_path_factory.mktemp("distill")
    arithmetic.write_task(root / "data", n_train=64, n_test=8, seed=0)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    train, _ = arithmetic.make_splits(n_train=512, n_test=8, seed=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        warm_up(model, tok, train, train[:8], target=2.0, seed=0, max_steps=60, eval_every=10_000,
                log=lambda *_: None)
    teacher = root / "teacher"
    model.save_pretrained(teacher, safe_serialization=True)
    tok.save_pretrained(teacher)
    return Path(tiny_model_dir), teacher, root / "data"


def _cfg(run_dir, student, teacher, data, *extra):
    return load_config([
        f"actor_rollout_ref.model.path={student}",
        f"data.train_files=[{data / 'train.parquet'}]", "data.apply_chat_template=false",
        "data.train_batch_size=8", "data.max_prompt_length=16", "data.max_response_length=6",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32", "actor_rollout_ref.actor.optim.lr=3e-3",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean", "algorithm.adv_estimator=grpo",
        "trainer.total_training_steps=30", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable", "trainer.save_freq=-1", f"trainer.default_local_dir={run_dir}", *extra,
    ])


def test_student_reverse_kl_to_teacher_falls(distill_setup, tmp_path):
    """Pure distillation (no outcome reward), 30 steps of 32 samples: the student's token-mean reverse KL to the
    teacher on its own samples (distillation/reverse_kl) falls by more than 30% (measured: 4.97 -> 0.21)."""
    from tiller.trainer.rl import run

    student, teacher, data = distill_setup
    cfg = _cfg(tmp_path / "run", student, teacher, data, f"algorithm.distill.teacher_path={teacher}",
               "algorithm.distill.use_outcome_reward=false")
    run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kl = [r["distillation/reverse_kl"] for r in rows if "distillation/reverse_kl" in r]
    assert len(kl) == 30
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    print(f"distillation/reverse_kl: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first > 1.0  # a fresh model is far from the warmed teacher
    assert last < 0.7 * first
    assert all("timing_s/teacher" in r for r in rows if "distillation/reverse_kl" in r)


def test_verl_distillation_layout_resolves(distill_setup, tmp_path):
    student, teacher, data = distill_setup
    cfg = _cfg(tmp_path / "run", student, teacher, data, "distillation.enabled=true",
               f"distillation.teacher_model.model_path={teacher}",
               "distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.use_task_rewards=false",
               "distillation.distillation_loss.use_policy_gradient=true", "distillation.num_workers=2")
    d = cfg.algorithm.distill
    assert (d.teacher_path, d.loss_mode, d.use_outcome_reward, d.use_policy_gradient) == (str(teacher), "k1", False,
                                                                                          True)
    # verl 0.10's defaults for the keys left unset: no clamps, clip ratios 0.2
    assert (d.loss_max_clamp, d.log_prob_min_clamp, d.clip_ratio_low, d.clip_ratio_high) == (None, None, 0.2, 0.2)
    assert cfg.distillation.teacher_model.model_path is None and not cfg.distillation.enabled  # one config shown
    # verl's default loss_mode (k3) applies when the verl layout leaves it unset
    cfg = _cfg(tmp_path / "run", student, teacher, data, "distillation.enabled=true",
               f"distillation.teacher_model.model_path={teacher}")
    assert cfg.algorithm.distill.loss_mode == "k3"


# the distillation block of a verl launch script (verl's top-level `distillation.*` layout), as published
VERL_DISTILLATION_BLOCK = """
    distillation.enabled=True
    distillation.num_workers=8
    distillation.teacher_model.enable_resource_pool=False
    distillation.teacher_model.n_gpus_per_node=4
    distillation.teacher_model.nnodes=1
    distillation.teacher_model.model_path=/models/teacher
    distillation.teacher_model.inference.name=vllm
    distillation.teacher_model.inference.tensor_model_parallel_size=1
    distillation.teacher_model.inference.gpu_memory_utilization=0.3
    distillation.teacher_model.inference.enforce_eager=false
    distillation.teacher_model.inference.max_model_len=5121
    distillation.teacher_model.inference.max_num_batched_tokens=5121
    distillation.teacher_model.inference.max_num_seqs=8
    +distillation.teacher_model.inference.engine_kwargs.vllm.max_logprobs=64
    distillation.distillation_loss.loss_mode=k1
    distillation.distillation_loss.topk=64
    distillation.distillation_loss.use_task_rewards=False
    distillation.distillation_loss.use_policy_gradient=True
    distillation.distillation_loss.loss_max_clamp=10.0
    distillation.distillation_loss.log_prob_min_clamp=-10.0
"""


def test_a_verl_distillation_script_block_parses_unchanged():
    from tiller.config.edge import noop_keys

    cfg = load_config(["actor_rollout_ref.model.path=M", *VERL_DISTILLATION_BLOCK.split()])
    d = cfg.algorithm.distill
    assert (d.teacher_path, d.loss_mode, d.use_outcome_reward, d.use_policy_gradient) == ("/models/teacher", "k1",
                                                                                          False, True)
    noops = " ".join(noop_keys(cfg))  # the teacher-server keys are named at start-up as having no effect here
    assert "distillation.teacher_model.inference.max_num_seqs=8" in noops and "distillation.num_workers=8" in noops
    # verl 0.10 reads log_prob_min_clamp only in its top-k loss: the k1 estimator here clamps no log-prob, as verl's
    assert d.log_prob_min_clamp is None and d.loss_max_clamp == 10.0
    assert "distillation.distillation_loss.log_prob_min_clamp=-10.0" in noops


GJSD = ["algorithm.distill.teacher_path=T", "algorithm.distill.loss_mode=gjsd",
        "algorithm.distill.use_policy_gradient=false"]


@pytest.mark.parametrize("overrides, match", [
    (["distillation.enabled=true"], "distillation.teacher_model.model_path"),
    (["distillation.enabled=true", "distillation.teacher_model.model_path=T", "algorithm.distill.coef=2"],
     "algorithm.distill.coef"),
    (["distillation.teacher_model.model_path=T"], "distillation.enabled is false"),
    (["distillation.enabled=true", "distillation.teacher_model.model_path=T",
      "distillation.distillation_loss.loss_mode=forward_kl_topk"], "top-k"),
    (["distillation.enabled=true", "distillation.teacher_model.model_path=T",
      "distillation.distillation_loss.policy_loss_mode=gspo"], "policy_loss_mode"),
    (["algorithm.distill.coef=0.5"], "algorithm.distill.teacher_path is not"),
    (["algorithm.distill.teacher_path=T", "algorithm.distill.loss_mode=k4"], "algorithm.distill.loss_mode"),
    (["algorithm.distill.teacher_path=T", "algorithm.distill.use_policy_gradient=false"], "use_policy_gradient"),
    (["algorithm.distill.teacher_path=T", "algorithm.distill.coef=-1"], "algorithm.distill.coef"),
    (["algorithm.distill.teacher_path=T", "algorithm.distill.log_prob_min_clamp=1"],
     "algorithm.distill.log_prob_min_clamp"),
    (["algorithm.distill.teacher_path=T", "algorithm.distill.loss_max_clamp=0"], "algorithm.distill.loss_max_clamp"),
    # the full-vocabulary gjsd: supervised only, beta in [0, 1], no clamps / clip ratios, not in verl's layout
    ([*GJSD[:2]], "loss_mode=gjsd is a supervised loss.*use_policy_gradient=false"),
    ([*GJSD, "algorithm.distill.beta=1.5"], r"algorithm.distill.beta must be in \[0, 1\]"),
    ([*GJSD, "algorithm.distill.loss_max_clamp=5"], "algorithm.distill.loss_max_clamp is not read by loss_mode=gjsd"),
    ([*GJSD, "algorithm.distill.clip_ratio_high=0.3"], "algorithm.distill.clip_ratio_high is the policy-gradient"),
    (["algorithm.distill.teacher_path=T", "algorithm.distill.beta=0.5"],
     "algorithm.distill.beta=0.5 is read only with algorithm.distill.loss_mode=gjsd"),
    (["distillation.enabled=true", "distillation.teacher_model.model_path=T",
      "distillation.distillation_loss.loss_mode=gjsd"], "gjsd is tiller's loss, not verl's"),
])
def test_bad_distillation_settings_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(["actor_rollout_ref.model.path=M", *overrides])


def test_teacher_with_another_vocabulary_is_refused(distill_setup, tmp_path):
    from tiller.models.tiny import make_tiny_model
    from tiller.trainer.rl import RLTrainer

    student, _, data = distill_setup
    other = make_tiny_model(tmp_path / "other", n_params=200_000, vocab_size=300, seed=1)
    cfg = _cfg(tmp_path / "run", student, other, data, f"algorithm.distill.teacher_path={other}")
    with pytest.raises(ConfigError, match="tokenizer differs"):
        RLTrainer(cfg)
    shutil.rmtree(tmp_path / "run", ignore_errors=True)


def _fit_moves_the_student(cfg) -> dict:
    """Train `cfg`; assert some student weight changed; the last step's metrics."""
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(cfg)
    before = trainer.actor.execute("state_dict")
    metrics = trainer.fit()
    after = trainer.actor.execute("state_dict")
    trainer.shutdown()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    return metrics


def test_distillation_with_the_outcome_reward_trains_both_terms(distill_setup, tmp_path):
    """Default use_outcome_reward=true: the update carries the outcome policy loss and the distillation term."""
    student, teacher, data = distill_setup
    metrics = _fit_moves_the_student(_cfg(tmp_path / "run", student, teacher, data,
                                          f"algorithm.distill.teacher_path={teacher}", "algorithm.distill.coef=0.5",
                                          "trainer.total_training_steps=2"))
    for key in ("distillation/loss", "distillation/reverse_kl", "distillation/pg_clipfrac", "actor/pg_loss",
                "critic/score/mean", "timing_s/teacher"):
        assert key in metrics, key
    assert metrics["distillation/reverse_kl"] > 1.0  # a fresh student, two steps in


def test_gjsd_with_the_outcome_reward_packed_equals_padded(distill_setup, tmp_path):
    """loss_mode=gjsd next to the outcome reward (coef 0.5): both terms train; the packed (remove-padding) forward
    gives the student's and the teacher's logits at the same positions as the padded one (the same step's loss)."""
    from tiller.trainer.rl import run

    student, teacher, data = distill_setup
    rows = {}
    for packed in (False, True):
        run_dir = tmp_path / f"packed-{packed}"
        run(_cfg(run_dir, student, teacher, data, f"algorithm.distill.teacher_path={teacher}",
                 "algorithm.distill.loss_mode=gjsd", "algorithm.distill.use_policy_gradient=false",
                 "algorithm.distill.beta=0.5", "algorithm.distill.coef=0.5", "trainer.total_training_steps=1",
                 "actor_rollout_ref.rollout.n=2", "data.train_batch_size=4",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                 f"actor_rollout_ref.model.use_remove_padding={str(packed).lower()}"))
        rows[packed] = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    padded, packed = rows[False], rows[True]
    for key in ("distillation/loss", "distillation/divergence", "distillation/student_entropy", "actor/pg_loss",
                "critic/score/mean"):
        assert key in padded, key
    assert padded["distillation/divergence"] > 0.1  # a fresh student against the warmed teacher
    for key in ("distillation/loss", "distillation/student_entropy", "actor/grad_norm"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4), key


def _two_source_data(data: Path, out: Path, sources=("arith_a", "arith_b")) -> Path:
    """The arithmetic prompts with every other row's data_source renamed: two routing values."""
    from tiller.data.rl_dataset import read_rows, write_rows

    rows = read_rows(data / "train.parquet")
    for i, row in enumerate(rows):
        row["data_source"] = sources[i % 2]
    write_rows(rows, out)
    return out


def test_several_teachers_each_score_the_rows_routed_to_them(distill_setup, tmp_path):
    """algorithm.distill.teachers (verl 0.10's multi-teacher distillation): the rows whose data_source is "arith_b"
    are scored by that key's teacher (here the student's own weights), the others by the warmed teacher: each row's
    teacher_log_prob equals a teacher-forced forward of its own teacher."""
    from tests.rollout.conftest import reference_logprobs
    from tiller.trainer.rl import RLTrainer
    from transformers import AutoModelForCausalLM

    student, teacher, data = distill_setup
    train = _two_source_data(data, tmp_path / "two.parquet")
    cfg = _cfg(tmp_path / "run", student, teacher, data, f"data.train_files=[{train}]",
               f"+algorithm.distill.teachers.arith_a={teacher}",
               f"+algorithm.distill.teachers.arith_b={student}",
               f"custom_reward_function.path={_any_reward(tmp_path)}")
    assert cfg.algorithm.distill.teachers == {"arith_a": str(teacher), "arith_b": str(student)}
    trainer = RLTrainer(cfg)
    try:
        batch = trainer._collect_batch({}, 1)
        batch["teacher_index"] = trainer._teacher_index(batch)
        got = trainer.actor.execute("compute_teacher_log_prob", batch, dispatch="dp")["teacher_log_prob"]
    finally:
        trainer.shutdown()
    models = {str(p): AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (teacher, student)}
    routes = list(batch["teacher_route"])
    assert set(routes) == {"arith_a", "arith_b"}
    for i, route in enumerate(routes):
        prompt = batch["prompts"][i][batch["attention_mask"][i, : batch["prompts"].shape[1]].bool()].tolist()
        n = int(batch["response_mask"][i].sum())
        response = batch["responses"][i, :n].tolist()
        ref = reference_logprobs(models[cfg.algorithm.distill.teachers[route]], prompt, response)
        torch.testing.assert_close(got[i, :n], ref, atol=1e-4, rtol=0)
    # the two teachers differ, so the routing is visible: the student scores its own samples higher than the warmed
    # teacher does (a fresh model's tokens are unlikely under a trained one)
    means = [float(got[i, : int(batch["response_mask"][i].sum())].mean()) for i in range(len(routes))]
    own = [m for m, r in zip(means, routes) if r == "arith_b"]
    other = [m for m, r in zip(means, routes) if r != "arith_b"]
    assert sum(own) / len(own) > sum(other) / len(other) + 0.5


def _any_reward(tmp_path: Path) -> Path:
    path = tmp_path / "reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(solution_str.strip() == str(ground_truth))\n")
    return path


@pytest.mark.parametrize("mode", ["k1", "gjsd"])
def test_several_teachers_train(distill_setup, tmp_path, mode):
    """Two steps of pure distillation from two teachers routed by data_source: the update runs (the full-vocabulary
    gjsd reads each row's teacher logits in the update's micro-batches) and the student moves."""
    student, teacher, data = distill_setup
    train = _two_source_data(data, tmp_path / "two.parquet")
    extra = ["algorithm.distill.loss_mode=gjsd", "algorithm.distill.use_policy_gradient=false"] if mode == "gjsd" \
        else []
    cfg = _cfg(tmp_path / "run", student, teacher, data, f"data.train_files=[{train}]",
               f"+algorithm.distill.teachers.arith_a={teacher}",
               f"+algorithm.distill.teachers.arith_b={student}",
               "algorithm.distill.use_outcome_reward=false", "trainer.total_training_steps=2",
               f"custom_reward_function.path={_any_reward(tmp_path)}", *extra)
    metrics = _fit_moves_the_student(cfg)
    assert torch.isfinite(torch.tensor(metrics["distillation/loss"])) and "timing_s/teacher" in metrics


def test_verl_multi_teacher_layout_and_routing_errors(distill_setup, tmp_path):
    from tiller.errors import DataError
    from tiller.trainer.rl import RLTrainer

    student, teacher, data = distill_setup
    verl = ["distillation.enabled=true", "+distillation.teacher_models.teacher_model1.key=tiller/arithmetic",
            f"+distillation.teacher_models.teacher_model1.model_path={teacher}",
            "+distillation.teacher_models.teacher_model2.key=arith/b",
            f"+distillation.teacher_models.teacher_model2.model_path={student}"]
    cfg = _cfg(tmp_path / "run", student, teacher, data, *verl)
    d = cfg.algorithm.distill
    assert (d.teachers, d.teacher_key, d.teacher_path) == (
        {"tiller/arithmetic": str(teacher), "arith/b": str(student)}, "data_source", None)
    # verl drops teacher_model silently when others are named; here it is an error naming it
    with pytest.raises(ConfigError, match="teacher_model.model_path is set beside other teachers"):
        _cfg(tmp_path / "run", student, teacher, data, *verl,
             f"distillation.teacher_models.teacher_model.model_path={teacher}")
    with pytest.raises(ConfigError, match="teacher_model2.key is not set"):
        _cfg(tmp_path / "run", student, teacher, data, *verl[:-2],
             f"+distillation.teacher_models.teacher_model2.model_path={student}")
    with pytest.raises(ConfigError, match="teacher_model2.key='tiller/arithmetic': another teacher has that key"):
        _cfg(tmp_path / "run", student, teacher, data, *verl[:-2],
             "+distillation.teacher_models.teacher_model2.key=tiller/arithmetic",
             f"+distillation.teacher_models.teacher_model2.model_path={student}")
    with pytest.raises(ConfigError, match="teacher_path and algorithm.distill.teachers are both set"):
        _cfg(tmp_path / "run", student, teacher, data, f"algorithm.distill.teacher_path={teacher}",
             f"+algorithm.distill.teachers.a={teacher}")
    with pytest.raises(ConfigError, match="teacher_key='ability' is read only with several teachers"):
        _cfg(tmp_path / "run", student, teacher, data, f"algorithm.distill.teacher_path={teacher}",
             "algorithm.distill.teacher_key=ability")
    # a training row whose routing value has no teacher: named at start, with the file and row
    cfg = _cfg(tmp_path / "run", student, teacher, data, f"+algorithm.distill.teachers.arith_b={student}",
               f"+algorithm.distill.teachers.other={teacher}")
    with pytest.raises(DataError, match=r"train.parquet row 0: data_source='tiller/arithmetic' has no teacher"):
        RLTrainer(cfg)
    # another routing column: a row without it is named too
    cfg = _cfg(tmp_path / "run", student, teacher, data, f"+algorithm.distill.teachers.arith_b={student}",
               "algorithm.distill.teacher_key=domain")
    with pytest.raises(DataError, match="no 'domain' column, which algorithm.distill.teacher_key routes"):
        RLTrainer(cfg)
