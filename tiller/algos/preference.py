"""Preference losses: DPO (+ cDPO label smoothing), IPO, KTO and the pairwise reward-model loss.

Inputs are summed sequence log-probabilities (`[B]`), one per example; every loss is returned per
example (`[B]`) so the trainer chooses the reduction (mean over the global batch for invariance).

- DPO (Rafailov et al. 2023, arXiv 2305.18290), h = (pi_c - pi_r) - (ref_c - ref_r):
  `sigmoid`: -(1 - eps) log sigma(beta h) - eps log sigma(-beta h); eps = label_smoothing is
  conservative DPO (cDPO, Mitchell 2023): the label is assumed flipped with probability eps.
  `hinge` (SLiC, Zhao et al. 2023, arXiv 2305.10425): max(0, 1 - beta h).
  `robust` (Chowdhury et al. 2024, arXiv 2403.00409, eq. 7): the unbiased loss under label noise eps,
  (-(1 - eps) log sigma(beta h) + eps log sigma(-beta h)) / (1 - 2 eps).
  `ipo` (Azar et al. 2023, arXiv 2310.12036): (h - 1 / (2 beta))^2. TRL feeds IPO length-averaged
  log-probs; pass those if you want TRL's behaviour (the function does not know the lengths).
  Implicit rewards: beta (pi - ref), detached.
- KTO (Ethayarajh et al. 2024, arXiv 2402.01306), with z = clamp(kl_baseline, min=0) detached and
  r = pi - ref: desirable: w_d (1 - sigma(beta (r - z))), undesirable: w_u (1 - sigma(beta (z - r))).
  `kl_baseline` is the batch estimate of KL(pi || ref) from mismatched (prompt, completion) pairs,
  as TRL computes it.
- Pairwise reward model (InstructGPT, Ouyang et al. 2022): `sigmoid`: -log sigma(s_c - s_r - margin)
  (Llama-2's margin term when `margin` is given); `logexp`: log(1 + exp(s_r - s_c + margin))
  (OpenRLHF's LogExpLoss). The two are the same function mathematically; both are computed with
  stable softplus / logsigmoid and kept under both names for config compatibility. `center_coef` c adds
  c (s_c + s_r)^2 per pair (Eisenstein et al. 2023, arXiv 2312.09244, "reward centering"; TRL's
  center_rewards_coefficient: its mean over pairs is TRL's term).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiller.errors import ConfigError

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
RM_LOSS_KINDS = ("sigmoid", "logexp")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO / cDPO / IPO / hinge / robust per example: all inputs [B] -> (loss [B], chosen_rewards [B],
    rejected_rewards [B])."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ConfigError(f"loss_type: unknown DPO loss {loss_type!r}; valid: {', '.join(DPO_LOSS_TYPES)}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ConfigError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    h = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        loss = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "hinge":
        loss = torch.relu(1 - beta * h)
    elif loss_type == "robust":
        eps = label_smoothing
        loss = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    else:
        loss = (h - 1.0 / (2.0 * beta)) ** 2
    chosen_rewards = (beta * (policy_chosen_logps - ref_chosen_logps)).detach()
    rejected_rewards = (beta * (policy_rejected_logps - ref_rejected_logps)).detach()
    return loss, chosen_rewards, rejected_rewards


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    is_desirable: torch.Tensor,
    kl_baseline: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO per example.

    Args:
        policy_logps, ref_logps: [B] summed completion log-probs.
        is_desirable: [B] bool.
        kl_baseline: 0-dim tensor, the batch KL estimate z_0 (clamped at 0 and detached here).
    Returns:
        (loss [B], metrics): `kl`, `rewards_chosen_sum`, `rewards_rejected_sum`, `num_chosen`,
        `num_rejected` (sums and counts, so the trainer can pool them over micro-batches).
    """
    z = kl_baseline.detach().clamp(min=0)
    logratio = policy_logps - ref_logps
    desirable = is_desirable.bool()
    chosen = desirable_weight * (1 - torch.sigmoid(beta * (logratio - z)))
    rejected = undesirable_weight * (1 - torch.sigmoid(beta * (z - logratio)))
    loss = torch.where(desirable, chosen, rejected)
    rewards = (beta * logratio).detach()
    zero = torch.zeros((), dtype=rewards.dtype)
    metrics = {
        "kl": z,
        "rewards_chosen_sum": torch.where(desirable, rewards, zero).sum(),
        "rewards_rejected_sum": torch.where(~desirable, rewards, zero).sum(),
        "num_chosen": desirable.sum(),
        "num_rejected": (~desirable).sum(),
    }
    return loss, metrics


def pairwise_rm_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | None = None,
    kind: str = "sigmoid",
    center_coef: float = 0.0,
) -> torch.Tensor:
    """Bradley-Terry pairwise loss per pair: scores [B], margin [B] or None -> loss [B] (+ c (s_c + s_r)^2)."""
    if kind not in RM_LOSS_KINDS:
        raise ConfigError(f"loss kind: unknown pairwise RM loss {kind!r}; valid: {', '.join(RM_LOSS_KINDS)}")
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff) if kind == "sigmoid" else F.softplus(-diff)
    if center_coef:
        loss = loss + center_coef * (chosen_scores + rejected_scores) ** 2
    return loss
