"""`tiller rl` on verl's multi-turn tool loop (`multi_turn.enable=True`) with trainer.backend=ray: each rank runs
its prompt chunk's tool conversations, seeded per chunk as plain samples, so 2 Ray workers train exactly as one
process that samples in 2 seeded chunks (the comparison of tests/distributed/test_rl_ray.py)."""

from __future__ import annotations

import pytest

from tests.distributed import test_rl_ray as base

rl_data = base.rl_data  # (the fixture: 48 arithmetic prompts and a reward that varies within every group)
pytestmark = [pytest.mark.ray, pytest.mark.slow]  # ~1-2 min: two 2-step runs of the tool loop, one on 2 Ray workers

TOOL = ("actor_rollout_ref.rollout.multi_turn.enable=True", "data.max_prompt_length=640",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2", "trainer.total_training_steps=2")


def test_tool_rl_two_ray_workers_equal_one_process(ray_session, tmp_path, tiny_model_dir, rl_data):
    local = base.train(base.make_cfg(tmp_path / "local", tiny_model_dir, rl_data, *TOOL), seed_chunks=2)
    ray_run = base.train(base.make_cfg(tmp_path / "ray", tiny_model_dir, rl_data, *TOOL, *base.RAY,
                                       "actor_rollout_ref.actor.strategy=fsdp"))
    base.assert_same(ray_run, local, steps=2)
