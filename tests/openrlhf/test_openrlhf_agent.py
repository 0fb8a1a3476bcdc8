"""OpenRLHF agent files (`--agent_func_path`, 0.10+: `--train.agent_func_path`): loaded without OpenRLHF installed, their AgentInstance driven
by tiller's environment loop (rewards summed over the steps, as OpenRLHF's executor), end to end through
`tiller openrlhf train_ppo_ray`."""

from __future__ import annotations

import json
import sys

import pytest

from tests.openrlhf.test_openrlhf_e2e import _actor_changed, metrics, ppo_argv, run
from tiller.errors import ConfigError
from tiller.openrlhf.cli import resolve
from tiller.rollout.environments import load_environment

# OpenRLHF 0.10's layout (examples/python/agent_func.py): two steps, reward 0.25 then 1 if the answer has a digit
AGENT_010 = '''
import json, os
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.step_idx += 1
        done = self.step_idx >= 2
        digit = any(c.isdigit() for c in states["action_text"])
        reward = torch.tensor((1.0 if digit else 0.0) if done else 0.25)
        log = os.environ.get("TILLER_TEST_AGENT_LOG")
        if log:
            with open(log, "a") as fh:
                fh.write(json.dumps({"label": states["label"], "step": self.step_idx}) + "\\n")
        return {"rewards": reward, "scores": reward, "environment_feedback": "\\nagain: ", "done": done,
                "sampling_params": states.get("sampling_params"), "extra_logs": {}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''

# OpenRLHF 0.8.x: the executor's constructor takes the engine's arguments and passes the instance class first
AGENT_08 = '''
from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase


class Counter(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        pass

    async def step(self, states, **kwargs):
        return {"rewards": 1.0, "environment_feedback": "", "done": True}


class AgentExecutor(AgentExecutorBase):
    def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
        super().__init__(Counter, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)
'''

CUSTOM_EXECUTE = AGENT_08 + '''

    async def execute(self, prompt, label, sampling_params):
        return {}
'''


def test_agent_files_load_without_openrlhf(tmp_path):
    before = sys.modules.get("openrlhf")  # (under pytest, tests/openrlhf itself is a package of that name)
    for name, src, want in (("a010.py", AGENT_010, "AgentInstance"), ("a08.py", AGENT_08, "Counter")):
        (tmp_path / name).write_text(src)
        cls = load_environment(str(tmp_path / name), "AgentExecutor")
        assert cls.__name__ == want
        assert sys.modules.get("openrlhf") is before  # the stand-in module is gone after the import
    (tmp_path / "custom.py").write_text(CUSTOM_EXECUTE)
    with pytest.raises(ConfigError, match=r"custom.py: AgentExecutor overrides execute\(\)"):
        load_environment(str(tmp_path / "custom.py"), "AgentExecutor")


def test_train_ppo_ray_with_an_agent_func_path(tmp_path, tiny_model_dir, monkeypatch):
    (tmp_path / "agent_func.py").write_text(AGENT_010)
    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("TILLER_TEST_AGENT_LOG", str(log))
    argv = ppo_argv(tmp_path, tiny_model_dir, "unused.py", "--advantage_estimator", "reinforce_baseline",
                    "--dynamic_filtering", "algorithm.filter_groups.max_num_gen_batches=3")
    argv[argv.index("--remote_rm_url"):argv.index("--remote_rm_url") + 2] = ["--agent_func_path",
                                                                             str(tmp_path / "agent_func.py")]
    cfg = resolve(argv)[2]
    agent = cfg.actor_rollout_ref.rollout.agent
    assert cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.metric == "acc"
    assert (agent.env_path, agent.env_name, agent.max_context) == (str(tmp_path / "agent_func.py"), "AgentExecutor",
                                                                    32 + 6)
    run(argv)
    rows = metrics(tmp_path / "run")
    assert len(rows) == 2 and all(r["agent/segments_per_episode/mean"] == 2.0 for r in rows)  # two steps each
    for r in rows:  # the episode's reward is 0.25 + (0 or 1): the sum of its steps' rewards, as OpenRLHF's
        assert 0.25 <= r["agent/reward/mean"] <= 1.25 and r["critic/score/min"] >= 0.25
        # dynamic filtering reads OpenRLHF's scores (the last step's: 0 or 1), kept groups are whole episodes
        assert r["reward_extra/acc/mean"] == pytest.approx(r["agent/reward/mean"] - 0.25, abs=1e-6)
        assert 1 <= r["batch/num_groups_kept"] <= 4 and r["batch/num_gen_batches"] <= 3
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    rounds = sum(r["batch/num_gen_batches"] for r in rows)
    assert len(steps) == rounds * 16 * 2  # generation rounds x 16 episodes x 2 turns
    assert {s["label"] for s in steps} <= {"3", "7", "6", "9", "8"}  # the --label_key column
    assert _actor_changed(tmp_path / "run", tiny_model_dir)


def test_train_ppo_ray_with_an_agent_func_path_and_async_train(tmp_path, tiny_model_dir):
    # --async_train with an agent file: the rollout producer runs the episodes one step ahead (docs/async.md)
    (tmp_path / "agent_func.py").write_text(AGENT_010)
    argv = ppo_argv(tmp_path, tiny_model_dir, "unused.py", "--advantage_estimator", "reinforce_baseline",
                    "--async_train")
    argv[argv.index("--remote_rm_url"):argv.index("--remote_rm_url") + 2] = ["--agent_func_path",
                                                                             str(tmp_path / "agent_func.py")]
    cfg = resolve(argv)[2]
    assert cfg.async_training.staleness_threshold == 1 and cfg.actor_rollout_ref.rollout.agent.env_path
    run(argv)
    rows = metrics(tmp_path / "run")
    assert len(rows) == 2
    for step, r in enumerate(rows, 1):
        assert r["agent/segments_per_episode/mean"] == 2.0 and 0.25 <= r["agent/reward/mean"] <= 1.25
        assert r["async/policy_version"] == step - 1 and r["async/staleness_max"] <= min(1, step - 1)
        assert r["async/dropped_stale"] == 0
    assert _actor_changed(tmp_path / "run", tiny_model_dir)
