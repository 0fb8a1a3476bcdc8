"""OpenRLHF's reward interfaces: its remote reward request / reply and its batched `reward_func` files.

Remote (OpenRLHF's `--remote_rm_url http://...`, its `openrlhf.cli.serve_rm` at `/get_reward`):

    request:  {"query": [prompt + response text, ...], "prompts": [prompt text, ...], "labels": [label, ...]}
    reply:    {"rewards": [float, ...], "scores": [float, ...], "extra_logs": {name: [float, ...] | float}}

`scores` (what OpenRLHF's dynamic filtering reads) fall back to `rewards`; a reply may also be a bare list of
rewards (older servers). A `.py` file (`--remote_rm_url reward_func.py`) defines
`reward_func(queries, prompts, labels, **kwargs)` returning that same dict, or a tensor / list of rewards.

Here: `openrlhf_request(requests)` builds the request, `parse_reply(body, n, where)` turns a reply into a
`ScoreBatch` (scores = rewards; extras["acc"] = scores, so `algorithm.filter_groups.metric=acc` filters on what
OpenRLHF filters on; per-sample `extra_logs` become extras, scalars become `reward/<name>` metrics; a log that is
neither, e.g. a string, is skipped with one warning per name), and
`OpenRLHFRewardManager` (reward_model.reward_manager=openrlhf) calls a `reward_func` file in process, with
DAPO overlong shaping when configured (OpenRLHF applies its overlong penalty to any reward).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from tiller.errors import UserError
from tiller.rewards.managers import ScoreBatch, call_or_error, check_timeout, overlong_penalty
from tiller.rewards.types import RewardRequest

log = logging.getLogger(__name__)
_WARNED: set[tuple[str, str]] = set()  # (where, log name) already warned about: one warning each per process


def _label(value: Any) -> Any:
    if value is None:
        return ""
    return value.tolist() if hasattr(value, "tolist") else value


def openrlhf_request(requests: list[RewardRequest]) -> dict[str, list]:
    """OpenRLHF's request body: queries are prompt + response text; labels the ground truths ("" when none)."""
    return {"query": [r.prompt + r.response for r in requests], "prompts": [r.prompt for r in requests],
            "labels": [_label(r.ground_truth) for r in requests]}


def _numbers(value: Any, n: int, what: str, where: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor from a reward_func
        value = value.detach().float().cpu().numpy()
    try:
        out = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise UserError(f"{where}: {what} must be numbers, got {str(value)[:200]}") from None
    if out.shape[0] != n:
        raise UserError(f"{where}: {what} has {out.shape[0]} values for {n} samples")
    return out


def parse_reply(body: Any, n: int, where: str) -> ScoreBatch:
    """A `ScoreBatch` from OpenRLHF's reply (a dict with rewards / scores / extra_logs, or a list of rewards).
    Non-finite rewards score 0 and count in reward/num_errors."""
    if isinstance(body, dict):
        if "rewards" not in body and "scores" not in body:
            raise UserError(f"{where}: the reply has neither 'rewards' nor 'scores': {str(body)[:200]}")
        rewards = _numbers(body["rewards"] if "rewards" in body else body["scores"], n, "rewards", where)
        scores = _numbers(body["scores"], n, "scores", where) if "scores" in body else rewards.copy()
        logs = body.get("extra_logs") or {}
        if not isinstance(logs, dict):
            raise UserError(f"{where}: extra_logs must be an object, got {type(logs).__name__}")
    else:
        rewards = _numbers(body, n, "rewards", where)
        scores, logs = rewards.copy(), {}
    bad = ~np.isfinite(rewards)
    rewards[bad] = 0.0
    scores[~np.isfinite(scores)] = 0.0
    extras = {"acc": scores.astype(np.float32)}
    metrics = {"reward/num_errors": float(bad.sum())}
    for key, value in logs.items():
        arr = _log_numbers(value)
        if arr is not None and arr.shape[0] == n:
            extras[str(key)] = arr.astype(np.float32)
        elif arr is not None and arr.shape[0] == 1 and math.isfinite(float(arr[0])):
            metrics[f"reward/{key}"] = float(arr[0])
        elif (where, str(key)) not in _WARNED:
            _WARNED.add((where, str(key)))
            shape = "not numbers" if arr is None else f"{arr.shape[0]} values for {n} samples"
            log.warning(f"{where}: extra_logs[{str(key)!r}] is {shape} ({str(value)[:80]}): not logged (said once)")
    return ScoreBatch(scores=rewards.astype(np.float32), extras=extras, metrics=metrics)


def _log_numbers(value: Any) -> np.ndarray | None:
    """One extra_logs entry as a flat float array, or None when it is not numbers (strings, None, objects)."""
    if hasattr(value, "detach"):
        value = value.detach().float().cpu().numpy()
    try:
        arr = np.asarray(value)
        return arr.astype(np.float64).reshape(-1) if arr.dtype.kind in "biuf" else None
    except (TypeError, ValueError):  # ragged lists
        return None


class OpenRLHFRewardManager:
    """`reward_func(queries, prompts, labels, **reward_kwargs)` from a file, one call per batch bounded by
    `timeout` seconds (a call that fails or overruns scores the batch 0, counted), plus DAPO overlong shaping."""

    def __init__(self, fn, reward_kwargs: dict | None = None, *, timeout: float = 30.0, name: str = "reward_func",
                 max_response_length: int = 0, buffer_len: int | None = None, penalty_factor: float = 1.0):
        check_timeout(timeout)
        self.fn, self.name = fn, name
        self.reward_kwargs = dict(reward_kwargs or {})
        self.timeout = timeout
        self.max_response_length, self.buffer_len, self.penalty_factor = max_response_length, buffer_len, penalty_factor
        if buffer_len is not None:
            overlong_penalty(np.zeros(1), max_response_length, buffer_len, penalty_factor)  # validate now

    def score(self, requests: list[RewardRequest]) -> ScoreBatch:
        body = openrlhf_request(requests)
        value, status = call_or_error(self.fn, body["query"], body["prompts"], body["labels"], timeout=self.timeout,
                                       **self.reward_kwargs)
        n = len(requests)
        if status != "ok":
            counts = {"reward/num_errors": float(n * (status == "error")),
                      "reward/num_timeouts": float(n * (status == "timeout"))}
            batch = ScoreBatch(np.zeros(n, dtype=np.float32), {}, counts)
        else:
            batch = parse_reply(value, n, f"custom_reward_function {self.name}")
        if self.buffer_len is not None:
            lengths = np.array([r.response_length for r in requests])
            penalty = overlong_penalty(lengths, self.max_response_length, self.buffer_len, self.penalty_factor)
            batch.scores = batch.scores + penalty
            batch.extras["overlong_reward"] = penalty
        return batch
