"""Two runs never mix in one run dir; a config that would train on nothing or crash mid-step is refused up front."""

from __future__ import annotations

import json

import pytest

from tests.trainer.test_rl import make_cfg, rl_data  # noqa: F401  (fixture)
from tiller.cli import main
from tiller.errors import ConfigError


def _steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_a_second_run_into_the_same_dir_is_refused_unless_overwrite(tmp_path, tiny_model_dir, rl_data):  # noqa: F811
    from tiller.trainer.rl import RLTrainer

    run_dir = tmp_path / "run"
    trainer = RLTrainer(make_cfg(run_dir, tiny_model_dir, rl_data, "trainer.save_freq=1"))
    trainer.fit()
    trainer.shutdown()
    first = _steps(run_dir)
    assert first[-1] == 2 and (run_dir / "checkpoints").is_dir()
    with pytest.raises(ConfigError, match="trainer.overwrite=true"):
        RLTrainer(make_cfg(run_dir, tiny_model_dir, rl_data))  # resume_mode=disable
    assert _steps(run_dir) == first  # nothing touched by the refused run
    trainer = RLTrainer(make_cfg(run_dir, tiny_model_dir, rl_data, "trainer.overwrite=true",
                                 "trainer.total_training_steps=1"))
    trainer.fit()
    trainer.shutdown()
    assert _steps(run_dir) == [1]  # the earlier run's metrics and checkpoints are gone, not mixed in
    assert not (run_dir / "checkpoints" / "global_step_2").exists()


def test_auto_resume_continues_its_own_run(tmp_path, tiny_model_dir, rl_data):  # noqa: F811
    from tiller.trainer.rl import RLTrainer

    run_dir = tmp_path / "run"
    cfg = make_cfg(run_dir, tiny_model_dir, rl_data, "trainer.save_freq=1", "trainer.resume_mode=auto",
                   "trainer.total_training_steps=1")
    trainer = RLTrainer(cfg)
    trainer.fit()
    trainer.shutdown()
    trainer = RLTrainer(make_cfg(run_dir, tiny_model_dir, rl_data, "trainer.save_freq=1", "trainer.resume_mode=auto"))
    trainer.fit()
    trainer.shutdown()
    assert _steps(run_dir) == [1, 2]


@pytest.mark.parametrize("override, named", [
    ("trainer.total_training_steps=0", "trainer.total_training_steps"),
    ("trainer.total_epochs=0", "trainer.total_epochs"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0", "ppo_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=-1", "ppo_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0", "rollout.log_prob_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=-2", "ref.log_prob_micro_batch_size_per_gpu"),
    ("critic.ppo_micro_batch_size_per_gpu=0", "critic.ppo_micro_batch_size_per_gpu"),
    ("critic.ppo_mini_batch_size=3", "critic.ppo_mini_batch_size"),
    ("critic.ppo_mini_batch_size=0", "critic.ppo_mini_batch_size"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=5", "actor.ppo_mini_batch_size"),
])
def test_batch_and_step_counts_are_checked_before_anything_runs(capsys, override, named):
    assert main(["config", "show", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                 override]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err and "Traceback" not in err


@pytest.mark.parametrize("damaged", ["model/model.safetensors", "optimizer.pt", "state.pt"])
def test_resume_skips_a_damaged_latest_checkpoint(tmp_path, tiny_model_dir, rl_data, capsys, damaged):  # noqa: F811
    from tiller.trainer.rl import RLTrainer

    run_dir = tmp_path / "run"
    opts = ("trainer.save_freq=1", "trainer.resume_mode=auto")
    trainer = RLTrainer(make_cfg(run_dir, tiny_model_dir, rl_data, *opts))
    trainer.fit()
    trainer.shutdown()
    victim = run_dir / "checkpoints" / "global_step_2" / damaged
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 3])
    trainer = RLTrainer(make_cfg(run_dir, tiny_model_dir, rl_data, *opts, "trainer.total_training_steps=3"))
    trainer.fit()
    trainer.shutdown()
    out = capsys.readouterr().out
    assert "global_step_2 does not load" in out and "resumed from" in out and "global_step_1" in out
    assert trainer.global_step == 3 and _steps(run_dir)[-2:] == [2, 3]
