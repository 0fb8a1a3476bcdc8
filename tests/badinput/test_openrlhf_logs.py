"""OpenRLHF reward replies whose `extra_logs` are not numbers (strings, None, objects, ragged or wrong-length lists):
skipped with one warning per name, the numeric logs and the rewards kept; `tiller openrlhf train_ppo_ray` against
such a remote reward server trains instead of failing with `could not convert string to float`."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from tests.rewards.test_rewards_remote import serve
from tiller.rewards import openrlhf_api
from tiller.rewards.openrlhf_api import parse_reply

BAD_LOGS = {
    "per_sample_strings": ["ok", "bad", "ok"],
    "one_string": "v1.2",
    "none": None,
    "object": {"nested": 1},
    "ragged": [[1, 2], [3]],
    "mixed": ["1", 2, 3.0],
    "wrong_length": [1.0, 2.0],
}


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(openrlhf_api, "_WARNED", set())


@pytest.mark.parametrize("name", sorted(BAD_LOGS))
def test_a_non_numeric_log_is_skipped_with_one_warning(caplog, name):
    reply = {"rewards": [1.0, 0.0, 0.5], "extra_logs": {name: BAD_LOGS[name], "len": [3, 4, 5], "version": 7}}
    with caplog.at_level(logging.WARNING, logger="tiller.rewards.openrlhf_api"):
        first = parse_reply(reply, 3, "reward_model.remote_url http://x/get_reward")
        second = parse_reply(reply, 3, "reward_model.remote_url http://x/get_reward")
    for batch in (first, second):
        assert batch.scores.tolist() == [1.0, 0.0, 0.5]
        assert batch.extras["len"].tolist() == [3, 4, 5] and batch.metrics["reward/version"] == 7.0
        assert name not in batch.extras and f"reward/{name}" not in batch.metrics
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned  # once per name, not once per step
    assert warned[0].startswith(f"reward_model.remote_url http://x/get_reward: extra_logs['{name}'] is ")
    assert "not logged" in warned[0] and "\n" not in warned[0]


def test_numeric_logs_of_every_kind_are_kept(caplog):
    import torch

    reply = {"rewards": [1, 2], "extra_logs": {"t": torch.tensor([1.5, 2.5]), "b": [True, False], "s": 3,
                                               "a": np.array([4.0])}}
    with caplog.at_level(logging.WARNING, logger="tiller.rewards.openrlhf_api"):
        batch = parse_reply(reply, 2, "here")
    assert batch.extras["t"].tolist() == [1.5, 2.5] and batch.extras["b"].tolist() == [1.0, 0.0]
    assert batch.metrics["reward/s"] == 3.0 and batch.metrics["reward/a"] == 4.0 and not caplog.records


def test_train_ppo_ray_against_a_server_with_string_logs(tmp_path, tiny_model_dir, capsys):
    from fastapi import FastAPI

    from tiller.cli import main

    app = FastAPI()

    @app.post("/get_reward")
    def get_reward(body: dict) -> dict:
        rewards = [float(sum(c.isdigit() for c in q)) for q in body["query"]]
        return {"rewards": rewards, "scores": rewards,
                "extra_logs": {"verdict": ["pass" if r else "fail" for r in rewards], "digits": rewards}}

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"What is {a} + 1?", "answer": str(a + 1)}) + "\n"
                               for a in range(4)))
    with serve(app) as url:
        code = main(["openrlhf", "train_ppo_ray", "--pretrain", str(tiny_model_dir), "--remote_rm_url",
                     url.rsplit("/", 1)[0] + "/get_reward", "--prompt_data", str(prompts), "--input_key", "question",
                     "--label_key", "answer", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2",
                     "--train_batch_size", "4", "--rollout_batch_size", "2", "--micro_train_batch_size", "4",
                     "--micro_rollout_batch_size", "4", "--prompt_max_len", "32", "--generate_max_len", "2",
                     "--save_path", str(tmp_path / "run"), "trainer.total_training_steps=1", "trainer.logger=[jsonl]",
                     "trainer.num_threads=1", "trainer.save_freq=-1"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.count("extra_logs['verdict'] is not numbers") == 1, err
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["training/global_step"] == 1 and "reward_extra/digits/mean" in row, row
    assert not any("verdict" in k for k in row), row
