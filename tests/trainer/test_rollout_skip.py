"""verl's skip.rollout: listed steps' rollouts dumped on one run and loaded instead of generated on the next
(`tiller.trainer.rollout_skip`)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.test_rl import make_cfg, rl_data  # noqa: F401  (fixture)
from tiller.config import load_config
from tiller.errors import ConfigError, DataError
from tiller.protocol import Batch
from tiller.trainer.rollout_skip import RolloutSkip


def _outputs(directory, step):
    return [json.loads(line)["output"] for line in (directory / f"{step}.jsonl").read_text().splitlines()]


def _fit(cfg):
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(cfg)
    last = trainer.fit()
    trainer.shutdown()
    return last


def test_a_second_run_loads_the_first_runs_rollouts(tmp_path, tiny_model_dir, rl_data):  # noqa: F811
    dumps = tmp_path / "dumps"
    skip = ["skip.rollout.enable=true", "skip.rollout.steps=[1,2]", f"skip.rollout.dump_dir={dumps}"]
    _fit(make_cfg(tmp_path / "a", tiny_model_dir, rl_data, *skip, f"trainer.rollout_data_dir={tmp_path / 'ra'}"))
    root = dumps / "run_tiller" / "GBS4_N4_in32_out6"  # <experiment>_<project>/GBS<g>_N<n>_in<p>_out<r>
    assert sorted(p.name for p in (root / "1").iterdir()) == ["gen_batch.pkl", "meta.json"]  # no temp file left
    assert json.loads((root / "2" / "meta.json").read_text()) == {"global_steps": 2}
    # another sampling seed: the listed steps still train on the first run's samples
    last = _fit(make_cfg(tmp_path / "b", tiny_model_dir, rl_data, *skip, "trainer.seed=7",
                         f"trainer.rollout_data_dir={tmp_path / 'rb'}"))
    assert last["skip/rollout_loaded_from_step"] == 2.0
    for step in (1, 2):
        assert _outputs(tmp_path / "rb", step) == _outputs(tmp_path / "ra", step)
    # repeat: step 3 has no dump and loads step 2's; step 1 is not listed and samples with its own seed
    last = _fit(make_cfg(tmp_path / "c", tiny_model_dir, rl_data, *skip[:2], f"skip.rollout.dump_dir={dumps}",
                         "skip.rollout.steps=[2,3]", "skip.rollout.action=repeat", "trainer.seed=7",
                         "trainer.total_training_steps=3", f"trainer.rollout_data_dir={tmp_path / 'rc'}"))
    assert last["skip/rollout_loaded_from_step"] == 2.0
    assert _outputs(tmp_path / "rc", 3) == _outputs(tmp_path / "ra", 2)
    assert _outputs(tmp_path / "rc", 1) != _outputs(tmp_path / "ra", 1)
    assert not (root / "3").exists()  # a loaded step is not dumped again


def _skip(tmp_path, *keys):
    return RolloutSkip(load_config(["data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
                                    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "skip.rollout.enable=true",
                                    f"skip.rollout.dump_dir={tmp_path}", *keys]))


def _rollout(value):
    return Batch(tensors={"responses": torch.full((4, 3), value)}, fields={"uid": ["a", "a", "b", "b"]})


def test_which_dump_a_step_loads(tmp_path):
    skip = _skip(tmp_path, "skip.rollout.steps=[2,4,6]", "skip.rollout.action=repeat")
    assert skip.source_step(4) is None  # nothing dumped: generate (and dump)
    batch, source = skip.generate(4, 1, lambda: _rollout(4))
    assert source is None and (skip.root / "4" / "gen_batch.pkl").is_file()
    batch, source = skip.generate(4, 2, lambda: _rollout(40))  # DAPO's second round of step 4: its own file
    assert source is None and (skip.root / "4" / "gen_batch_r2.pkl").is_file()
    assert skip.generate(6, 1, lambda: pytest.fail("repeat: step 6 loads step 4's"))[1] == 4
    cache = _skip(tmp_path, "skip.rollout.steps=[2,4,6]")  # cache: only a step's own dump, else generate + dump
    assert cache.generate(6, 1, lambda: _rollout(6))[1] is None
    assert [skip.source_step(s) for s in (2, 4, 5, 6, 7)] == [4, 4, None, 6, None]  # 5 and 7 are not listed
    batch, source = skip.generate(2, 1, lambda: pytest.fail("step 2 should load step 4's dump"))
    assert source == 4 and torch.equal(batch["responses"], _rollout(4)["responses"])
    assert skip.generate(2, 2, lambda: None)[1] == 4  # the round's own file of the step it repeats
    assert [cache.source_step(s) for s in (2, 4, 6)] == [None, 4, 6]
    off = _skip(tmp_path, "skip.rollout.steps=[4]", "skip.rollout.enable=false")
    assert off.source_step(4) is None


def test_bad_dumps_and_keys_are_refused_by_name(tmp_path):
    skip = _skip(tmp_path, "skip.rollout.steps=[1,2]")
    skip.generate(1, 1, lambda: _rollout(1))
    path = skip.root / "1" / "gen_batch.pkl"
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(DataError, match="gen_batch.pkl: not a readable skip.rollout dump"):
        skip.generate(1, 1, lambda: None)
    skip.generate(2, 1, lambda: Batch(tensors={"responses": torch.zeros(3, 2)}))  # 3 samples, the step makes 4
    with pytest.raises(DataError, match="holds 3 samples, this run's step generates 4"):
        skip.generate(2, 1, lambda: None)
    base = ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    for key, match in (("skip.rollout.action=random", "skip.rollout.action='random'"),
                       ("skip.rollout.steps=[0]", "skip.rollout.steps"),
                       ("skip.rollout.dump_dir=''", "skip.rollout.dump_dir")):
        with pytest.raises(ConfigError, match=match):
            load_config([*base, key])
    with pytest.raises(ConfigError, match="skip.rollout.enable=true replays the synchronous"):
        load_config([*base, "skip.rollout.enable=true", "async_training.staleness_threshold=1"])
    with pytest.raises(ConfigError, match="skip.async_rollout.enable"):
        load_config([*base, "skip.async_rollout.enable=true"])
