"""vLLM inside Ray workers, against the installed vLLM: GRPO on 2 Ray workers (one vLLM engine per rank, verl's
layout) and asynchronous RL whose rollout pool generates with vLLM, fed the trainer's weights through Ray's object
store. Each run checks the rollout-vs-actor mismatch of every step: the trainer recomputes the rollout's logprobs
with its own weights, so a vLLM engine that missed a weight push (still sampling with older weights, after
updates at lr 3e-2) shows it at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainer.test_rl import make_cfg, rl_data  # noqa: F401  (rl_data is a fixture)
from tests.vllm_lane.conftest import RL_ENGINE

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.vllm, pytest.mark.ray]

STEPS = ("data.val_files=[]", "actor_rollout_ref.actor.optim.lr=3e-2", "actor_rollout_ref.rollout.enforce_eager=true")


@pytest.fixture(scope="module")
def ray_two_cpus():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _fit(cfg) -> list[dict]:
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    rows = (Path(cfg.trainer.default_local_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in rows]


def _assert_in_step(rows: list[dict], steps: int) -> None:
    assert [r["training/global_step"] for r in rows] == list(range(1, steps + 1))
    assert rows[-1]["actor/grad_norm"] > 0
    for r in rows:  # every step's samples came from the weights the trainer holds
        assert r["training/rollout_probs_diff_mean"] < 1e-4, (r["training/global_step"], r)


@pytest.mark.slow  # ~65 s: two vLLM engines (.ci/run's lane runs "vllm and not slow"; run this file by hand)
def test_grpo_on_two_ray_workers_each_with_its_vllm(ray_two_cpus, tmp_path, sharp_model_dir, rl_data):  # noqa: F811
    rows = _fit(make_cfg(tmp_path, sharp_model_dir, rl_data, *RL_ENGINE, *STEPS, "trainer.backend=ray",
                         "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=fsdp",
                         "trainer.total_training_steps=3"))
    _assert_in_step(rows, 3)


@pytest.mark.slow  # ~60 s: a vLLM start in a Ray worker imports vLLM afresh (~40 s on 2 cores)
@pytest.mark.parametrize("validate", [False, True], ids=["", "validate"])
def test_async_rollout_pool_generates_with_vllm(validate, ray_two_cpus, tmp_path, sharp_model_dir,
                                                rl_data):  # noqa: F811
    """staleness_threshold=0.5: step 2's batch is generated with the weights published after step 1, so the
    pool's vLLM must hold them: the mismatch stays at the engines' rounding, as synchronously. `validate`: after the
    last step the trainer's worker validates, its vLLM started then with the trainer's weights."""
    val = [f"data.val_files=[{rl_data / 'test.parquet'}]"] if validate else []
    rows = _fit(make_cfg(tmp_path, sharp_model_dir, rl_data, *RL_ENGINE, *STEPS, "trainer.backend=ray",
                         "trainer.n_gpus_per_node=1", "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
                         "async_training.staleness_threshold=0.5", "trainer.total_training_steps=2", *val))
    _assert_in_step(rows, 2)
    assert [r["async/policy_version"] for r in rows] == [0.0, 1.0]
    assert all(r["async/staleness_max"] == 0.0 for r in rows)
    if validate:
        assert 0.0 <= rows[-1]["val-core/tiller/arithmetic/acc/mean@1"] <= 1.0
