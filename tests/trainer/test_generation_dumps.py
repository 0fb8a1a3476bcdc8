"""verl's trainer.rollout_data_dir / trainer.validation_data_dir: each step's samples as <dir>/<step>.jsonl with
verl's keys, the numbers the run trained and validated on."""

from __future__ import annotations

import json

import pytest

from tests.trainer.test_rl import _train, make_cfg, rl_data  # noqa: F401  (fixture)
from tiller.data.files import read_rows
from tiller.errors import ConfigError

# a reward with an extra output (verl's dict return): the digit count rides along to the dumps
DICT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(c.isdigit() for c in solution_str)
    return {"score": digits / max(len(solution_str), 1), "digits": digits}
'''


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rollout_and_validation_dumps(tmp_path, tiny_model_dir, rl_data):  # noqa: F811
    from tiller.trainer.rl import RLTrainer

    (tmp_path / "dict_reward.py").write_text(DICT_REWARD)
    rollouts, vals = tmp_path / "rollouts", tmp_path / "val_dump"
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, f"custom_reward_function.path={tmp_path / 'dict_reward.py'}",
                   f"trainer.rollout_data_dir={rollouts}", f"trainer.validation_data_dir={vals}",
                   "trainer.val_before_train=true", "trainer.test_freq=1")
    trainer = RLTrainer(cfg)
    tok = trainer.tokenizer
    last = trainer.fit()
    trainer.shutdown()
    assert sorted(p.name for p in rollouts.iterdir()) == ["1.jsonl", "2.jsonl"]  # no temp file left beside them
    assert sorted(p.name for p in vals.iterdir()) == ["0.jsonl", "1.jsonl", "2.jsonl"]
    assert "timing_s/dump_rollout_generations" in last
    truths = {str(row["reward_model"]["ground_truth"]) for row in read_rows(rl_data / "train.parquet")}
    for step in (1, 2):
        rows = _read(rollouts / f"{step}.jsonl")
        assert len(rows) == 4 * 4  # train_batch_size x rollout.n
        assert list(rows[0]) == ["input", "output", "gts", "score", "step", "uid", "digits"]  # verl's keys first
        for row in rows:
            assert row["step"] == step
            assert row["digits"] == sum(c.isdigit() for c in row["output"])
            assert row["score"] == pytest.approx(row["digits"] / max(len(row["output"]), 1))
            assert str(row["gts"]) in truths
        groups: dict[str, list] = {}
        for row in rows:
            groups.setdefault(row["uid"], []).append(row)
        assert len(groups) == 4 and all(len(g) == 4 and len({r["input"] for r in g}) == 1 for g in groups.values())
        # the prompt as the policy saw it (chat template applied), without special tokens
        first = rows[0]["input"]
        assert first == tok.decode(tok(first, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
    val = _read(vals / "2.jsonl")
    test = read_rows(rl_data / "test.parquet")
    assert len(val) == len(test)  # val_kwargs.n = 1
    assert [str(r["gts"]) for r in val] == [str(r["reward_model"]["ground_truth"]) for r in test]
    assert {r["step"] for r in val} == {2} and {r["step"] for r in _read(vals / "0.jsonl")} == {0}
    assert sum(r["score"] for r in val) / len(val) == pytest.approx(last["val-aux/tiller/arithmetic/reward/mean@1"])


def test_rollout_penalties_reach_training_and_validation(tmp_path, tiny_model_dir, rl_data):  # noqa: F811
    """rollout.repetition_penalty (verl's) and frequency_penalty (vLLM's) change what the run samples, in training and
    in its greedy validation: the kit's fresh model repeats one token under greedy decoding, the penalties break it."""
    from tiller.trainer.rl import RLTrainer

    distinct = {}
    for name, extra in (("plain", []), ("penalised", ["actor_rollout_ref.rollout.repetition_penalty=3.0",
                                                      "actor_rollout_ref.rollout.frequency_penalty=1.0"])):
        vals = tmp_path / f"val_{name}"
        cfg = make_cfg(tmp_path / name, tiny_model_dir, rl_data, f"trainer.validation_data_dir={vals}",
                       "trainer.val_before_train=true", "trainer.total_training_steps=1", "trainer.test_freq=0",
                       "data.max_response_length=8", *extra)
        trainer = RLTrainer(cfg)
        assert trainer._train_sampling(1)["repetition_penalty"] == (3.0 if extra else 1.0)
        trainer.fit()
        tok = trainer.tokenizer
        trainer.shutdown()
        rows = _read(vals / "0.jsonl")
        ids = [tok(r["output"], add_special_tokens=False)["input_ids"] for r in rows]
        distinct[name] = sum(len(set(row)) for row in ids) / len(ids)
    assert distinct["plain"] <= 3 and distinct["penalised"] >= 5, distinct


def test_a_rollout_regex_constrains_training_and_validation(tmp_path, tiny_model_dir, rl_data):  # noqa: F811
    """rollout.structured_outputs_regex (TRL's vllm_structured_outputs_regex): every sample the run trains and
    validates on matches it in full; a bad regex or the hf engine is refused at load, naming the key."""
    import re

    from tiller.trainer.rl import RLTrainer

    rollouts, vals = tmp_path / "rollouts", tmp_path / "vals"
    key = "actor_rollout_ref.rollout.structured_outputs_regex"
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, f"{key}='[1-9][0-9]?'",
                   f"trainer.rollout_data_dir={rollouts}", f"trainer.validation_data_dir={vals}",
                   "trainer.val_before_train=true", "trainer.test_freq=0", "trainer.total_training_steps=1")
    trainer = RLTrainer(cfg)
    trainer.fit()
    trainer.shutdown()
    outputs = [r["output"] for r in _read(rollouts / "1.jsonl") + _read(vals / "0.jsonl")]
    assert len(outputs) == 16 + len(read_rows(rl_data / "test.parquet"))
    assert all(re.fullmatch("[1-9][0-9]?", o) for o in outputs), outputs
    for pattern, extra, match in (
            ("[0-9", [], "unclosed character class"),
            ("[0-9]+", ["actor_rollout_ref.rollout.name=hf"], "with rollout.name=hf: the regex constraint runs on"),
            ("[0-9]+", [f"actor_rollout_ref.rollout.agent.path={tmp_path / 'agent.py'}",
                        "actor_rollout_ref.rollout.agent.name=f", "actor_rollout_ref.rollout.name=vllm"],
             "the agent endpoint constrains its requests by the native engine")):
        with pytest.raises(ConfigError, match=match):
            make_cfg(tmp_path / "bad", tiny_model_dir, rl_data, f"{key}='{pattern}'", *extra)


@pytest.mark.parametrize("key", ["rollout_data_dir", "validation_data_dir"])
def test_a_dump_dir_that_is_a_file_is_refused(tmp_path, tiny_model_dir, rl_data, key):  # noqa: F811
    (tmp_path / "taken").write_text("x")
    with pytest.raises(ConfigError, match=f"trainer.{key}=.*taken: that path is a file"):
        make_cfg(tmp_path / "run", tiny_model_dir, rl_data, f"trainer.{key}={tmp_path / 'taken'}")


def test_pf_ppo_trains_on_samples_redrawn_by_reward(tmp_path, tiny_model_dir, rl_data):  # noqa: F811
    """algorithm.use_pf_ppo with max_min: the batch the update sees (dumped after the resampling, as verl's) holds
    only the step's best- and worst-scored samples, redrawn with replacement."""
    rollouts = tmp_path / "rollouts"
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, "algorithm.adv_estimator=gae",
                   "algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_min",
                   f"trainer.rollout_data_dir={rollouts}", "trainer.total_training_steps=1")
    metrics, changed, _ = _train(cfg)
    assert changed  # the actor and the critic
    rows = _read(rollouts / "1.jsonl")
    assert len(rows) == 16
    scores = [r["score"] for r in rows]
    assert len(set(scores)) <= 2  # only the extremes survive the max_min weights
    assert metrics["pf_ppo/unique_samples"] < 16  # with replacement from few: repeats


@pytest.mark.parametrize("override, named", [
    ("algorithm.adv_estimator=grpo", "needs algorithm.adv_estimator=gae"),
    ("algorithm.pf_ppo.reweight_method=median", "algorithm.pf_ppo.reweight_method"),
    ("algorithm.pf_ppo.weight_pow=-1", "algorithm.pf_ppo.weight_pow"),
    ("+algorithm.pf_ppo.temperature=2", "algorithm.pf_ppo takes reweight_method and weight_pow"),
])
def test_pf_ppo_bad_settings_are_refused(tmp_path, tiny_model_dir, rl_data, override, named):  # noqa: F811
    with pytest.raises(ConfigError, match=named):
        make_cfg(tmp_path / "run", tiny_model_dir, rl_data, "algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true",
                 override)
