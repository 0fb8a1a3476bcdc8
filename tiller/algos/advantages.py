"""Advantage estimators: token rewards in, per-token advantages and returns out.

Every estimator has one signature (registry `ADV_ESTIMATORS`, verl's names):

    fn(token_rewards[B, T], response_mask[B, T], group_index[B], values[B, T] | None, **hyper)
        -> (advantages[B, T], returns[B, T])

`B` = samples (prompts x n), `T` = padded response length. `group_index` labels the prompt each
sample came from (ints or strings; list, numpy array or tensor). Outcome rewards sit on the last
response token; the outcome estimators use the per-sample score s_i = sum_t r_it m_it and broadcast
their advantage over the response tokens (0 elsewhere). Hyper-parameters are keywords with verl's
names; each estimator ignores the ones it does not use (so a trainer may pass the same set to all)
and rejects names no estimator knows.

Estimators (paper, and verl `verl/trainer/ppo/core_algos.py`):
- gae: Generalized Advantage Estimation (Schulman et al. 2015, arXiv 1506.02438). delta_t = r_t +
  gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, skipping masked steps; returns = A + V;
  A is then whitened over the batch.
- grpo: group z-score (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300):
  A_i = (s_i - mean_g) / (std_g + epsilon) with the unbiased std; `norm_adv_by_std_in_grpo=False`
  gives Dr.GRPO's s_i - mean_g (Liu et al. 2025, arXiv 2503.20783). A singleton group uses
  mean 0 and std 1, as verl: A = s / (1 + epsilon) (or s for Dr.GRPO).
- grpo_passk: pass@k (Chen et al. 2025, arXiv 2503.19595): only the best response of a group gets
  r_max - r_second (divided by the group std + epsilon when normalising). The first best wins ties.
- rloo: leave-one-out (Ahmadian et al. 2024, arXiv 2402.14740): A_i = n/(n-1) (s_i - mean_g)
  = s_i - mean of the others; a singleton keeps A = s.
- remax: ReMax (Li et al. 2023, arXiv 2310.10505): returns = reward-to-go, A = returns - b with
  b = `baseline_rewards[B]`, the greedy rollout's score.
- reinforce_plus_plus: REINFORCE++ (Hu 2025, arXiv 2501.03262): discounted reward-to-go G_t =
  r_t + gamma G_{t'} over the response tokens, t' the next response token (masked tokens inside a
  multi-turn response are skipped: the return carries across them undiscounted, as verl after #7278),
  whitened over the batch.
- reinforce_plus_plus_baseline: s_i - mean_g (singleton mean 0) broadcast, then whitened over the batch.
- opo: on-policy RL with optimal baseline (Hao et al. 2025, arXiv 2505.23585): baseline
  b_g = sum_i |y_i| s_i / sum_i |y_i| (length-weighted); singleton b = 0.
- gpg: Group Policy Gradient (Chu et al. 2025, arXiv 2504.02546): A_i = alpha (s_i - mean_g) / f_norm
  with alpha = B / #(s_i != 0) (verl computes alpha this way and ignores an `alpha` argument).
- grpo_vectorized: verl's vectorised GRPO: as grpo, but the group std is sqrt(max(var_g, epsilon)) (a
  variance floor; groups whose variance is below epsilon differ from grpo).
- rloo_vectorized: verl's vectorised RLOO: (n s_i - sum_g s) / (n - 1) for groups of n > 1, and 0 (not s_i,
  as rloo) for a group of one sample.
- gdpo: Group reward-Decoupled normalisation Policy Optimisation (NVIDIA 2026, verl `compute_gdpo_outcome_
  advantage`): a reward function returns several named scores; each listed channel k is z-scored in its
  group separately (GRPO, singleton mean 0 / std 1), the results are summed with weights w_k, and the sum
  is whitened over the batch's valid tokens:
      A_i = whiten( sum_k w_k (c_ik - mean_g c_k) / (std_g c_k + epsilon) )
  `reward_components` maps each name of `gdpo_reward_keys` to its scores [B]; `gdpo_reward_weights`
  defaults to all 1. Without components (a direct call) the single channel is the summed token reward.
  `gdpo_normalization="sequence"` is TRL's `multi_objective_aggregation="normalize_then_sum"` instead: the sum is
  normalised over the batch's samples, (S_i - mean S) / (std S + epsilon) (Bessel std), and a NaN score (TRL's
  None: the function does not apply to that sample) contributes 0, its group's statistics taken over the
  group's other scores (nanmean / nanstd; a group with one scored member contributes 0 there, as does a group of
  one sample, where TRL's std is 0). With "token" a NaN score makes NaN advantages (the trainer refuses a sample
  missing a named score before).
- optimal_token_baseline / tir_optimal_token_baseline: see `tiller.algos.token_baseline`.

Deviations from verl: outputs are exactly 0 outside `response_mask` (verl leaves values there for
gae / remax); scores are summed under the mask; opo's baseline is 0 for a group whose responses
are all empty (verl divides 0 by 0); all group statistics are vectorised (no Python loop over B).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from tiller.algos.utils import (
    Registry,
    group_counts,
    group_ids,
    group_mean,
    group_std,
    masked_sum,
    masked_whiten,
    reject_unknown,
)
from tiller.errors import ConfigError, DataError

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator", "algorithm.adv_estimator")
register_advantage_estimator = ADV_ESTIMATORS.register

#: keyword names any estimator accepts (each uses its own subset).
ADV_HYPER = (
    "gamma", "lam", "epsilon", "norm_adv_by_std_in_grpo", "std_scope", "baseline_rewards", "f_norm",
    "reward_components", "gdpo_reward_keys", "gdpo_reward_weights", "gdpo_normalization",  # gdpo
    "old_logp", "sum_pi_squared", "rollout_is_weights", "handle_zero_tail",  # optimal token baseline
)


def get_advantage_estimator(name: str) -> AdvantageFn:
    """The estimator registered as `name`; ConfigError listing the valid names otherwise."""
    return ADV_ESTIMATORS.get(name)


def _scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return masked_sum(token_rewards, response_mask, dim=-1)


def _broadcast(per_sample: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return per_sample.unsqueeze(-1) * response_mask.to(per_sample.dtype)


def check_shapes(token_rewards: torch.Tensor, response_mask: torch.Tensor, group_index: Any) -> None:
    if token_rewards.shape != response_mask.shape or token_rewards.dim() != 2:
        raise DataError(
            f"token_rewards {tuple(token_rewards.shape)} and response_mask {tuple(response_mask.shape)} must be equal [B, T]"
        )
    if group_index is not None and len(group_index) != token_rewards.shape[0]:
        raise DataError(f"group_index has {len(group_index)} labels for {token_rewards.shape[0]} samples")


def _group_baseline_stats(scores: torch.Tensor, group_index: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: (group mean with singleton -> 0, group std with singleton -> 1, group size)."""
    ids, g = group_ids(group_index, device=scores.device)
    n = group_counts(ids, g, scores.dtype)[ids]
    single = n <= 1
    mean = torch.where(single, torch.zeros_like(scores), group_mean(scores, ids, g)[ids])
    std = torch.where(single, torch.ones_like(scores), group_std(scores, ids, g)[ids])
    return mean, std, n


@register_advantage_estimator("gae")
def compute_gae(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Any,
    values: torch.Tensor | None,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over response tokens; `values[B, T]` from the critic are required.

    Masked steps are skipped: the recursion carries V_{t+1} and A_{t+1} across them unchanged
    (matters for multi-turn masks with holes). returns = A_raw + V; advantages = whiten(A_raw).
    """
    reject_unknown("gae", extra, ADV_HYPER)
    check_shapes(token_rewards, response_mask, None)
    if values is None:
        raise ConfigError("algorithm.adv_estimator=gae needs critic values (enable the critic)")
    with torch.no_grad():
        m = response_mask.to(token_rewards.dtype)
        next_value = torch.zeros_like(token_rewards[:, 0])
        last_gae = torch.zeros_like(token_rewards[:, 0])
        out = torch.zeros_like(token_rewards)
        for t in reversed(range(token_rewards.shape[1])):
            delta = token_rewards[:, t] + gamma * next_value - values[:, t]
            gae_t = delta + gamma * lam * last_gae
            next_value = m[:, t] * values[:, t] + (1 - m[:, t]) * next_value
            last_gae = m[:, t] * gae_t + (1 - m[:, t]) * last_gae
            out[:, t] = last_gae
        returns = (out + values) * m
        advantages = masked_whiten(out, response_mask)
    return advantages, returns


@register_advantage_estimator("grpo")
def compute_grpo(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Any,
    values: torch.Tensor | None = None,
    *,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    std_scope: str = "group",
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO group z-score (Dr.GRPO mean-centering with `norm_adv_by_std_in_grpo=False`).

    `std_scope="batch"`: (s - group mean) / (std of the whole batch + epsilon) (TRL's scale_rewards="batch", the
    "Lite PPO" of Liu et al. 2025, arXiv 2508.08221); the std is unbiased (n - 1) as the group's."""
    reject_unknown("grpo", extra, ADV_HYPER)
    check_shapes(token_rewards, response_mask, group_index)
    if std_scope not in ("group", "batch"):
        raise ConfigError(f"algorithm.norm_adv_std_scope: unknown {std_scope!r}; valid: group, batch")
    with torch.no_grad():
        scores = _scores(token_rewards, response_mask)
        mean, std, _ = _group_baseline_stats(scores, group_index)
        if std_scope == "batch":
            std = (scores.std() if scores.numel() > 1 else scores.new_zeros(())).expand_as(scores)
        adv = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
        adv = _broadcast(adv, response_mask)
    return adv, adv


@register_advantage_estimator("grpo_passk")
def compute_grpo_passk(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Any,
    values: torch.Tensor | None = None,
    *,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k: the best response of each group gets (r_max - r_second) [/ (std + eps)], the rest 0."""
    reject_unknown("grpo_passk", extra, ADV_HYPER)
    check_shapes(token_rewards, response_mask, group_index)
    ids, g = group_ids(group_index)
    sizes = np.bincount(ids.numpy(), minlength=g)
    if (sizes < 2).any():
        raise DataError(f"grpo_passk needs at least 2 samples per group; smallest group has {sizes.min()}")
    ids = ids.to(token_rewards.device)
    with torch.no_grad():
        scores = _scores(token_rewards, response_mask)
        b = scores.shape[0]
        arange = torch.arange(b, device=scores.device)
        neg_inf = torch.full((g,), float("-inf"), dtype=scores.dtype, device=scores.device)
        r_max = neg_inf.clone().scatter_reduce_(0, ids, scores, reduce="amax")
        cand = torch.where(scores == r_max[ids], arange, torch.full_like(arange, b))
        i_max = torch.full((g,), b, dtype=torch.long, device=scores.device).scatter_reduce_(0, ids, cand, reduce="amin")
        is_best = arange == i_max[ids]
        others = torch.where(is_best, torch.full_like(scores, float("-inf")), scores)
        r_second = neg_inf.clone().scatter_reduce_(0, ids, others, reduce="amax")
        gap = r_max - r_second
        if norm_adv_by_std_in_grpo:
            gap = gap / (group_std(scores, ids, g) + epsilon)
        adv = torch.where(is_best, gap[ids], torch.zeros_like(scores))
        adv = _broadcast(adv, response_mask)
    return adv, adv


@register_advantage_estimator("rloo")
def compute_rloo(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Any,
    values: torch.Tensor | None = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: s_i minus the mean of the other n-1 samples of the group; a singleton keeps s_i."""
    reject_unknown("rloo", extra, ADV_HYPER)
    check_shapes(token_rewards, response_mask, group_index)
    with torch.no_grad():
        scores = _scores(token_rewards, response_mask)
        mean, _, n = _group_baseline_stats(scores, group_index)
        factor = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.ones_like(n))
        adv = torch.where(n > 1, factor * (scores - mean), scores)
        adv = _broadcast(adv, response_mask)
    return adv, adv


@register_advantage_estimator("remax")
def compute_remax(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Any,
    values: torch.Tensor | None = None,
    *,
    baseline_rewards: torch.Tensor | None = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: reward-to-go minus the greedy rollout's score `baseline_rewards[B]`."""
    reject_unknown("remax", extra, ADV_HYPER)
    check_shapes(token_rewards, response_mask, None)
    if baseline_rewards is None:
        raise ConfigError("algorithm.adv_estimator=remax needs baseline_rewards (the greedy rollout's score)")
    with torch.no_grad():
        m = response_mask.to(token_rewards.dtype)
        returns = (token_rewards * m).flip(-1).cumsum(-1).flip(-1) * m
        adv = returns - baseline_rewards.to(token_rewards.dtype).unsqueeze(-1) * m
    return adv, returns


@register_advantage_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Any,
    values: torch.Tensor | None = None,
    *,
    gamma: float = 1.0,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted reward-to-go per token, whitened over all valid tokens of the batch."""
    reject_unknown("reinforce_plus_plus", extra, ADV_HYPER)
    check_shapes(token_rewards, response_mask, None)
    with torch.no_grad():
        m = response_mask.to(token_rewards.dtype)
        returns = torch.zeros_like(token_rewards)
        running = torch.zeros_like(token_rewards[:, 0])
        for t in reversed(range(token_rewards.shape[1])):
            step = token_rewards[:, t] * m[:, t] + gamma * running
            returns[:, t] = step * m[:, t]
            # a masked token (padding, or a tool / user turn inside a multi-turn response) is skipped: the running
            # return crosses it unchanged (no reward, no discount), as GAE skips masked steps (verl #7278)
            running = torch.where(m[:, t] > 0, step, running)
        adv = masked_whiten(returns, response_mask)
    return adv, returns


@register_advantage_estimator("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Any,
    values: torch.Tensor | None = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: (s_i - group mean) broadcast, then whitened over the batch's valid tokens."""
    reject_unknown("reinforce_plus_plus_baseline", extra, ADV_HYPER)
    check_shapes(token_rewards, response_mask, group_index)
    with torch.no_grad():
        scores = _scores(token_rewards, response_mask)
        mean, _, _ = _group_baseline_stats(scores, group_index)
        adv = masked_whiten(_broadcast(scores - mean, response_mask), response_mask)
    return adv, adv


@register_advantage_estimator("opo")
def compute_opo(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Any,
    values: torch.Tensor | None = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: s_i minus the length-weighted group mean sum(|y| s) / sum(|y|); singleton baseline 0."""
    reject_unknown("opo", extra, ADV_HYPER)
    check_shapes(token_rewards, response_mask, group_index)
    with torch.no_grad():
        scores = _scores(token_rewards, response_mask)
        lengths = response_mask.to(scores.dtype).sum(-1)
        ids, g = group_ids(group_index, device=scores.device)
        zeros = torch.zeros(g, dtype=scores.dtype, device=scores.device)
        weighted = zeros.clone().index_add_(0, ids, lengths * scores)
        total_len = zeros.clone().index_add_(0, ids, lengths)
        baseline = (weighted / total_len.clamp(min=1))[ids]
        n = group_counts(ids, g, scores.dtype)[ids]
        baseline = torch.where(n > 1, baseline, torch.zeros_like(baseline))
        adv = _broadcast(scores - baseline, response_mask)
    return adv, adv


@register_advantage_estimator("gpg")
def compute_gpg(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Any,
    values: torch.Tensor | None = None,
    *,
    f_norm: float = 1.0,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: alpha (s_i - group mean) / f_norm with alpha = B / max(1, #nonzero scores)."""
    reject_unknown("gpg", extra, ADV_HYPER)
    check_shapes(token_rewards, response_mask, group_index)
    with torch.no_grad():
        scores = _scores(token_rewards, response_mask)
        alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
        mean, _, _ = _group_baseline_stats(scores, group_index)
        adv = _broadcast(alpha * (scores - mean) / f_norm, response_mask)
    return adv, adv


@register_advantage_estimator("grpo_vectorized")
def compute_grpo_vectorized(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Any,
    values: torch.Tensor | None = None,
    *,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised GRPO: the group std floored at sqrt(epsilon); singleton mean 0, std 1."""
    reject_unknown("grpo_vectorized", extra, ADV_HYPER)
    check_shapes(token_rewards, response_mask, group_index)
    with torch.no_grad():
        scores = _scores(token_rewards, response_mask)
        ids, g = group_ids(group_index, device=scores.device)
        n = group_counts(ids, g, scores.dtype)
        mean = group_mean(scores, ids, g)
        sq = torch.zeros(g, dtype=scores.dtype, device=scores.device).index_add_(0, ids, (scores - mean[ids]) ** 2)
        std = torch.sqrt((sq / (n - 1).clamp(min=1)).clamp(min=epsilon))
        single = n <= 1
        mean = torch.where(single, torch.zeros_like(mean), mean)[ids]
        std = torch.where(single, torch.ones_like(std), std)[ids]
        adv = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
        adv = _broadcast(adv, response_mask)
    return adv, adv


@register_advantage_estimator("rloo_vectorized")
def compute_rloo_vectorized(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Any,
    values: torch.Tensor | None = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised RLOO: (n s_i - sum_g s) / (n - 1), and 0 for a group of one."""
    reject_unknown("rloo_vectorized", extra, ADV_HYPER)
    check_shapes(token_rewards, response_mask, group_index)
    with torch.no_grad():
        scores = _scores(token_rewards, response_mask)
        ids, g = group_ids(group_index, device=scores.device)
        n = group_counts(ids, g, scores.dtype)[ids]
        total = torch.zeros(g, dtype=scores.dtype, device=scores.device).index_add_(0, ids, scores)[ids]
        adv = torch.where(n > 1, (n * scores - total) / (n - 1).clamp(min=1), torch.zeros_like(scores))
        adv = _broadcast(adv, response_mask)
    return adv, adv


@register_advantage_estimator("gdpo")
def compute_gdpo(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Any,
    values: torch.Tensor | None = None,
    *,
    reward_components: dict[str, Any] | None = None,
    gdpo_reward_keys: list[str] | None = None,
    gdpo_reward_weights: list[float] | None = None,
    gdpo_normalization: str = "token",
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO: each reward channel z-scored in its group, weighted sum, whitened over the batch (tokens: verl's;
    sequence: TRL's normalize_then_sum, NaN scores skipped).

    Args:
        reward_components: name -> per-sample scores [B] (list, array or tensor), from the reward pipeline.
        gdpo_reward_keys: the channels to use, in order (algorithm.gdpo_reward_keys).
        gdpo_reward_weights: one weight per key; None = all 1 (algorithm.gdpo_reward_weights).
    """
    reject_unknown("gdpo", extra, ADV_HYPER)
    check_shapes(token_rewards, response_mask, group_index)
    keys = list(gdpo_reward_keys or [])
    if keys:
        if reward_components is None:
            raise ConfigError("algorithm.adv_estimator=gdpo: the reward function returned no named scores; it "
                              f"must return a dict with the keys of algorithm.gdpo_reward_keys {keys}")
        missing = [k for k in keys if k not in reward_components]
        if missing:
            raise DataError(f"algorithm.gdpo_reward_keys {missing} not among the reward function's named scores "
                            f"{sorted(reward_components)}; return them in the dict of compute_score")
        channels = [torch.as_tensor(np.asarray(reward_components[k], dtype=np.float64), dtype=token_rewards.dtype,
                                    device=token_rewards.device) for k in keys]
    else:
        channels = [_scores(token_rewards, response_mask)]
    weights = [1.0] * len(channels) if gdpo_reward_weights is None else [float(w) for w in gdpo_reward_weights]
    if len(weights) != len(channels):
        raise ConfigError(f"algorithm.gdpo_reward_weights has {len(weights)} weights for {len(channels)} "
                          "algorithm.gdpo_reward_keys: give one weight per key")
    if gdpo_normalization not in ("token", "sequence"):
        raise ConfigError(f"algorithm.gdpo_normalization must be token or sequence, got {gdpo_normalization!r}")
    with torch.no_grad():
        total = torch.zeros_like(channels[0])
        for w, c in zip(weights, channels):
            if c.shape != total.shape:
                raise DataError(f"gdpo: a reward channel has {tuple(c.shape)} scores for {total.shape[0]} samples")
            if gdpo_normalization == "sequence":  # TRL's nanmean / nanstd (no host sync to look for NaN first)
                total = total + w * _nan_group_z(c, group_index, epsilon, norm_adv_by_std_in_grpo)
                continue
            mean, std, _ = _group_baseline_stats(c, group_index)
            total = total + w * ((c - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else c - mean)
        if gdpo_normalization == "sequence":  # TRL: (S - nanmean S) / (nanstd S + 1e-4) over the samples
            std = total.std() if total.numel() > 1 else torch.zeros((), dtype=total.dtype)
            adv = _broadcast((total - total.mean()) / (std + epsilon), response_mask)
        else:
            adv = masked_whiten(_broadcast(total, response_mask), response_mask)
    return adv, adv


def _nan_group_z(c: torch.Tensor, group_index: Any, epsilon: float, scale: bool) -> torch.Tensor:
    """(c - nanmean_g c) / (nanstd_g c + epsilon) per sample (Bessel std over the group's non-NaN scores); 0 for a
    NaN score and for a group with fewer than two scores (TRL's nanstd is NaN there, and nansum skips it)."""
    ids, g = group_ids(group_index, device=c.device)
    scored = ~torch.isnan(c)
    c0 = torch.where(scored, c, torch.zeros_like(c))
    f = scored.to(c.dtype)
    n = torch.zeros(g, dtype=c.dtype, device=c.device).index_add_(0, ids, f)
    mean = torch.zeros(g, dtype=c.dtype, device=c.device).index_add_(0, ids, c0) / n.clamp(min=1)
    sq = torch.zeros(g, dtype=c.dtype, device=c.device).index_add_(0, ids, f * (c0 - mean[ids]) ** 2)
    std = torch.sqrt(sq / (n - 1).clamp(min=1))
    z = (c0 - mean[ids]) / (std[ids] + epsilon) if scale else c0 - mean[ids]
    return torch.where(scored & (n[ids] > 1), z, torch.zeros_like(z))
