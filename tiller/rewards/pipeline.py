"""`build_reward_manager(cfg)`: the reward step of the RL driver, configured from `RLConfig`.

    base scores  = remote server   (reward_model.remote_url set)
                 | reward model    (reward_model.enable with model.path)
                 | rule / custom fn through reward_model.reward_manager (naive | batch | parallel | prime | dapo)
                   (code data sources on a SandboxFusion server when reward.sandbox_fusion.url is set)
    + DAPO overlong shaping        (reward_model.overlong_buffer.enable; reward_manager=dapo)
    -> DARLING diversity fusion    (reward_model.diversity.enable)

As in verl, a reward model or remote server replaces the rule-based score (it does not add to it).
The result is a `RewardResult`: final scores [B], per-sample extras, batch metrics.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from typing import Any, Callable

import numpy as np

from tiller.config.schema import REWARD_MANAGERS
from tiller.errors import ConfigError
from tiller.rewards import sandbox_fusion
from tiller.rewards._procpool import resolve_ref
from tiller.rewards.diversity import DiversityShaper
from tiller.rewards.managers import (
    BatchRewardManager,
    DapoRewardManager,
    NaiveRewardManager,
    ParallelRewardManager,
    ScoreBatch,
    load_function_ref,
)
from tiller.rewards.registry import default_compute_score
from tiller.models.loading import load_tokenizer
from tiller.rewards.openrlhf_api import OpenRLHFRewardManager
from tiller.rewards.remote import RemoteRewardClient
from tiller.rewards.reward_model import RewardModelScorer
from tiller.rewards.types import RewardRequest, RewardResult
from tiller.rewards.verl_manager import bound_compute_score, build_verl_manager, reward_manager_spec


class RewardPipeline:
    """Callable `list[RewardRequest] -> RewardResult`: a base scorer, then optional diversity fusion."""

    def __init__(self, base: Any, diversity: Any | None = None, clip_range: tuple[float, float] | None = None):
        self.base = base
        self.diversity = diversity
        self.clip_range = clip_range

    def __call__(self, requests: list[RewardRequest]) -> RewardResult:
        if not requests:
            return RewardResult(scores=np.zeros(0, dtype=np.float32), extras={}, metrics={"reward/num_errors": 0.0})
        batch: ScoreBatch = self.base.score(requests)
        scores = np.asarray(batch.scores, dtype=np.float32)
        if self.clip_range is not None:  # OpenRLHF's --reward_clip_range, before any shaping
            scores = np.clip(scores, self.clip_range[0], self.clip_range[1])
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


MANAGER_KWARGS = ("overlong_buffer_cfg", "max_resp_len")  # what reward_model.reward_kwargs may hold (dapo)


def overlong_buffer(cfg: Any) -> tuple[dict | None, str]:
    """DAPO's overlong shaping settings {enable, len, penalty_factor, log} and where they were set.

    verl has put them in three places over time: `reward_model.overlong_buffer` (the DAPO recipe),
    `custom_reward_function.overlong_buffer` (the recipe's first version) and
    `reward_model.reward_kwargs.overlong_buffer_cfg` (verl's reward-manager kwargs). The enabled one wins;
    two enabled with different settings is an error. (None, "") when none is enabled.
    """
    found = []
    for where, ob in (("reward_model.overlong_buffer", cfg.reward_model.overlong_buffer),
                      ("custom_reward_function.overlong_buffer", cfg.custom_reward_function.overlong_buffer)):
        if ob.enable:
            found.append((where, {"enable": True, "len": ob.len, "penalty_factor": ob.penalty_factor, "log": ob.log}))
    kw = dict(cfg.reward_model.reward_kwargs.get("overlong_buffer_cfg") or {})
    if kw.get("enable"):
        unknown = set(kw) - {"enable", "len", "penalty_factor", "log"}
        if unknown:
            raise ConfigError(f"reward_model.reward_kwargs.overlong_buffer_cfg: unknown keys {sorted(unknown)}; "
                              "valid: enable, len, penalty_factor, log")
        found.append(("reward_model.reward_kwargs.overlong_buffer_cfg",
                      {"enable": True, "len": int(kw.get("len", 0)),
                       "penalty_factor": float(kw.get("penalty_factor", 1.0)), "log": bool(kw.get("log", False))}))
    if len({str(sorted(v.items())) for _, v in found}) > 1:
        raise ConfigError(f"DAPO overlong shaping is enabled in {' and '.join(w for w, _ in found)} with different "
                          "settings: keep one")
    return (found[0][1], found[0][0]) if found else (None, "")


PRIME_TIMEOUT_S = 300.0
"""verl's PrimeRewardManager bounds each sample's scoring by 300 s (a constant there, not reward_model.timeout)."""


def _verl_manager(cfg: Any, tokenizer: Any) -> Any:
    """A custom verl reward manager (`tiller.rewards.verl_manager`) with verl's compute_score: the custom reward
    function (its reward_kwargs bound) or the default scorer (with SandboxFusion's keywords when configured)."""
    custom = cfg.custom_reward_function
    if custom.path:
        compute_score = bound_compute_score(resolve_ref(load_function_ref(custom.path, custom.name)),
                                            dict(custom.reward_kwargs or {}))
    else:
        sandbox = _sandbox_fusion_kwargs(cfg)
        compute_score = functools.partial(default_compute_score, **sandbox) if sandbox else None
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.actor_rollout_ref.model.tokenizer_path or cfg.actor_rollout_ref.model.path)
    return build_verl_manager(cfg, reward_manager_spec(cfg), tokenizer, compute_score)


def _rule_manager(cfg: Any) -> Any:
    rm, custom = cfg.reward_model, cfg.custom_reward_function
    name = rm.reward_manager
    if name not in REWARD_MANAGERS:
        raise ConfigError(f"reward_model.reward_manager: unknown {name!r}; valid: {', '.join(REWARD_MANAGERS)}")
    ref = load_function_ref(custom.path, custom.name)
    kwargs = dict(custom.reward_kwargs or {})
    manager_kwargs = dict(rm.reward_kwargs or {})
    unknown = set(manager_kwargs) - set(MANAGER_KWARGS)
    if unknown:
        raise ConfigError(f"reward_model.reward_kwargs: unknown keys {sorted(unknown)}; the reward managers take "
                          f"{', '.join(MANAGER_KWARGS)} (dapo); a scoring function's keyword arguments go in "
                          "custom_reward_function.reward_kwargs")
    ob, where = overlong_buffer(cfg)
    kwargs.update(_sandbox_fusion_kwargs(cfg))
    if name == "openrlhf":
        return _openrlhf_manager(cfg, ref, kwargs, ob)
    if ob is not None and name != "dapo":
        raise ConfigError(f"{where}.enable needs reward_model.reward_manager=dapo (or openrlhf)")
    if name in ("naive", "gdpo"):
        return NaiveRewardManager(ref, kwargs, timeout=rm.timeout)
    if name == "batch":
        return BatchRewardManager(ref if custom.path else None, kwargs, timeout=rm.timeout)
    if name == "parallel":
        return ParallelRewardManager(ref, kwargs, num_workers=rm.num_workers, timeout=rm.timeout)
    if name == "prime":  # verl's PrimeRewardManager: per-sample calls in processes, 300 s each, 0 on error / timeout
        return ParallelRewardManager(ref, kwargs, num_workers=rm.num_workers, timeout=PRIME_TIMEOUT_S)
    # verl's dapo manager takes the length limit as max_resp_len; data.max_response_length by default
    max_len = int(manager_kwargs.get("max_resp_len") or cfg.data.max_response_length)
    return DapoRewardManager(ref, kwargs, max_response_length=max_len,
                             buffer_len=ob["len"] if ob else None, penalty_factor=ob["penalty_factor"] if ob else 1.0,
                             log_penalty=bool(ob and ob["log"]), timeout=rm.timeout)


def _sandbox_fusion_kwargs(cfg: Any) -> dict:
    """verl's SandboxFusion keywords of default_compute_score (url, a semaphore of max_concurrent slots shared by the
    reward workers, memory_limit_mb) when reward.sandbox_fusion.url is set, after one test program ran there."""
    section = cfg.reward_model.sandbox_fusion
    url = section.get("url")
    if not url:
        return {}
    sandbox_fusion.check_server(url, section["memory_limit_mb"])
    slots = tempfile.mkdtemp(prefix="tiller-sandbox-fusion-")
    atexit.register(shutil.rmtree, slots, True)
    return {"sandbox_fusion_url": url, "memory_limit_mb": section["memory_limit_mb"],
            "concurrent_semaphore": sandbox_fusion.SlotSemaphore(slots, section["max_concurrent"])}


def _openrlhf_manager(cfg: Any, ref: Any, kwargs: dict, ob: dict | None) -> Any:
    """OpenRLHF's batched reward_func(queries, prompts, labels, **kw) from custom_reward_function.path."""
    custom = cfg.custom_reward_function
    if not custom.path:
        raise ConfigError("reward_model.reward_manager=openrlhf needs custom_reward_function.path: a .py file "
                          "defining reward_func(queries, prompts, labels, **kwargs)")
    return OpenRLHFRewardManager(resolve_ref(ref), kwargs, timeout=cfg.reward_model.timeout, name=custom.name,
                                 max_response_length=cfg.data.max_response_length,
                                 buffer_len=ob["len"] if ob else None,
                                 penalty_factor=ob["penalty_factor"] if ob else 1.0)


def _clip_range(rm: Any) -> tuple[float, float] | None:
    if rm.clip_range is None:
        return None
    if len(rm.clip_range) != 2 or not rm.clip_range[0] < rm.clip_range[1]:
        raise ConfigError(f"reward_model.clip_range must be [low, high] with low < high, got {list(rm.clip_range)}")
    return float(rm.clip_range[0]), float(rm.clip_range[1])


def build_reward_manager(cfg: Any, tokenizer: Any = None,
                         base: Any = None) -> Callable[[list[RewardRequest]], RewardResult]:
    """The reward callable for an `RLConfig` (reads `reward_model.*`, `custom_reward_function.*`,
    `data.max_response_length`). `tokenizer` is the policy's (used by the diversity partitioner
    to count answer tokens; optional). `base`: an in-process scorer (`score(requests) -> ScoreBatch`, e.g. the TRL
    front end's reward functions) in place of the one the config names; a config that names another one too is
    an error."""
    rm = cfg.reward_model
    if base is not None:
        named = [key for key, on in (("reward_model.remote_url", rm.remote_url), ("reward_model.enable", rm.enable),
                                     ("custom_reward_function.path", cfg.custom_reward_function.path)) if on]
        if named:
            raise ConfigError(f"{named[0]} is set, and the run was given an in-process reward function: keep one")
    elif rm.remote_url:
        base: Any = RemoteRewardClient(rm.remote_url, timeout=rm.timeout, wire_format=rm.remote_format)
    elif rm.enable:
        if not rm.model.path:
            raise ConfigError("reward_model.enable=true needs reward_model.model.path (or reward_model.remote_url)")
        base = RewardModelScorer(rm.model.path, micro_batch_size=rm.micro_batch_size_per_gpu,
                                 max_length=rm.max_length, trust_remote_code=rm.model.trust_remote_code,
                                 max_tokens=rm.forward_max_token_len_per_gpu if rm.use_dynamic_bsz else None,
                                 normalize=rm.normalize)
    elif reward_manager_spec(cfg) is not None:  # a verl reward-manager class of the user's
        base = _verl_manager(cfg, tokenizer)
    else:
        base = _rule_manager(cfg)
    diversity = None
    if rm.diversity.enable:
        diversity = DiversityShaper.from_config(rm.diversity, tokenizer=tokenizer)
    if rm.normalize and not (rm.enable and not rm.remote_url):
        raise ConfigError("reward_model.normalize=true applies to a reward model (reward_model.enable with "
                          "model.path): its config.json holds the mean / std")
    return RewardPipeline(base, diversity, _clip_range(rm))
