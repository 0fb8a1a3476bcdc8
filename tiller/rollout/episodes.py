"""Agent episodes as trainable segments: what an agent rollout hands the trainer.

An episode is one run of an agent (the user's `async def run(base_url, sample) -> reward` through the
OpenAI-compatible endpoint, or the built-in loop driving an environment) on one sample. Every completion
the policy produced during it is a `Segment`: the exact context ids it was sampled from, the sampled ids,
their sampling logprobs and the policy version that sampled them. The trainer trains each segment's
sampled ids with the episode's advantage; the context is never trained and nothing is re-tokenized
(verl #3070 / #6719: re-tokenizing a multi-turn transcript does not give back the sampled ids).

`rows_from_episodes` lays episodes out as batch rows (one per segment; an episode without a segment gets
one empty row so its reward still counts in its group's baseline).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tiller.errors import ConfigError


@dataclass
class Segment:
    """One completion of the policy: context ids -> sampled ids (+ their sampling logprobs)."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"
    policy_version: int = 0  # the version that sampled it (partial rollouts: its first token's, the oldest)
    token_versions: list[int] = field(default_factory=list)  # partial rollouts: each sampled id's version


@dataclass
class Episode:
    """The segments of one agent run on one sample, and its reward."""

    segments: list[Segment] = field(default_factory=list)
    reward: float = 0.0
    info: dict = field(default_factory=dict)


def load_callable(path: str, name: str, what: str) -> Callable:
    """`name` from a module path (`pkg.mod`) or a `.py` file; ConfigError naming `what` when absent."""
    if not path:
        raise ConfigError(f"{what}.path is empty: give a module (pkg.mod) or a .py file")
    try:
        if path.endswith(".py"):
            file = Path(path).expanduser()
            if not file.is_file():
                raise ConfigError(f"{what}.path: no such file {path}")
            mod_name = f"tiller_user_{abs(hash(str(file.resolve())))}"
            module = sys.modules.get(mod_name)
            if module is None:
                spec = importlib.util.spec_from_file_location(mod_name, file)
                module = importlib.util.module_from_spec(spec)
                sys.modules[mod_name] = module
                spec.loader.exec_module(module)
        else:
            module = importlib.import_module(path)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's module failed to import
        raise ConfigError(f"{what}.path: cannot import {path}: {type(err).__name__}: {err}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"{what}.name: {path} has no {name!r}")
    return fn


def load_agent_function(path: str, name: str = "run") -> Callable:
    """The user's agent: `async def run(base_url_or_client, sample) -> float` (a plain function is accepted
    and run in a thread)."""
    fn = load_callable(path, name, "actor_rollout_ref.rollout.agent")
    if not callable(fn) or len(inspect.signature(fn).parameters) < 2:
        raise ConfigError(f"actor_rollout_ref.rollout.agent: {path}:{name} must take (base_url_or_client, sample)")
    return fn


def finite_reward(value: Any, where: str) -> float:
    """A reward as a finite float (numbers, 0-d / 1-element tensors and arrays); TypeError / ValueError naming
    `where` otherwise: a NaN or inf reward would reach the update as NaN advantages."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: a reward must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{where}: the reward is {value}, not a finite number")
    return float(value)


def episode_reward(value: Any, where: str) -> tuple[float, dict]:
    """An agent's return value -> (reward, info): a finite number, or a dict with `reward` (or `score`) and
    extras."""
    info: dict = {}
    if isinstance(value, dict):
        info = {k: v for k, v in value.items() if k not in ("reward", "score")}
        value = value.get("reward", value.get("score"))
    try:
        return finite_reward(value, where), info
    except TypeError:
        raise TypeError(f"{where}: the agent must return a number (or a dict with 'reward'), got {value!r}") from None


def describe(fn: Callable) -> str:
    """`name (file:line)` of a user's function or class, for error messages."""
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__init__", None), "__code__", None)
    name = getattr(fn, "__qualname__", repr(fn))
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


class UserExit(RuntimeError):
    """The user's code called `sys.exit()` inside an agent or environment."""


def failure(err: BaseException) -> str:
    """What went wrong in the user's code, for one error line."""
    if isinstance(err, SystemExit):
        return f"called sys.exit({err.code!r})"
    return str(err) if isinstance(err, UserExit) else f"{type(err).__name__}: {err}"


USER_CALL_POLL_S = 0.2


async def call_user(fn: Callable, *args) -> Any:
    """Await `fn(*args)`: a coroutine function in the event loop, a plain function in a daemon thread of its own
    (the loop stays free for other episodes; a call that never returns does not hold up Ctrl-C or the process's
    exit, as `asyncio.to_thread`'s executor would, which the interpreter joins). A plain function's awaitable
    result is awaited; `sys.exit()` inside it is a `UserExit`."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def run() -> None:
        try:
            ok, value = True, fn(*args)
        except SystemExit as err:
            ok, value = False, UserExit(f"called sys.exit({err.code!r})")
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting task
            ok, value = False, err
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop has closed (interrupted, or another episode failed): nobody waits
            pass

    threading.Thread(target=run, daemon=True, name="tiller-user-call").start()
    # Wake the loop a few times a second while the call runs: the kernel may hand Ctrl-C's SIGINT to any thread of
    # the process (seen with Ray's threads around), and Python runs the handler only when the main thread next runs
    # bytecode; a loop idle on this future alone would sleep until the call returned.
    while not future.done():
        await asyncio.wait([future], timeout=USER_CALL_POLL_S)
    value = future.result()
    return await value if inspect.isawaitable(value) else value


def rows_from_episodes(episodes: list[Episode], first_prompts: list[list[int]]) -> list[dict]:
    """One dict per batch row: prompt_ids, response_ids, logprobs, finish_reason, episode (index into
    `episodes`), segment, policy_version, token_versions (empty unless recorded). `first_prompts[e]` fills the
    empty row of an episode with no segment."""
    rows = []
    for e, ep in enumerate(episodes):
        if not ep.segments:
            rows.append(dict(prompt_ids=list(first_prompts[e]), response_ids=[], logprobs=[], finish_reason="stop",
                             episode=e, segment=0, policy_version=-1, token_versions=[]))
            continue
        for s, seg in enumerate(ep.segments):
            rows.append(dict(prompt_ids=list(seg.prompt_ids), response_ids=list(seg.response_ids),
                             logprobs=list(seg.logprobs), finish_reason=seg.finish_reason, episode=e, segment=s,
                             policy_version=seg.policy_version, token_versions=list(seg.token_versions)))
    return rows


def segment_of(context: list[int], out, row: int, version: int) -> Segment:
    """Row `row` of a rollout output (`tiller.rollout.base.RolloutOutput`) sampled from `context` as a segment:
    with per-token versions (partial rollouts) its version is its first token's, else `version`."""
    recorded = getattr(out, "token_versions", None)  # (an engine that records none may leave the field out)
    versions = list(recorded[row]) if recorded else []
    return Segment(list(context), list(out.response_ids[row]), [float(x) for x in out.logprobs[row]],
                   out.finish_reason[row], versions[0] if versions else int(version), versions)


def renumber_episodes(episode):
    """Episode ids [B] (a row's episode; rows that dropped episodes left gaps) -> 0..k-1 in the same order."""
    import torch

    return torch.unique(episode, return_inverse=True)[1]
