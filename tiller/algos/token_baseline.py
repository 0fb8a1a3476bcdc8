"""Optimal token baseline (OTB): a per-token, variance-weighted group baseline for outcome rewards.

Registered in the advantage registry (`tiller.algos.advantages`) under verl's names
`optimal_token_baseline` and `tir_optimal_token_baseline`, with the one estimator signature plus

    old_logp[B, T]        logprob of each sampled token under the policy that generated it
    sum_pi_squared[B, T]  sum over the vocabulary of pi(v | context)^2 at each position (forward pass;
                          `tiller.algos.entropy.sum_pi_squared_from_logits`)
    rollout_is_weights[B, T] | None   truncated IS weights of rollout correction (optional)

Letters: `B` samples, `T` response tokens. Math (verl `compute_optimal_token_baseline_advantage`): the
minimum-variance baseline for the score-function gradient of token t weights each trajectory by the squared
norm of its score function; with pi_j = exp(old_logp_j) the sampled token's probability,

    ||s_j||^2 ~ w_j = 1 - 2 pi_j + sum_v pi(v)^2          (squared norm of grad_logits log pi at step j)
    W_t = sum_{j <= t} w_j m_j  (x rho_j^2 with rollout IS weights rho)   cumulative path variance
    G_t = sum_{j >= t} r_j m_j                                              reward-to-go
    B_t = sum_{i in group} G_it W_it m_it / (sum_{i in group} W_it m_it + epsilon)
    A_t = (G_t - B_t) m_t,   returns = G

A group of one sample has baseline 0 (A = G). With `handle_zero_tail` (default, as verl) the part of a
group's unique longest trajectory beyond the second-longest gets baseline 0: no other trajectory of the
group has a token there, so the "baseline" would be that trajectory's own return (A = 0, no learning).

`tir_optimal_token_baseline` (tool-integrated / multi-turn) is the same estimate on each trajectory's
response tokens *compacted* to positions 0..n_i-1: tool-output tokens (mask 0) between turns are skipped,
so the k-th generated token of one trajectory is compared with the k-th of the others. Empty trajectories
join no group. On a contiguous mask the two estimators agree (tested).

Deviations from verl: vectorised over groups (verl loops over groups in Python); the group sums of OTB
count only masked positions (verl's `tir` variant multiplies by nothing but its zero-padded arrays, the
same thing); outputs are exactly 0 outside `response_mask`.
"""

from __future__ import annotations

from typing import Any

import torch

from tiller.algos.advantages import ADV_HYPER, check_shapes, register_advantage_estimator
from tiller.algos.utils import group_counts, group_ids, reject_unknown
from tiller.errors import ConfigError


def _path_variance(response_mask, old_logp, sum_pi_squared, rollout_is_weights) -> torch.Tensor:
    """W[B, T]: cumulative sum of w_j = 1 - 2 pi_j + sum pi^2 (x rho^2) over valid tokens."""
    if old_logp is None or sum_pi_squared is None:
        raise ConfigError("algorithm.adv_estimator=optimal_token_baseline needs old_logp and sum_pi_squared (the "
                          "actor's per-token sum of squared probabilities from the old-logprob forward)")
    m = response_mask.to(old_logp.dtype)
    w = 1.0 - 2.0 * torch.exp(old_logp) + sum_pi_squared.to(old_logp.dtype)
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(w.dtype) ** 2
    return (w * m).cumsum(-1)


def _baseline(returns: torch.Tensor, w_cum: torch.Tensor, m: torch.Tensor, ids: torch.Tensor, g: int,
              lengths: torch.Tensor, handle_zero_tail: bool, epsilon: float) -> torch.Tensor:
    """B[B, T] from the group sums of G W m and W m; singleton groups 0; optional zero tail."""
    t = returns.shape[1]
    zeros = torch.zeros(g, t, dtype=returns.dtype, device=returns.device)
    num = zeros.clone().index_add_(0, ids, returns * w_cum * m)
    den = zeros.clone().index_add_(0, ids, w_cum * m)
    base = (num / (den + epsilon))[ids]
    n = group_counts(ids, g, returns.dtype)[ids]
    base = torch.where((n > 1).unsqueeze(-1), base, torch.zeros_like(base))
    if handle_zero_tail:
        neg = torch.full((g,), -1.0, dtype=lengths.dtype, device=lengths.device)
        longest = neg.clone().scatter_reduce_(0, ids, lengths, reduce="amax")
        is_longest = lengths == longest[ids]
        n_longest = torch.zeros(g, dtype=returns.dtype, device=returns.device).index_add_(
            0, ids, is_longest.to(returns.dtype))
        second = neg.clone().scatter_reduce_(0, ids, torch.where(is_longest, torch.full_like(lengths, -1.0), lengths),
                                             reduce="amax")
        unique_tail = is_longest & (n_longest[ids] == 1) & (n > 1) & (lengths > second[ids])
        beyond = torch.arange(t, device=returns.device).unsqueeze(0) >= second[ids].unsqueeze(-1)
        base = torch.where(unique_tail.unsqueeze(-1) & beyond, torch.zeros_like(base), base)
    return base


@register_advantage_estimator("optimal_token_baseline")
def compute_optimal_token_baseline(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Any,
    values: torch.Tensor | None = None,
    *,
    old_logp: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB: A_t = G_t - sum_g(G_t W_t) / sum_g(W_t) per token position (see module doc)."""
    reject_unknown("optimal_token_baseline", extra, ADV_HYPER)
    check_shapes(token_rewards, response_mask, group_index)
    with torch.no_grad():
        m = response_mask.to(token_rewards.dtype)
        returns = (token_rewards * m).flip(-1).cumsum(-1).flip(-1)
        w_cum = _path_variance(response_mask, old_logp, sum_pi_squared, rollout_is_weights).to(returns.dtype)
        ids, g = group_ids(group_index, device=returns.device)
        base = _baseline(returns, w_cum, m, ids, g, m.sum(-1), handle_zero_tail, epsilon)
        adv = (returns - base) * m
    return adv, returns


@register_advantage_estimator("tir_optimal_token_baseline")
def compute_tir_optimal_token_baseline(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Any,
    values: torch.Tensor | None = None,
    *,
    old_logp: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-turn OTB: the baseline of the k-th generated token over the k-th tokens of the group."""
    reject_unknown("tir_optimal_token_baseline", extra, ADV_HYPER)
    check_shapes(token_rewards, response_mask, group_index)
    with torch.no_grad():
        valid = response_mask.bool()
        m = valid.to(token_rewards.dtype)
        returns = (token_rewards * m).flip(-1).cumsum(-1).flip(-1)
        w_cum = _path_variance(response_mask, old_logp, sum_pi_squared, rollout_is_weights).to(returns.dtype)
        b, t = m.shape
        lengths = m.sum(-1)
        # compact: the k-th valid token of row i goes to column k; invalid tokens to a scratch column t
        slot = torch.where(valid, m.cumsum(-1).long() - 1, torch.full_like(m, t, dtype=torch.long))
        compact_r = returns.new_zeros(b, t + 1).scatter_(1, slot, returns * m)[:, :t]
        compact_w = returns.new_zeros(b, t + 1).scatter_(1, slot, w_cum * m)[:, :t]
        compact_m = (torch.arange(t, device=m.device).unsqueeze(0) < lengths.unsqueeze(-1)).to(m.dtype)
        ids, g = group_ids(group_index, device=m.device)
        # an empty trajectory joins no group: a group of its own (baseline 0, and nothing to weight)
        ids = torch.where(lengths > 0, ids, g + torch.arange(b, device=m.device))
        g = g + b
        base = _baseline(compact_r, compact_w, compact_m, ids, g, lengths, handle_zero_tail, epsilon)
        compact_adv = torch.cat([(compact_r - base) * compact_m, compact_r.new_zeros(b, 1)], dim=1)
        adv = torch.gather(compact_adv, 1, slot) * m
    return adv, returns
