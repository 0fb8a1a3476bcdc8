"""verl custom agent loops (`agent.agent_loop_config_path`) with trainer.backend=ray: each rank builds the loops from
the YAML (the class by file path), runs its prompt chunk's samples seeded per chunk, and hands the trajectories (and
the loops' per-sample results) back, so 2 Ray workers train exactly as one process sampling in 2 seeded chunks.
One step is compared: after an update the two runs' weights differ by the order of the gradient's cross-rank sum
(~1e-6), which can flip a sampled token at a near-tie in the next step's ~1,000 samples (seen once)."""

from __future__ import annotations

import pytest

from tests.distributed import test_rl_ray as base
from tests.trainer.test_verl_agent_loop import AGENT_PY

rl_data = base.rl_data  # (the fixture: 48 arithmetic prompts and a reward that varies within every group)
pytestmark = [pytest.mark.ray, pytest.mark.slow]  # ~1 min: two 1-step runs, one on 2 Ray workers


def test_custom_loops_two_ray_workers_equal_one_process(ray_session, tmp_path, tiny_model_dir, rl_data):
    (tmp_path / "my_loops.py").write_text(AGENT_PY)
    (tmp_path / "loops.yaml").write_text(f"- name: two_turn\n  _target_: {tmp_path / 'my_loops.py'}:TwoTurnAgentLoop\n")
    keys = (f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path / 'loops.yaml'}",
            "actor_rollout_ref.rollout.agent.default_agent_loop=two_turn", "data.max_response_length=16",
            "trainer.total_training_steps=1")
    local = base.train(base.make_cfg(tmp_path / "local", tiny_model_dir, rl_data, *keys), seed_chunks=2)
    ray_run = base.train(base.make_cfg(tmp_path / "ray", tiny_model_dir, rl_data, *keys, *base.RAY))
    base.assert_same(ray_run, local, steps=1)
