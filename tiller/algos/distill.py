"""On-policy distillation (GKD): the student samples, a frozen teacher scores the student's own tokens.

Reverse KL to the teacher on the student's samples (Agarwal et al. 2024, "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes", arXiv 2306.13649; Thinking Machines' "On-Policy Distillation",
2025; verl's `distillation.*`). For a sampled response token y_t with student and teacher log-probabilities
lp_t = log pi_student(y_t | ctx) and lq_t = log pi_teacher(y_t | ctx):

    k1_t = lp_t - lq_t          a one-sample estimate of KL(pi_student || pi_teacher) at position t

Two ways to turn it into a loss (verl's `distillation_loss.use_policy_gradient`):

- policy gradient (default; Thinking Machines, verl's recommendation with loss_mode=k1): the per-token
  "reward" is -div_t (div = the chosen estimator, k1 by default), used as a per-token advantage
  A_t = -sg(div_t) in the PPO clipped surrogate (`vanilla` policy loss) of the student's own tokens; no return,
  no discounting, no group baseline (the teacher's log-prob is already a dense per-token signal).
- supervised: div_t itself is the per-token loss, backpropagated (the estimator must then carry the teacher
  in its gradient: k2 / k3 / abs, not k1, whose gradient is that of lp_t alone).

Clamps: the per-token divergence to [-loss_max_clamp, loss_max_clamp] (k1 can be negative; verl's, the same), and
`log_prob_min_clamp` (tiller's `algorithm.distill` key only): both log-probs clamped below before the estimator.
verl 0.10 reads its `distillation_loss.log_prob_min_clamp` only in the top-k (`forward_kl_topk`) loss, never for
these estimators, so verl's layout resolves it to no clamp here (`tiller.config.edge`).

The trainer adds this loss to the outcome-reward policy loss (verl's `use_task_rewards`):
    loss = outcome_coef * agg(pg(A_outcome)) + coef * agg(distill)     with the outcome reward,
    loss = agg(distill)                                                without it (verl: coef is then 1).

Shapes: `B` sequences, `T` response tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from tiller.algos.kl import KL_KINDS, kl_penalty
from tiller.algos.policy_losses import vanilla_loss
from tiller.algos.utils import masked_mean
from tiller.errors import ConfigError

#: the estimators of KL(student || teacher) on sampled tokens (verl's `distillation_loss.loss_mode`)
DISTILL_LOSS_MODES = KL_KINDS
#: estimators whose gradient does not depend on the teacher: only usable as a policy-gradient reward
PG_ONLY_LOSS_MODES = ("k1", "kl")


def distillation_divergence(logp: torch.Tensor, teacher_logp: torch.Tensor, loss_mode: str = "k1",
                            log_prob_min_clamp: float | None = -10.0,
                            loss_max_clamp: float | None = 10.0) -> torch.Tensor:
    """Per-token divergence [B, T] of the student from the teacher on the student's sampled tokens.

    Args:
        logp: student log-probs of the sampled tokens [B, T] (with or without a gradient).
        teacher_logp: teacher log-probs of the same tokens [B, T].
        loss_mode: a KL estimator name (`tiller.algos.kl`): k1 = lp - lq, k3 = exp(lq - lp) - (lq - lp) - 1, ...
        log_prob_min_clamp: both log-probs are clamped below at this value first (None: not clamped).
        loss_max_clamp: the result is clamped to [-c, c] (None: not clamped).
    """
    if loss_mode not in DISTILL_LOSS_MODES:
        raise ConfigError(f"algorithm.distill.loss_mode: unknown estimator {loss_mode!r}; valid: "
                          f"{', '.join(DISTILL_LOSS_MODES)}")
    if log_prob_min_clamp is not None:
        logp = logp.clamp(min=log_prob_min_clamp)
        teacher_logp = teacher_logp.clamp(min=log_prob_min_clamp)
    div = kl_penalty(logp, teacher_logp, loss_mode)
    if loss_max_clamp is not None:
        div = div.clamp(min=-loss_max_clamp, max=loss_max_clamp)
    return div


def distillation_loss(logp: torch.Tensor, old_logp: torch.Tensor, teacher_logp: torch.Tensor,
                      response_mask: torch.Tensor, *, loss_mode: str = "k1", use_policy_gradient: bool = True,
                      log_prob_min_clamp: float | None = -10.0, loss_max_clamp: float | None = 10.0,
                      clip_ratio: float = 0.2, clip_ratio_low: float | None = None,
                      clip_ratio_high: float | None = None,
                      clip_ratio_c: float = 3.0,
                      rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """Per-token distillation loss [B, T] (0 outside the mask; aggregate it with `aggregate_loss`) and metrics.

    Args:
        logp: current student log-probs [B, T], with a gradient.
        old_logp: behaviour log-probs [B, T] (the PPO ratio's denominator; = logp.detach() on-policy).
        teacher_logp: teacher log-probs [B, T] of the same tokens.
        response_mask: [B, T] 0/1.
        rollout_is_weights: rollout-correction IS weights [B, T] (constants) or None: with the policy gradient they
            multiply its per-token loss, as verl passes them to this surrogate; the supervised loss ignores them (verl too).
    Metrics (tensors): `reverse_kl` = token mean of lp - lq (unclamped k1, the student's reverse-KL estimate),
    `divergence` = token mean of the clamped estimator, and with the policy gradient the PPO metrics under verl's
    names (`pg_clipfrac`, `ppo_kl`, `pg_clipfrac_lower`; logged as `distillation/<name>`, as verl).
    """
    if not use_policy_gradient and loss_mode in PG_ONLY_LOSS_MODES:
        raise ConfigError(f"algorithm.distill.loss_mode={loss_mode} with use_policy_gradient=false: the gradient of "
                          "k1 does not depend on the teacher; use k3 / k2 / abs, or the policy gradient")
    div = distillation_divergence(logp, teacher_logp, loss_mode, log_prob_min_clamp, loss_max_clamp)
    metrics: dict[str, Any] = {"reverse_kl": masked_mean((logp - teacher_logp).detach(), response_mask),
                               "divergence": masked_mean(div.detach(), response_mask)}
    if use_policy_gradient:
        loss, pg_metrics = vanilla_loss(logp, old_logp, -div.detach(), response_mask, clip_ratio=clip_ratio,
                                        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                                        clip_ratio_c=clip_ratio_c)
        metrics.update(pg_metrics)  # verl's names: distillation/pg_clipfrac, /ppo_kl, /pg_clipfrac_lower
        if rollout_is_weights is not None:
            loss = loss * rollout_is_weights.to(loss.dtype)
        return loss, metrics
    return torch.where(response_mask.bool(), div, torch.zeros((), dtype=div.dtype, device=div.device)), metrics
