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

Full-vocabulary generalized JSD (`loss_mode=gjsd`, tiller's key; TRL's `DistillationTrainer` loss; Agarwal et al.
2024, eq. 2): at each response position, with student and teacher next-token distributions p = softmax(z_s / tau),
q = softmax(z_t / tau) over the whole vocabulary and the mixture m = (1 - beta) p + beta q,

    JSD_beta(p, q) = beta * KL(q || m) + (1 - beta) * KL(p || m)
    beta = 0: KL(q || p) (forward KL, exactly);   beta = 1: KL(p || q) (reverse KL, exactly; TRL's default)

a supervised loss (the gradient flows through p only; q is a constant), not a policy gradient, and no clamp. Its
gradient in the student's scaled logits z = z_s / tau is closed-form (TRL's `ChunkedDivergenceFunction` uses the
same): (1 - beta) * p * (log p - log m - KL(p || m)); beta = 0: p - q; beta = 1: p * (log p - log q - KL(p || q)).
`gjsd_per_token` evaluates it over `chunk_rows` positions at a time and recomputes each chunk in the backward, so
besides the two logit tensors only [chunk_rows, V] temporaries and [N] statistics are ever alive. No tau^2 factor
(TRL has none).

Shapes: `B` sequences, `T` response tokens, `V` vocabulary, `N` positions (B * T flattened).
"""

from __future__ import annotations

import math

from typing import Any

import torch

from tiller.algos.kl import KL_KINDS, kl_penalty
from tiller.algos.policy_losses import vanilla_loss
from tiller.algos.utils import masked_mean
from tiller.errors import ConfigError

#: the estimators of KL(student || teacher) on sampled tokens (verl's `distillation_loss.loss_mode`)
SAMPLED_LOSS_MODES = KL_KINDS
#: tiller's full-vocabulary loss (the teacher's whole distribution at each response position; supervised only)
FULL_VOCAB_LOSS_MODES = ("gjsd",)
DISTILL_LOSS_MODES = SAMPLED_LOSS_MODES + FULL_VOCAB_LOSS_MODES
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
    if loss_mode not in SAMPLED_LOSS_MODES:
        raise ConfigError(f"algorithm.distill.loss_mode: unknown estimator {loss_mode!r}; valid: "
                          f"{', '.join(SAMPLED_LOSS_MODES)} (gjsd: `gjsd_loss`, it needs the teacher's logits)")
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


def _gjsd_rows(zs: torch.Tensor, zt: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(divergence [n], aux [n], log p [n, V]) of scaled logits zs, zt [n, V]; aux = KL(p || m) (beta = 1: KL(p || q),
    beta = 0: unused) for the backward."""
    log_p = torch.log_softmax(zs, dim=-1)
    log_q = torch.log_softmax(zt, dim=-1)
    if beta == 0.0:  # KL(q || p)
        div = (log_q.exp() * (log_q - log_p)).sum(-1)
        return div, div, log_p
    if beta == 1.0:  # KL(p || q)
        div = (log_p.exp() * (log_p - log_q)).sum(-1)
        return div, div, log_p
    log_m = torch.logaddexp(log_p + math.log(1.0 - beta), log_q + math.log(beta))
    kl_p = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_q = (log_q.exp() * (log_q - log_m)).sum(-1)
    return beta * kl_q + (1.0 - beta) * kl_p, kl_p, log_p


def _gjsd_grad_rows(zs: torch.Tensor, zt: torch.Tensor, aux: torch.Tensor, beta: float) -> torch.Tensor:
    """d JSD_beta / d zs [n, V] (the closed forms of the module docstring)."""
    log_p = torch.log_softmax(zs, dim=-1)
    log_q = torch.log_softmax(zt, dim=-1)
    p = log_p.exp()
    if beta == 0.0:
        return p - log_q.exp()
    if beta == 1.0:
        return p * (log_p - log_q - aux.unsqueeze(-1))
    log_m = torch.logaddexp(log_p + math.log(1.0 - beta), log_q + math.log(beta))
    return (1.0 - beta) * p * (log_p - log_m - aux.unsqueeze(-1))


class _ChunkedGJSD(torch.autograd.Function):
    """Per-row JSD_beta [N] of student logits [N, V] (with a gradient) against teacher logits [N, V] (constant),
    computed and differentiated `chunk_rows` rows at a time (float32 or wider)."""

    @staticmethod
    def forward(ctx, student, teacher, beta: float, inv_tau: float, chunk_rows: int):  # type: ignore[override]
        dtype = torch.promote_types(student.dtype, torch.float32)
        div = torch.empty(student.shape[0], dtype=dtype, device=student.device)
        aux = torch.empty_like(div)
        entropy = torch.empty_like(div)
        for i in range(0, student.shape[0], chunk_rows):
            zs = student[i:i + chunk_rows].to(dtype) * inv_tau
            zt = teacher[i:i + chunk_rows].to(dtype) * inv_tau
            d, a, log_p = _gjsd_rows(zs, zt, beta)
            div[i:i + chunk_rows], aux[i:i + chunk_rows] = d, a
            entropy[i:i + chunk_rows] = -(log_p.exp() * log_p).sum(-1)
        ctx.save_for_backward(student, teacher, aux)
        ctx.beta, ctx.inv_tau, ctx.chunk_rows = beta, inv_tau, chunk_rows
        ctx.mark_non_differentiable(entropy)
        return div, entropy

    @staticmethod
    def backward(ctx, grad_div, _grad_entropy):  # type: ignore[override]
        student, teacher, aux = ctx.saved_tensors
        grad = torch.zeros_like(student)
        if grad_div is None:
            return grad, None, None, None, None
        dtype = aux.dtype
        for i in range(0, student.shape[0], ctx.chunk_rows):
            sl = slice(i, i + ctx.chunk_rows)
            g = _gjsd_grad_rows(student[sl].to(dtype) * ctx.inv_tau, teacher[sl].to(dtype) * ctx.inv_tau, aux[sl],
                                ctx.beta)
            grad[sl] = (g * (grad_div[sl].unsqueeze(-1) * ctx.inv_tau)).to(student.dtype)
        return grad, None, None, None, None


def gjsd_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 1.0,
                   temperature: float = 1.0, chunk_rows: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized JSD per position and the student's entropy per position (no gradient), both [...].

    Args:
        student_logits: [..., V] (e.g. [B, T, V]), with a gradient; divided by `temperature` here.
        teacher_logits: [..., V], the same shape; a constant (detached here).
        beta: in [0, 1]; 0 forward KL(q || p), 1 reverse KL(p || q), else the mixture's JSD.
        chunk_rows: positions evaluated (and re-evaluated in the backward) at a time.
    """
    if not 0.0 <= beta <= 1.0:
        raise ConfigError(f"algorithm.distill.beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ConfigError(f"gjsd temperature must be > 0, got {temperature}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ (the teacher must share the student's vocabulary)")
    lead, vocab = student_logits.shape[:-1], student_logits.shape[-1]
    div, entropy = _ChunkedGJSD.apply(student_logits.reshape(-1, vocab), teacher_logits.detach().reshape(-1, vocab),
                                      float(beta), 1.0 / float(temperature), int(chunk_rows))
    return div.reshape(lead), entropy.reshape(lead)


def gjsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, response_mask: torch.Tensor, *,
              beta: float = 1.0, temperature: float = 1.0,
              chunk_rows: int = 256) -> tuple[torch.Tensor, dict[str, Any]]:
    """Per-token full-vocabulary distillation loss [B, T] (0 outside the mask; aggregate it with `aggregate_loss`:
    token-mean over the global batch's tokens is TRL's sum / num_items_in_batch) and metrics.

    Args:
        student_logits: [B, T, V] at the response positions, with a gradient.
        teacher_logits: [B, T, V] at the same positions.
        response_mask: [B, T] 0/1.
    Metrics (tensors): `divergence` = token mean of JSD_beta; `student_entropy` = token mean of the student's entropy
    at the loss temperature (TRL's `entropy`).
    """
    div, entropy = gjsd_per_token(student_logits, teacher_logits, beta, temperature, chunk_rows)
    keep = response_mask.bool()
    metrics: dict[str, Any] = {"divergence": masked_mean(div.detach(), response_mask),
                               "student_entropy": masked_mean(entropy, response_mask)}
    return torch.where(keep, div, torch.zeros((), dtype=div.dtype, device=div.device)), metrics
