"""PRIME: process reinforcement through implicit rewards (Cui et al. 2025, arXiv 2502.01456; verl's recipe/prime).

An implicit process reward model (PRM) pi_phi is a causal LM initialised from the policy (or its reference) and
trained online, each step, on the step's own samples with their outcome labels. Its reward is the log-ratio to a
frozen reference pi_ref (the PRM's starting weights):

    q_t = log pi_phi(y_t | y_<t) - log pi_ref(y_t | y_<t)                  [B, T]
    sequence-level implicit reward  r_phi(y) = beta * sum_t q_t
    token-level dense reward        r_phi(y_t) = beta * q_t

PRM loss (paper Eq. 3, verl's `compute_ce_dpo_loss_rm`): cross-entropy of sigmoid(r_phi(y)) against the outcome
label o in {0, 1}:  L = -[o log sigmoid(r_phi(y)) + (1 - o) log(1 - sigmoid(r_phi(y)))], mean over samples.

Advantage (paper Sec. 3.3, "RLOO on both, returns summed"): for the K samples of one prompt,

    dense:    d_t^i = r_phi(y_t^i) - 1/(K-1) sum_{j != i} mean_s r_phi(y_s^j)      (leave-one-out per-token mean)
    outcome:  o^i   = r_o(y^i)     - 1/(K-1) sum_{j != i} r_o(y^j)                  (at the last token)
    reward_t^i = reward_dpo_coef * d_t^i + reward_gt_coef * o^i [t = last]
    return_t^i = sum_{s >= t} gamma^(s-t) reward_s^i,   advantage = whiten(return) over the batch's valid tokens

(verl: returns with gamma = 1 and the same batch whitening). `prime_norm=batch_norm` (verl's default) first divides
the dense rewards by the largest |reverse cumulative sum| of the batch, so the dense returns lie in [-1, 1].

Deviations from verl's recipe: the dense RLOO is the paper's (r_t minus the others' per-token means); verl's
`masked_rloo` computes r_t K/(K-1) - sum_all means / (K-1), which adds (r_t - mean_i)/(K-1) to it. Granularity
`token` puts the dense reward on every response token (verl's code leaves the last token's out). The PRM is updated
before the rewards are computed (verl's `update: before`, the paper's Algorithm 1); `after` is not built.
A group of one sample has no leave-one-out baseline: its rewards are kept as they are.

Shapes: `B` samples, `T` response tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tiller.algos.advantages import ADV_HYPER, register_advantage_estimator
from tiller.algos.utils import group_counts, group_ids, masked_mean, masked_sum, masked_whiten, reject_unknown
from tiller.errors import DataError

PRIME_GRANULARITIES = ("token", "whole")
PRIME_NORMS = ("batch_norm", "none")


def implicit_log_ratio(prm_logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """q[B, T] = log pi_phi - log pi_ref on the response tokens (0 elsewhere)."""
    q = prm_logp - ref_logp
    return torch.where(response_mask.bool(), q, torch.zeros((), dtype=q.dtype, device=q.device))


def prime_prm_loss(prm_logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor,
                   outcome: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample cross-entropy [B] of sigmoid(beta * sum_t q_t) against the outcome label (sum or mean it).

    Args:
        prm_logp: PRM log-probs of the response tokens [B, T], with a gradient.
        ref_logp: the frozen reference's [B, T].
        outcome: [B] labels in [0, 1] (the task's accuracy).
    Metrics: `prm_acc` = fraction of samples whose implicit reward has the label's side of 0 (mean over B).
    """
    seq_reward = beta * masked_sum(implicit_log_ratio(prm_logp, ref_logp, response_mask), response_mask, dim=-1)
    target = outcome.to(seq_reward.dtype)
    loss = F.binary_cross_entropy_with_logits(seq_reward, target, reduction="none")
    right = ((seq_reward > 0) == (target > 0.5)).to(seq_reward.dtype)
    return loss, {"prm_acc": right.mean().detach(), "implicit_reward": seq_reward.mean().detach()}


def prime_token_rewards(q: torch.Tensor, response_mask: torch.Tensor, beta: float, granularity: str = "token",
                        norm: str = "batch_norm") -> torch.Tensor:
    """Dense rewards [B, T] from q = log pi_phi - log pi_ref: beta * q_t on every response token (`token`), or
    their sum on the last token (`whole`); `batch_norm` divides by the batch's max |reverse cumulative sum| (+1e-6)."""
    r = torch.where(response_mask.bool(), beta * q, torch.zeros((), dtype=q.dtype, device=q.device))
    if granularity == "whole":
        whole = torch.zeros_like(r)
        last = (response_mask.sum(-1) - 1).clamp(min=0).long()
        whole[torch.arange(len(r)), last] = r.sum(-1) * (response_mask.sum(-1) > 0).to(r.dtype)
        r = whole
    elif granularity != "token":
        raise DataError(f"algorithm.prime.granularity={granularity!r}: one of {', '.join(PRIME_GRANULARITIES)}")
    if norm == "batch_norm":
        reverse_cumsum = r.flip(-1).cumsum(-1).flip(-1)
        r = r / (reverse_cumsum.abs().max() + 1e-6)
    elif norm != "none":
        raise DataError(f"algorithm.prime.norm={norm!r}: one of {', '.join(PRIME_NORMS)}")
    return r


def _leave_one_out(per_sample: torch.Tensor, group_index: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean of the other samples of each sample's group [B], group size [B]); 0 for a group of one."""
    ids, g = group_ids(group_index, device=per_sample.device)
    n = group_counts(ids, g, per_sample.dtype)[ids]
    sums = torch.zeros(g, dtype=per_sample.dtype, device=per_sample.device).index_add_(0, ids, per_sample)[ids]
    return torch.where(n > 1, (sums - per_sample) / (n - 1).clamp(min=1), torch.zeros_like(per_sample)), n


def _discounted_returns(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    masked = rewards * response_mask.to(rewards.dtype)
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = masked[:, t] + gamma * running
        out[:, t] = running
    return out * response_mask.to(rewards.dtype)


@register_advantage_estimator("prime")
def compute_prime(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Any,
    values: torch.Tensor | None = None,
    *,
    prime_token_rewards: torch.Tensor | None = None,
    reward_gt_coef: float = 5.0,
    reward_dpo_coef: float = 5.0,
    gamma: float = 1.0,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PRIME's advantages (module doc): RLOO on the dense implicit rewards and on the outcome, returns summed,
    whitened over the batch.

    Args:
        token_rewards: [B, T] outcome reward on each response's last token.
        prime_token_rewards: [B, T] dense implicit rewards (`prime_token_rewards`), required.
    Returns (advantages, returns), both [B, T].
    """
    reject_unknown("prime", extra, ADV_HYPER)
    if prime_token_rewards is None:
        raise DataError("algorithm.adv_estimator=prime needs the implicit PRM's token rewards (prime_token_rewards)")
    if prime_token_rewards.shape != token_rewards.shape:
        raise DataError(f"prime_token_rewards {tuple(prime_token_rewards.shape)} and token_rewards "
                        f"{tuple(token_rewards.shape)} must be equal [B, T]")
    mask = response_mask.to(token_rewards.dtype)
    with torch.no_grad():
        dense = prime_token_rewards.to(token_rewards.dtype)
        dense_mean = masked_mean(dense, response_mask, dim=-1)  # mean_s r_phi(y_s^i) [B]
        dense_base, _ = _leave_one_out(dense_mean, group_index)
        dense_adv = (dense - dense_base[:, None]) * mask
        outcome = masked_sum(token_rewards, response_mask, dim=-1)
        outcome_base, _ = _leave_one_out(outcome, group_index)
        last = torch.zeros_like(token_rewards)
        last_idx = (response_mask.sum(-1) - 1).clamp(min=0).long()
        last[torch.arange(len(last)), last_idx] = (outcome - outcome_base) * (response_mask.sum(-1) > 0).to(last.dtype)
        rewards = reward_dpo_coef * dense_adv + reward_gt_coef * last
        returns = _discounted_returns(rewards, response_mask, gamma)
        advantages = masked_whiten(returns, response_mask)
    return advantages, returns
