"""PRIME end to end: the implicit PRM trains each step and gives dense rewards; config checks; and (slow) PRIME
against outcome-only GRPO at equal steps on the arithmetic task."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tiller.config import load_config
from tiller.errors import ConfigError
from tiller.tasks import arithmetic

# A reward in [0, 1] an untrained model can earn (the fraction of digits in its response).
REWARD_SRC = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''


def _cfg(run_dir, model, data, *extra, reward=True):
    return load_config([
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files=[{data / 'train.parquet'}]", "data.apply_chat_template=false",
        *([f"custom_reward_function.path={data / 'reward.py'}"] if reward else []),
        "data.train_batch_size=4", "data.max_prompt_length=16", "data.max_response_length=6",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable", "trainer.save_freq=-1", f"trainer.default_local_dir={run_dir}", *extra,
    ])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("prime_data")
    arithmetic.write_task(root, n_train=32, n_test=8, seed=0)
    (root / "reward.py").write_text(REWARD_SRC)
    return root


def test_prime_trains_the_prm_and_the_policy(tiny_model_dir, data, tmp_path):
    from tiller.trainer.rl import RLTrainer

    cfg = _cfg(tmp_path / "run", tiny_model_dir, data, "algorithm.adv_estimator=prime",
               "algorithm.prime.lr=1e-3", "algorithm.prime.mini_batch_size=2")
    trainer = RLTrainer(cfg)
    worker = trainer.actor.worker
    prm0 = {k: v.clone() for k, v in worker.prm.module.state_dict().items()}
    policy0 = trainer.actor.execute("state_dict")
    metrics = trainer.fit()
    prm1, policy1 = worker.prm.module.state_dict(), trainer.actor.execute("state_dict")
    ref_same = all(torch.equal(worker.prm.ref_module.state_dict()[k], prm0[k]) for k in prm0)
    trainer.shutdown()
    assert any(not torch.equal(prm0[k], prm1[k]) for k in prm0), "the PRM did not train"
    assert ref_same, "the PRM's reference must stay frozen"
    assert any(not torch.equal(policy0[k], policy1[k]) for k in policy0)
    for key in ("prime/prm_loss", "prime/prm_acc", "prime/dense_reward/mean", "timing_s/update_prm",
                "timing_s/prm_rewards", "actor/pg_loss"):
        assert key in metrics and math.isfinite(metrics[key]), key
    # the first step's PRM starts equal to its reference: implicit reward 0, loss log 2 per sample
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["prime/prm_loss"] == pytest.approx(math.log(2), rel=0.02)


@pytest.mark.parametrize("overrides, match", [
    (["algorithm.prime.beta_train=0.1"], "algorithm.prime.beta_train is set but algorithm.adv_estimator=grpo"),
    (["algorithm.adv_estimator=prime", "algorithm.prime.granularity=step"], "algorithm.prime.granularity"),
    (["algorithm.adv_estimator=prime", "algorithm.prime.norm=z"], "algorithm.prime.norm"),
    (["algorithm.adv_estimator=prime", "algorithm.prime.beta_train=0"], "algorithm.prime.beta_train"),
    (["algorithm.adv_estimator=prime", "algorithm.prime.reward_gt_coef=-1"], "algorithm.prime.reward_gt_coef"),
    (["algorithm.adv_estimator=prime", "algorithm.prime.mini_batch_size=3"], "algorithm.prime.mini_batch_size"),
    (["algorithm.adv_estimator=prime", "actor_rollout_ref.rollout.n=1",
      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"], "rollout.n >= 2"),
])
def test_bad_prime_settings_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(["actor_rollout_ref.model.path=M", "data.train_batch_size=4",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=4",
                     "algorithm.adv_estimator=grpo", *overrides])


def test_prime_checkpoint_carries_the_prm(tiny_model_dir, data, tmp_path):
    from tiller.trainer.rl import RLTrainer

    cfg = _cfg(tmp_path / "run", tiny_model_dir, data, "algorithm.adv_estimator=prime", "algorithm.prime.lr=1e-3",
               "trainer.save_freq=2")
    trainer = RLTrainer(cfg)
    trainer.fit()
    trained = {k: v.clone() for k, v in trainer.actor.worker.prm.module.state_dict().items()}
    trainer.shutdown()
    cfg = _cfg(tmp_path / "run", tiny_model_dir, data, "algorithm.adv_estimator=prime", "algorithm.prime.lr=1e-3",
               "trainer.resume_mode=auto", "trainer.total_training_steps=3")
    resumed = RLTrainer(cfg)
    resumed._maybe_resume()
    now = resumed.actor.worker.prm.module.state_dict()
    assert resumed.global_step == 2 and all(torch.equal(trained[k], now[k]) for k in trained)
    assert resumed.actor.worker.prm.optimizer.state  # Adam moments restored too
    resumed.shutdown()


@pytest.fixture(scope="module")
def arithmetic_starter(tmp_path_factory):
    """A 1M-parameter Qwen2 warmed on two-digit addition to ~0.3 greedy accuracy (~525 supervised steps, ~80 s)."""
    from tiller.models.tiny import build_model, train_tokenizer
    from tiller.trainer.demo import PROMPT_TEMPLATE, warm_up

    out = tmp_path_factory.mktemp("prime_starter") / "starter"
    tok = train_tokenizer()
    tok.chat_template = PROMPT_TEMPLATE  # warm_up renders through it: the bare prompt, as the arms' raw prompts
    model = build_model(tok, "qwen2", n_params=1_000_000, seed=0)
    train, _ = arithmetic.make_splits(n_train=2256, n_test=8, seed=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        warm_up(model, tok, train[:-256], train[-128:], target=0.3, seed=0, log=lambda *_: None)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _arm(run_dir, starter, data, *extra):
    from tiller.trainer.rl import run

    cfg = load_config([
        f"actor_rollout_ref.model.path={starter}",
        f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'test.parquet'}]",
        "data.apply_chat_template=false", "data.max_prompt_length=16", "data.max_response_length=6",
        "data.train_batch_size=16", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128", "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=10", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean", "actor_rollout_ref.rollout.dtype=float32",
        "trainer.total_training_steps=40", "trainer.test_freq=-1", "trainer.val_before_train=true",
        "trainer.logger=[jsonl]", "trainer.resume_mode=disable", "trainer.save_freq=-1",
        f"trainer.default_local_dir={run_dir}", *extra])
    run(cfg)
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    key = f"val-core/{arithmetic.DATA_SOURCE}/acc/mean@1"
    vals = [r[key] for r in rows if key in r]
    return vals[0], vals[-1], [r for r in rows if "critic/score/mean" in r]


@pytest.mark.slow
def test_prime_against_outcome_only_grpo_at_equal_steps(arithmetic_starter, tmp_path):
    """40 steps of 16 prompts x 8 from the same warmed starter and seed: GRPO (outcome only), PRIME with verl's
    coefficients (dense 5, outcome 5) and PRIME with dense 1 (PRM lr 1e-4 in both). Greedy accuracy on 256 held-out
    prompts before / after, measured on the 2-core EPYC host (trainer.seed 1, the default, and 2):
        GRPO           0.328 -> 0.340 | 0.328 -> 0.434
        PRIME dense 1  0.328 -> 0.348 | 0.328 -> 0.379
        PRIME dense 5  0.328 -> 0.004 | 0.328 -> 0.094   (collapses)
    PRIME does not beat outcome-only GRPO at this scale: the implicit PRM learns the outcome labels (its loss falls
    from log 2 to ~0.6) but its token rewards are noise at a 1M model, and batch_norm scales that noise to the size
    of the outcome reward; at verl's dense coefficient 5 the noise wins. Asserted: what holds (GRPO and PRIME with a
    dense weight of 1 keep their accuracy, the PRM learns); the comparison is printed."""
    data = tmp_path / "data"
    arithmetic.write_task(data, n_train=2000, n_test=256, seed=0)
    grpo = _arm(tmp_path / "grpo", arithmetic_starter, data, "algorithm.adv_estimator=grpo")
    prime1 = _arm(tmp_path / "prime1", arithmetic_starter, data, "algorithm.adv_estimator=prime",
                  "algorithm.prime.lr=1e-4", "algorithm.prime.reward_dpo_coef=1")
    prime5 = _arm(tmp_path / "prime5", arithmetic_starter, data, "algorithm.adv_estimator=prime",
                  "algorithm.prime.lr=1e-4")
    for name, (before, after, _) in (("grpo", grpo), ("prime dense 1", prime1), ("prime dense 5", prime5)):
        print(f"{name}: held-out greedy accuracy {before:.3f} -> {after:.3f}")
    assert grpo[1] >= grpo[0] - 0.05
    assert prime1[1] >= prime1[0] - 0.05
    late = [r["prime/prm_loss"] for r in prime1[2][-10:]]
    assert sum(late) / len(late) < math.log(2) - 0.03  # the implicit PRM learned the outcome labels
