"""`build_reward_manager(cfg)`: the reward step of the RL driver, configured from `RLConfig`.

    base scores  = remote server   (reward_model.remote_url set)
                 | reward model    (reward_model.enable with model.path)
                 | rule / custom fn through reward_model.reward_manager (naive | batch | parallel | dapo)
    + DAPO overlong shaping        (reward_model.overlong_buffer.enable; reward_manager=dapo)
    -> DARLING diversity fusion    (reward_model.diversity.enable)

As in verl, a reward model or remote server replaces the rule-based score (it does not add to it).
The result is a `RewardResult`: final scores [B], per-sample extras, batch metrics.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from tiller.errors import ConfigError
from tiller.rewards.managers import (
    REWARD_MANAGERS,
    BatchRewardManager,
    DapoRewardManager,
    NaiveRewardManager,
    ParallelRewardManager,
    ScoreBatch,
    load_function_ref,
)
from tiller.rewards.types import RewardRequest, RewardResult


class RewardPipeline:
    """Callable `list[RewardRequest] -> RewardResult`: a base scorer, then optional diversity fusion."""

    def __init__(self, base: Any, diversity: Any | None = None):
        self.base = base
        self.diversity = diversity

    def __call__(self, requests: list[RewardRequest]) -> RewardResult:
        if not requests:
            return RewardResult(scores=np.zeros(0, dtype=np.float32), extras={}, metrics={"reward/num_errors": 0.0})
        batch: ScoreBatch = self.base.score(requests)
        scores = np.asarray(batch.scores, dtype=np.float32)
        extras, metrics = dict(batch.extras), dict(batch.metrics)
        metrics.setdefault("reward/num_errors", 0.0)
        if self.diversity is not None:
            extras["quality"] = scores.copy()
            scores, div, div_metrics = self.diversity(requests, scores)
            extras["diversity"] = div
            metrics.update(div_metrics)
        return RewardResult(scores=scores.astype(np.float32), extras=extras, metrics=metrics)

    def close(self) -> None:
        for part in (self.base, self.diversity):
            if hasattr(part, "close"):
                part.close()


def _rule_manager(cfg: Any) -> Any:
    rm, custom = cfg.reward_model, cfg.custom_reward_function
    name = rm.reward_manager
    if name not in REWARD_MANAGERS:
        raise ConfigError(f"reward_model.reward_manager: unknown {name!r}; valid: {', '.join(REWARD_MANAGERS)}")
    ref = load_function_ref(custom.path, custom.name)
    kwargs = dict(custom.reward_kwargs or {})
    if rm.overlong_buffer.enable and name != "dapo":
        raise ConfigError("reward_model.overlong_buffer.enable needs reward_model.reward_manager=dapo")
    if name == "naive":
        return NaiveRewardManager(ref, kwargs)
    if name == "batch":
        return BatchRewardManager(ref if custom.path else None, kwargs)
    if name == "parallel":
        return ParallelRewardManager(ref, kwargs, num_workers=rm.num_workers, timeout=rm.timeout)
    ob = rm.overlong_buffer
    return DapoRewardManager(ref, kwargs, max_response_length=cfg.data.max_response_length,
                             buffer_len=ob.len if ob.enable else None, penalty_factor=ob.penalty_factor,
                             log_penalty=True)


def build_reward_manager(cfg: Any, tokenizer: Any = None) -> Callable[[list[RewardRequest]], RewardResult]:
    """The reward callable for an `RLConfig` (reads `reward_model.*`, `custom_reward_function.*`,
    `data.max_response_length`). `tokenizer` is the policy's (used by the diversity partitioner
    to count answer tokens; optional)."""
    rm = cfg.reward_model
    if rm.remote_url:
        from tiller.rewards.remote import RemoteRewardClient

        base: Any = RemoteRewardClient(rm.remote_url, timeout=rm.timeout)
    elif rm.enable:
        if not rm.model.path:
            raise ConfigError("reward_model.enable=true needs reward_model.model.path (or reward_model.remote_url)")
        from tiller.rewards.reward_model import RewardModelScorer

        base = RewardModelScorer(rm.model.path, micro_batch_size=rm.micro_batch_size_per_gpu,
                                 max_length=rm.max_length, trust_remote_code=rm.model.trust_remote_code)
    else:
        base = _rule_manager(cfg)
    diversity = None
    if rm.diversity.enable:
        from tiller.rewards.diversity import DiversityShaper

        diversity = DiversityShaper.from_config(rm.diversity, tokenizer=tokenizer)
    return RewardPipeline(base, diversity)
