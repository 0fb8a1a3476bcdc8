"""Environments: a Gym-style env and OpenRLHF's AgentInstance (unchanged) driven by the built-in loop; segments
hold the exact sampled ids; rewards follow each interface's rule; the calculator tool as an environment."""

from __future__ import annotations

import pytest
import torch

from tiller.errors import UserError
from tiller.rollout import SamplingParams


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from tiller.evaluation.runner import load_policy

    return load_policy(str(tiny_model_dir), dtype="float32")


class CountdownEnv:
    """Gym-style, sync: three steps, reward 1 per step whose action has a digit, feedback names the step."""

    def reset(self, sample):
        self.t = 0
        return " go:"

    def step(self, action):
        self.t += 1
        return f" step{self.t}:", float(any(c.isdigit() for c in action)), self.t >= 3, {"t": self.t}


class AgentInstance:
    """OpenRLHF's interface, as its docs write it (async, states dicts, tensor rewards)."""

    def __init__(self, *args, **kwargs):
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs):
        assert set(states) == {"observation", "label"}
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        assert states["observation_text"].startswith("1+")
        self.step_idx += 1
        done = self.step_idx >= 2
        reward = torch.tensor(1.0 if done else 5.0)  # summed over the steps (OpenRLHF's total_reward)
        return {"rewards": reward, "scores": reward, "environment_feedback": "\nHuman: again\nAssistant:",
                "done": done, "sampling_params": states.get("sampling_params"), "extra_logs": {}}


def _samples(policy, texts):
    tok = policy.tokenizer
    return [{"prompt_text": t, "prompt_ids": tok(t, add_special_tokens=False)["input_ids"], "ground_truth": "3",
             "data_source": "x", "extra_info": {}} for t in texts]


def test_gym_env_segments_are_token_exact_and_rewards_sum(policy):
    from tiller.rollout.environments import run_env_episodes

    tok = policy.tokenizer
    samples = _samples(policy, ["1+2=", "3+4="])
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
    episodes = run_env_episodes(policy.engine, tok, CountdownEnv, samples, sampling, max_turns=5)
    again = run_env_episodes(policy.engine, tok, CountdownEnv, samples, sampling, max_turns=5)
    for ep, sample, ep2 in zip(episodes, samples, again):
        assert len(ep.segments) == 3 and ep.info["turns"] == 3
        s0, s1 = ep.segments[0], ep.segments[1]
        assert s0.prompt_ids == sample["prompt_ids"] + tok(" go:", add_special_tokens=False)["input_ids"]
        # the next context is the previous context + the sampled ids (not re-tokenized) + the observation's ids
        assert s1.prompt_ids == s0.prompt_ids + s0.response_ids + tok(" step1:", add_special_tokens=False)["input_ids"]
        want = sum(float(any(c.isdigit() for c in tok.decode(s.response_ids, skip_special_tokens=True)))
                   for s in ep.segments)
        assert ep.reward == want
        # the logprobs are the engine's for exactly that context (teacher-forced check on one segment)
        model = policy.model
        with torch.no_grad():
            ids = torch.tensor([s1.prompt_ids + s1.response_ids])
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)[len(s1.prompt_ids) - 1:-1]
        ref = logp.gather(-1, torch.tensor(s1.response_ids)[:, None]).squeeze(-1)
        assert s1.logprobs == pytest.approx(ref.tolist(), abs=1e-4)
        assert [s.response_ids for s in ep.segments] == [s.response_ids for s in ep2.segments]  # seeded


def test_openrlhf_agent_instance_loads_as_is(policy):
    from tiller.rollout.environments import run_env_episodes

    samples = _samples(policy, ["1+2="])
    sampling = SamplingParams(max_new_tokens=3, temperature=1.0, seed=0)
    (ep,) = run_env_episodes(policy.engine, policy.tokenizer, AgentInstance, samples, sampling, max_turns=6)
    assert len(ep.segments) == 2 and ep.reward == 6.0  # the sum of the steps' rewards, as OpenRLHF's executor
    assert ep.info["scores"] == 1.0  # the last step's scores (OpenRLHF's dynamic-filtering signal)
    feedback = policy.tokenizer("\nHuman: again\nAssistant:", add_special_tokens=False)["input_ids"]
    s0, s1 = ep.segments
    assert s1.prompt_ids == s0.prompt_ids + s0.response_ids + feedback


def test_tool_env_runs_the_calculator_and_failing_envs_are_user_errors(policy):
    from tiller.rollout.environments import ToolEnv, run_env_episodes
    from tiller.rollout.tools import CalculatorTool

    env = ToolEnv({"calculator": CalculatorTool()}, policy.tokenizer, reward_fn=lambda s, text: float("42" in text))
    env.reset({"prompt_text": "x"})
    obs, reward, done, info = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}'
                                       '</tool_call>')
    assert "42" in obs and not done and reward == 0.0 and info == {"tool_calls": 1}
    assert env.step("it is 42") == ("", 1.0, True, {})

    class Broken:
        def reset(self, sample):
            raise RuntimeError("no world")

    with pytest.raises(UserError, match="environment .*Broken failed on sample 0: RuntimeError: no world"):
        run_env_episodes(policy.engine, policy.tokenizer, Broken, _samples(policy, ["1+2="]),
                         SamplingParams(max_new_tokens=2))
