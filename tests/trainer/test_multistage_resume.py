"""Skywork-OR1's multi-stage response length across a resume: a run stopped in stage 1 and resumed samples the
steps after the stage boundary with stage 2's longer limit, and follows the same trajectory as a run that never
stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tiller.config import load_config
from tiller.tasks import arithmetic

# a reward the untrained model earns in varying amounts: the fraction of digits in its response
REWARD_SRC = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''
STAGES = "actor_rollout_ref.rollout.response_length_schedule=[[0,3],[3,8]]"  # steps 1-2: 3 tokens, 3+: 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("multistage")
    arithmetic.write_task(root, n_train=32, n_test=4, seed=0)
    (root / "reward.py").write_text(REWARD_SRC)
    return root


def _cfg(run_dir: Path, model_dir: Path, data: Path, *overrides: str):
    return load_config([
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{data / 'train.parquet'}]",
        f"custom_reward_function.path={data / 'reward.py'}", "data.train_batch_size=4", "data.max_prompt_length=32",
        "data.max_response_length=8", STAGES, "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.optim.lr=1e-3",
        "algorithm.adv_estimator=grpo", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={run_dir}", *overrides,
    ])


def _fit(cfg):
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
        return trainer.actor.execute("state_dict")
    finally:
        trainer.shutdown()


def _rows(path: Path) -> dict[int, dict]:
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        m = row.get("metrics", row)
        out[int(row.get("step", m.get("step")))] = {k: v for k, v in m.items() if isinstance(v, (int, float))
                                                    and not k.startswith(("timing_s/", "perf/", "time", "wall"))}
    return out


def test_resume_in_stage_one_continues_into_stage_two_with_the_longer_limit(tmp_path, tiny_model_dir, data, capsys):
    straight = _fit(_cfg(tmp_path / "a", tiny_model_dir, data, "trainer.total_training_steps=4",
                         "trainer.resume_mode=disable"))
    _fit(_cfg(tmp_path / "b", tiny_model_dir, data, "trainer.total_training_steps=2", "trainer.resume_mode=disable"))
    assert (tmp_path / "b" / "checkpoints" / "global_step_2").is_dir()  # stopped at the end of stage 1
    capsys.readouterr()
    resumed = _fit(_cfg(tmp_path / "b", tiny_model_dir, data, "trainer.total_training_steps=4",
                        "trainer.resume_mode=auto"))
    assert "resumed from" in capsys.readouterr().out

    rows = _rows(tmp_path / "b" / "metrics.jsonl")
    assert sorted(rows) == [1, 2, 3, 4]
    for step in (1, 2):  # stage 1 (before the stop)
        assert rows[step]["response_length/limit"] == 3 and rows[step]["response_length/max"] <= 3
    for step in (3, 4):  # stage 2 (after the resume)
        assert rows[step]["response_length/limit"] == 8
    assert max(rows[s]["response_length/max"] for s in (3, 4)) > 3  # the longer limit was used, not just allowed
    # clip_ratio counts responses that reached the step's own limit: stage 1's untrained model hits 3 tokens often
    assert rows[1]["response_length/clip_ratio"] > 0

    # the resumed run is the run that never stopped (same samples, same updates)
    a = _rows(tmp_path / "a" / "metrics.jsonl")
    for step in (3, 4):
        assert rows[step] == a[step], step
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
