"""Environments for agent rollouts: a small Gym-style interface, OpenRLHF's `AgentInstance` loaded as is, and
the built-in loop that drives either with the rollout engine, recording token-exact segments.

Gym-style (Brockman et al. 2016, text observations and actions; sync or async methods):

    class Env:
        def reset(self, sample: dict) -> str | None: ...        # text appended after the prompt (None: nothing)
        def step(self, action: str) -> tuple[str, float, bool, dict]: ...
            # (observation appended after the action, reward, done, info)

OpenRLHF (`--agent_func_path`, its `AgentInstance` class, used unchanged; a file's `AgentExecutor` stands for the
instance class it wraps, `tiller.rollout.openrlhf_agent`):

    class AgentInstance:
        async def reset(self, states: dict, **kwargs) -> {"observation": str}
            # states: {"observation": prompt text, "label": ground truth}
        async def step(self, states: dict, **kwargs) -> {"rewards", "scores", "environment_feedback", "done", ...}
            # states: {"observation_text": transcript so far, "action_text": the action, "label": ..., ...}

The loop (`run_env_episodes`), per episode: context = the prompt ids (OpenRLHF: the reset observation replaces
the prompt text); each turn the engine samples an action from the context (one `Segment`: context ids,
sampled ids, logprobs); the action's text goes to `step`; the observation is tokenized and appended after the
sampled ids (context tokens, never trained); until `done` or `max_turns`. The episode's reward is the sum of
the step rewards (Gym, and OpenRLHF's executor: `total_reward += rewards`); an OpenRLHF episode's `scores` (its
dynamic-filtering signal) is the last step's `scores`, else that sum (`episode.info["scores"]`: the batch's
`acc`, algorithm.filter_groups' default metric). Episodes run concurrently; with the native engine their turns share decode steps
(`tiller.rollout.continuous.ContinuousBatcher`).

`ToolEnv` re-expresses the tools (built-in calculator / python, YAML and `@function_tool` ones) on this interface: an
action's `<tool_call>` blocks run and their results come back as the chat template's tool messages, the step's reward
the calls' tool rewards; no call ends the episode, scored by a `reward_fn(sample, final_text) -> float`.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import replace
from typing import Any, Callable

from tiller.errors import ConfigError, UserError
from tiller.rollout.agent import execute_tool_calls, parse_tool_calls, ToolResponseEncoder, tools_kwargs_of
from tiller.rollout.base import SamplingParams
from tiller.rollout.continuous import EpisodeGenerator
from tiller.rollout.episodes import call_user, describe, Episode, failure, finite_reward, load_callable, segment_of
from tiller.rollout.openrlhf_agent import instance_class, is_openrlhf_executor, openrlhf_agent_imports


class OpenRLHFAdapter:
    """Drives an OpenRLHF `AgentInstance` through the Gym-style calls the loop makes."""

    def __init__(self, instance):
        self.instance = instance
        self.label = None
        self.transcript = ""
        self.sampling = None
        self.total = 0.0

    async def reset(self, sample: dict) -> str | None:
        self.label = sample.get("ground_truth")
        self.transcript = sample["prompt_text"]
        out = await call_user(self.instance.reset, {"observation": sample["prompt_text"], "label": self.label})
        observation = out.get("observation", sample["prompt_text"]) if isinstance(out, dict) else out
        self.transcript = observation
        return None if observation == sample["prompt_text"] else observation

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        states = {"observation_text": self.transcript, "action_text": action, "label": self.label,
                  "sampling_params": self.sampling}
        out = await call_user(self.instance.step, states)
        feedback = out.get("environment_feedback", "") or ""
        self.transcript += action + feedback
        reward = out.get("rewards", 0.0)
        self.total += finite_reward(reward, "the AgentInstance's step() rewards")
        scores = out.get("scores")  # OpenRLHF: the last step's scores, else the running total of rewards
        info = {"scores": self.total if scores is None else finite_reward(scores, "the AgentInstance's step() scores")}
        return feedback, reward, bool(out.get("done", False)), info


def load_environment(path: str, name: str) -> Callable[[], Any]:
    """A factory of fresh environments from `path`:`name` (a Gym-style class or an OpenRLHF AgentInstance)."""
    with openrlhf_agent_imports():  # an OpenRLHF agent file imports openrlhf.utils.agent
        cls = load_callable(path, name, "actor_rollout_ref.rollout.agent.env")
    if is_openrlhf_executor(cls):  # OpenRLHF's AgentExecutor: the AgentInstance it wraps
        cls = instance_class(cls, f"actor_rollout_ref.rollout.agent.env_path={path}")
    if not callable(cls):
        raise ConfigError(f"actor_rollout_ref.rollout.agent.env_name: {path}:{name} is not a class or factory")
    return cls


def _is_openrlhf(env) -> bool:
    """OpenRLHF's AgentInstance: reset / step take a `states` dict (their first parameter is named states)."""
    params = list(inspect.signature(env.reset).parameters)
    return bool(params) and params[0] == "states"


async def _episode(env, sample: dict, prompt_ids: list[int], generate, tokenizer, sampling: SamplingParams,
                   max_turns: int, version: int, max_context: int) -> Episode:
    if _is_openrlhf(env):
        env = OpenRLHFAdapter(env)
    first = await call_user(env.reset, sample)
    context = list(prompt_ids)
    if isinstance(env, OpenRLHFAdapter) and first is not None:  # the reset observation replaces the prompt text
        context = tokenizer(first, add_special_tokens=False)["input_ids"]
    elif first:
        context += tokenizer(first, add_special_tokens=False)["input_ids"]
    episode = Episode()
    rewards: list[float] = []
    for turn in range(max_turns):
        room = max_context - len(context)
        if room < 1:
            break
        turn_sampling = replace(sampling, n=1, max_new_tokens=min(sampling.max_new_tokens, room),
                                seed=None if sampling.seed is None else sampling.seed + 1_000_003 * turn)
        out = await generate(context, turn_sampling)
        ids = out.response_ids[0]
        episode.segments.append(segment_of(context, out, 0, version))
        action = tokenizer.decode(ids, skip_special_tokens=True)
        observation, reward, done, info = await call_user(env.step, action)
        rewards.append(finite_reward(reward, f"turn {turn + 1}'s step()"))
        episode.info.update({k: v for k, v in (info or {}).items() if isinstance(v, (int, float, str))})
        if done:
            break
        context = context + list(ids) + (tokenizer(observation, add_special_tokens=False)["input_ids"]
                                         if observation else [])
    episode.reward = sum(rewards)  # Gym: the return; OpenRLHF: the sum of the steps' rewards (as its executor)
    episode.info["turns"] = len(episode.segments)
    return episode


def run_env_episodes(engine, tokenizer, env_factory, samples: list[dict], sampling: SamplingParams, *,
                     max_turns: int = 8, max_response_length: int | None = None, policy_version: int = 0,
                     max_concurrency: int = 0, max_context: int | None = None, weights_hook=None) -> list[Episode]:
    """One episode per sample (fresh env each, `samples[i]` as `reset`'s argument; `samples[i]["prompt_ids"]`
    or the tokenized `prompt_text` as the first context), run concurrently; episode k uses seed
    `sampling.seed + 7919 k` when the step is seeded. Returns the episodes in order. `weights_hook` (native
    engine: asynchronous RL) is the continuous batcher's: new weights between decode steps, each segment's
    tokens recorded with their versions."""
    if max_response_length:
        sampling = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, max_response_length))
    model = getattr(getattr(engine, "weights", None), "module", None)
    limit = max_context or int(getattr(getattr(model, "config", None), "max_position_embeddings", 0) or 1 << 30)
    episodes = EpisodeGenerator(engine, weights_hook)  # (the native engine's turns share decode steps)
    generate = episodes.generate

    async def one(k: int, sample: dict, gate: asyncio.Semaphore) -> Episode:
        async with gate:
            params = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + 7919 * k)
            prompt_ids = sample.get("prompt_ids") or tokenizer(sample["prompt_text"], add_special_tokens=False)["input_ids"]
            try:
                env = env_factory()
                return await _episode(env, sample, list(prompt_ids), generate, tokenizer, params, max_turns,
                                      policy_version, limit)
            except UserError:
                raise
            except (Exception, SystemExit) as err:  # noqa: BLE001 - named and re-raised as the user's error
                raise UserError(f"actor_rollout_ref.rollout.agent.env: the environment {describe(env_factory)} "
                                f"failed on sample {k}: {failure(err)}") from err

    async def main() -> list[Episode]:
        gate = asyncio.Semaphore(max_concurrency or max(1, len(samples)))
        return list(await asyncio.gather(*(one(k, s, gate) for k, s in enumerate(samples))))

    try:
        return asyncio.run(main())
    finally:
        episodes.close()


class ToolEnv:
    """The built-in tools on the environment interface (see the module docstring).

    tools: {name: Tool} (`tiller.rollout.tools`); reward_fn(sample, final_text) -> float scores the episode when
    the model answers without a tool call (0 when None); chat_template_kwargs: extra template variables of the tool
    messages (give the run's data.apply_chat_template_kwargs)."""

    def __init__(self, tools: dict, tokenizer, reward_fn: Callable[[dict, str], float] | None = None,
                 max_tool_response_chars: int = 1024, chat_template_kwargs: dict | None = None):
        self.tools, self.reward_fn = dict(tools), reward_fn
        self.encoder = ToolResponseEncoder(tokenizer, chat_template_kwargs)
        self.max_chars = max_tool_response_chars
        self.sample: dict = {}

    def reset(self, sample: dict) -> None:
        self.sample = sample
        return None

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        calls = parse_tool_calls(action)
        if not calls:
            reward = float(self.reward_fn(self.sample, action)) if self.reward_fn else 0.0
            return "", reward, True, {}
        results = execute_tool_calls(calls, self.tools, self.max_chars,
                                     tools_kwargs=tools_kwargs_of(self.sample.get("extra_info")))
        # the text between the assistant turn's end and the next assistant turn (eos first: the action's ids
        # were decoded without special tokens, so the turn's eos, if sampled, is already in the context); the
        # step's reward: its calls' tool rewards (function tools' `(response, reward)`; 0.0 for the others)
        return (self.encoder.text([r.text for r in results]), sum(r.reward for r in results), False,
                {"tool_calls": len(calls)})
