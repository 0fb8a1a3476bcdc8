"""Preference losses: DPO (+ cDPO label smoothing), IPO, KTO and the pairwise reward-model loss.

Inputs are summed sequence log-probabilities (`[B]`), one per example; every loss is returned per
example (`[B]`) so the trainer chooses the reduction (mean over the global batch for invariance).

- DPO (Rafailov et al. 2023, arXiv 2305.18290), h = (pi_c - pi_r) - (ref_c - ref_r):
  `sigmoid`: -(1 - eps) log sigma(beta h) - eps log sigma(-beta h); eps = label_smoothing is
  conservative DPO (cDPO, Mitchell 2023): the label is assumed flipped with probability eps.
  `hinge` (SLiC, Zhao et al. 2023, arXiv 2305.10425): max(0, 1 - beta h).
  `robust` (Chowdhury et al. 2024, arXiv 2403.00409, eq. 7): the unbiased loss under label noise eps,
  (-(1 - eps) log sigma(beta h) + eps log sigma(-beta h)) / (1 - 2 eps).
  `ipo` (Azar et al. 2023, arXiv 2310.12036): (h' - 1 / (2 beta))^2 on h' of length-averaged log-ratios (as TRL:
  give the completion lengths). `dpo_loss` has TRL 1.16's other pair losses too (EXO, NCA, BCO-pair, SPPO-hard,
  AOT, APO, DiscoPOP, sigmoid_norm) and its f-divergences.
  Implicit rewards: beta (pi - ref), detached.
- Reference-free pair losses (`reference_free_loss`; TRL's CPOTrainer / ORPOTrainer): CPO (Xu et al. 2024, arXiv
  2401.08417, eq. 3) -log sigma(beta (log pi(y_c) - log pi(y_r))) on summed log-probs; SimPO (Meng et al. 2024, arXiv
  2405.14734, eq. 6) the same on length-averaged log-probs with a margin gamma; ORPO (Hong et al. 2024, arXiv
  2403.07691, eq. 7) -beta log sigma(log odds(y_c) - log odds(y_r)), odds(y) = p / (1 - p) of the length-averaged
  p. Their NLL terms on the chosen completions (CPO's, ORPO's) are the trainer's (token-mean over the micro-batch).
  TRL's CPOTrainer variants: `cpo_hinge` max(0, 1 - beta d) on summed log-probs, `cpo_ipo` (d - 1 / (2 beta))^2 on
  length-averaged ones; AlphaPO (Gupta et al. 2025, arXiv 2501.03884) replaces each length-averaged log-prob l by
  the reward (1 - p^-alpha) / alpha, p = e^l, in SimPO and cpo_ipo (alpha -> 0 gives l back).
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

import math

import torch
import torch.nn.functional as F

from tiller.errors import ConfigError

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sigmoid_norm")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# the losses TRL 1.16 lets take an f-divergence (the reparameterised log Z cancels only in chosen - rejected; its
# "sft" also, which is no dpo_loss here)
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop")
RM_LOSS_KINDS = ("sigmoid", "logexp")
REFERENCE_FREE_LOSSES = ("cpo", "simpo", "orpo", "cpo_hinge", "cpo_ipo")
ALPHAPO_LOSSES = ("simpo", "cpo_ipo")
"""The reference-free losses AlphaPO's reward transformation applies to: those on length-averaged log-probs, as the
paper (on SimPO). TRL's CPOTrainer also applies it to summed ones, where p^-alpha = e^(-alpha log p) overflows
float32 from a ~350-nat completion at alpha 0.25 (inf / NaN losses): refused there."""


def f_divergence_scores(logratios: torch.Tensor, kind: str = "reverse_kl", alpha: float = 0.5) -> torch.Tensor:
    """f-DPO (Wang et al. 2023, arXiv 2309.16240): the score f'(pi / ref) that replaces log(pi / ref), as TRL 1.16:
    reverse_kl: log t; forward_kl: 1 - 1/t; js_divergence: log 2 + log sigma(log t); alpha_divergence:
    (t^(alpha-1) - 1) / (alpha - 1) (log t at alpha = 1; the exponent clamped at 80, 11 in fp16)."""
    if kind == "reverse_kl":
        return logratios
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if kind == "alpha_divergence":
        if abs(alpha - 1.0) < 1e-6:
            return logratios
        t = (alpha - 1.0) * logratios
        clamp_max = 11.0 if t.dtype == torch.float16 else 80.0
        return (torch.exp(torch.clamp(t.float(), max=clamp_max)) - 1.0).to(t.dtype) / (alpha - 1.0)
    raise ConfigError(f"f_divergence: unknown {kind!r}; valid: {', '.join(F_DIVERGENCES)}")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    *,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    discopop_tau: float = 0.05,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One DPO-family loss per example: all inputs [B] -> (loss [B], chosen_rewards [B], rejected_rewards [B]).

    The formulas are TRL 1.16's (`DPOTrainer._compute_loss`), with r_c = log pi(y_c) - log ref(y_c), r_r likewise,
    s = f'(exp r) (`f_divergence_scores`; reverse_kl: s = r) and d = s_c - s_r:
    sigmoid: -(1-eps) log sigma(beta d) - eps log sigma(-beta d) (eps > 0: cDPO; TRL's sigmoid has eps = 0);
    hinge: relu(1 - beta d); ipo: (d' - 1/(2 beta))^2 and sigmoid_norm: -log sigma(beta d') with d' the
    length-averaged scores (`chosen_lengths` / `rejected_lengths`: completion tokens); robust: (-(1-eps) log
    sigma(beta d) + eps log sigma(-beta d)) / (1 - 2 eps); exo_pair (EXO, eps > 0): KL of sigma(+-beta d) to
    (1-eps, eps); nca_pair: -log sigma(beta r_c) - (log sigma(-beta r_c) + log sigma(-beta r_r)) / 2; bco_pair:
    -log sigma(beta r_c) - log sigma(-beta r_r); sppo_hard: (r_c - 1/(2 beta))^2 + (r_r + 1/(2 beta))^2; aot /
    aot_unpaired: sigmoid-with-eps on the batch's sorted log-ratio margins (pi_c - pi_r minus ref_c - ref_r, each
    sorted; unpaired: sorted r_c minus sorted r_r), so a row's loss depends on its batch; apo_zero:
    1 - sigma(beta r_c) + sigma(beta r_r); apo_down: sigma(beta r_c) + 1 - sigma(beta (r_c - r_r)); discopop:
    log-sigmoid and exp(-beta d) blended by sigma(beta d / tau). Only the losses TRL allows take an f-divergence
    (`F_DIVERGENCE_LOSSES`). Rewards: beta r, detached.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ConfigError(f"loss_type: unknown DPO loss {loss_type!r}; valid: {', '.join(DPO_LOSS_TYPES)}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ConfigError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if f_divergence != "reverse_kl" and loss_type not in F_DIVERGENCE_LOSSES:
        raise ConfigError(f"f_divergence={f_divergence!r} applies to {', '.join(F_DIVERGENCE_LOSSES)} only, not "
                          f"{loss_type!r}")
    eps = label_smoothing
    r_c = policy_chosen_logps - ref_chosen_logps
    r_r = policy_rejected_logps - ref_rejected_logps
    s_c, s_r = f_divergence_scores(r_c, f_divergence, f_alpha), f_divergence_scores(r_r, f_divergence, f_alpha)
    d = s_c - s_r
    if loss_type in ("ipo", "sigmoid_norm"):
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"loss_type={loss_type!r} needs chosen_lengths and rejected_lengths")
        d = s_c / chosen_lengths.clamp(min=1) - s_r / rejected_lengths.clamp(min=1)
    if loss_type == "sigmoid":
        loss = -(1 - eps) * F.logsigmoid(beta * d) - eps * F.logsigmoid(-beta * d)
    elif loss_type == "hinge":
        loss = torch.relu(1 - beta * d)
    elif loss_type == "ipo":
        loss = (d - 1.0 / (2.0 * beta)) ** 2
    elif loss_type == "sigmoid_norm":
        loss = -F.logsigmoid(beta * d)
    elif loss_type == "robust":
        loss = (-(1 - eps) * F.logsigmoid(beta * d) + eps * F.logsigmoid(-beta * d)) / (1 - 2 * eps)
    elif loss_type == "exo_pair":
        if eps <= 0:
            raise ConfigError("loss_type='exo_pair' needs label_smoothing > 0 (the EXO paper uses 1e-3)")
        loss = (torch.sigmoid(beta * d) * (F.logsigmoid(beta * d) - math.log1p(-eps))
                + torch.sigmoid(-beta * d) * (F.logsigmoid(-beta * d) - math.log(eps)))
    elif loss_type == "nca_pair":
        loss = -F.logsigmoid(beta * r_c) - 0.5 * F.logsigmoid(-beta * r_c) - 0.5 * F.logsigmoid(-beta * r_r)
    elif loss_type == "bco_pair":
        loss = -F.logsigmoid(beta * r_c) - F.logsigmoid(-beta * r_r)
    elif loss_type == "sppo_hard":
        loss = (r_c - 0.5 / beta) ** 2 + (r_r + 0.5 / beta) ** 2
    elif loss_type in ("aot", "aot_unpaired"):
        if loss_type == "aot":
            delta = (torch.sort(policy_chosen_logps - policy_rejected_logps, dim=0).values
                     - torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0).values)
        else:
            delta = torch.sort(r_c, dim=0).values - torch.sort(r_r, dim=0).values
        loss = -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
    elif loss_type == "apo_zero":
        loss = 1 - torch.sigmoid(beta * r_c) + torch.sigmoid(beta * r_r)
    elif loss_type == "apo_down":
        loss = torch.sigmoid(beta * r_c) + 1 - torch.sigmoid(beta * (r_c - r_r))
    else:  # discopop
        logits = beta * d
        mix = torch.sigmoid(logits / discopop_tau)
        loss = -F.logsigmoid(logits) * (1 - mix) + torch.exp(-logits) * mix
    chosen_rewards = (beta * r_c).detach()
    rejected_rewards = (beta * r_r).detach()
    return loss, chosen_rewards, rejected_rewards


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler 2012: expm1 near 0, log1p far from it)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def reference_free_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    beta: float,
    loss_type: str = "simpo",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A pair loss without a reference model: summed completion log-probs [B] and completion lengths [B] ->
    (loss [B], chosen_rewards [B], rejected_rewards [B], log odds ratio [B] for orpo else None).

    With a = logps / lengths (the length-averaged log-probs) and eps = label_smoothing:
    cpo:   d = logps_c - logps_r;                 -(1-eps) log sigma(beta d) - eps log sigma(-beta d)
    simpo: d = a_c - a_r - simpo_gamma / beta;   the same (TRL's CPOTrainer: gamma / beta is its margin)
    orpo:  l = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r)) (the log odds ratio);  -beta log sigma(l)
    cpo_hinge: d = logps_c - logps_r;             max(0, 1 - beta d)
    cpo_ipo:   d = a_c - a_r;                     (d - 1 / (2 beta))^2
    `alpha` != 0 (AlphaPO; simpo, cpo_ipo): each averaged log-prob x becomes (1 - e^(-alpha x)) / alpha before d is
    formed, as TRL's CPOTrainer.
    Rewards (detached): beta x the log-probs the loss reads (sums for cpo / cpo_hinge, averages for the others; their
    AlphaPO rewards with alpha), as TRL.

    Worked numbers (simpo, beta 2, gamma 0.5): logps -2 / -6 over 2 / 3 tokens: a = -1 / -2, d = 1 - 0.25 = 0.75,
    loss = -log sigma(1.5) = 0.2014. cpo_hinge, beta 0.1: d = 4, loss 1 - 0.4 = 0.6; cpo_ipo, beta 2: d = 1,
    loss (1 - 0.25)^2 = 0.5625; simpo with alpha 0.5, beta 2, gamma 0.5: r = 2 (1 - e^0.5) = -1.2974 /
    2 (1 - e^1) = -3.4366, d = 2.1392 - 0.25, loss -log sigma(3.7784) = 0.0226.
    """
    if loss_type not in REFERENCE_FREE_LOSSES:
        raise ConfigError(f"loss_type: unknown reference-free loss {loss_type!r}; valid: "
                          f"{', '.join(REFERENCE_FREE_LOSSES)}")
    if alpha and loss_type not in ALPHAPO_LOSSES:
        raise ConfigError(f"AlphaPO's alpha={alpha} applies to {', '.join(ALPHAPO_LOSSES)}, not {loss_type}")
    eps = label_smoothing
    log_odds = None
    if loss_type in ("cpo", "cpo_hinge"):
        used_c, used_r = chosen_logps, rejected_logps
    else:
        used_c = chosen_logps / chosen_lengths.clamp(min=1)
        used_r = rejected_logps / rejected_lengths.clamp(min=1)
    if alpha:  # AlphaPO: r = (1 - p^-alpha) / alpha = -expm1(-alpha log p) / alpha
        used_c, used_r = -torch.expm1(-alpha * used_c) / alpha, -torch.expm1(-alpha * used_r) / alpha
    d = used_c - used_r - (simpo_gamma / beta if loss_type == "simpo" else 0.0)
    if loss_type == "orpo":
        log_odds = (used_c - used_r) - (log1mexp(used_c) - log1mexp(used_r))
        loss = -beta * F.logsigmoid(log_odds)
    elif loss_type == "cpo_hinge":
        loss = torch.relu(1 - beta * d)
    elif loss_type == "cpo_ipo":
        loss = (d - 1 / (2 * beta)) ** 2
    else:
        loss = -(1 - eps) * F.logsigmoid(beta * d) - eps * F.logsigmoid(-beta * d)
    return loss, (beta * used_c).detach(), (beta * used_r).detach(), log_odds


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
