"""KL estimators, KL controllers and the KL-in-reward helper.

Per-token estimators of KL(pi || pi_ref) from sampled tokens (J. Schulman, "Approximating KL
divergence", 2020, http://joschu.net/blog/kl-approx.html), with d = logp - ref_logp:
- `kl` / `k1`: d                                   (unbiased value, high variance)
- `abs`: |d|
- `mse` / `k2`: d^2 / 2                              (its gradient is the unbiased KL gradient)
- `low_var_kl` / `k3`: exp(-d) + d - 1, with -d clamped to [-20, 20] and the result to [-10, 10]
  (verl's clamps; unbiased and non-negative before clamping)
- any name + "+" (e.g. `k3+`, `low_var_kl+`): straight-through: the forward value of that estimator,
  the gradient of k2 (verl: value - sg(value) trick). `k2+` / `mse+` equal k2.

`importance_weighted_kl`: the KL loss term times the importance ratio pi / pi_old (DeepSeek-V3.2's unbiased
estimate, `actor.kl_loss_importance_weight`; TRL's `use_bias_correction_kl`).

Controllers (Ziegler et al. 2019, arXiv 1909.08593): `FixedKLController(kl_coef)` and
`AdaptiveKLController(init_kl_coef, target_kl, horizon)`, whose `update(current_kl, n_steps)` does
beta <- beta (1 + clip(KL/target - 1, -0.2, 0.2) n_steps / horizon). They hold Python floats and are
updated by the trainer once per step.
"""

from __future__ import annotations

import numpy as np
import torch

from tiller.algos.utils import masked_mean
from tiller.errors import ConfigError

KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
#: every name `kl_penalty` accepts: a kind, or a kind + "+" (k2's gradient, the kind's value)
KL_ESTIMATOR_NAMES = KL_KINDS + tuple(k + "+" for k in KL_KINDS)


def _forward_kl(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    d = logp - ref_logp
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("mse", "k2"):
        return 0.5 * d.square()
    neg = torch.clamp(-d, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(neg) - neg - 1.0, min=-10.0, max=10.0)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate [B, T] of the named kind (see module doc); same shape as the inputs."""
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in KL_KINDS:
        valid = ", ".join(KL_ESTIMATOR_NAMES)
        raise ConfigError(f"kl_loss_type / kl_penalty: unknown KL estimator {kind!r}; valid: {valid}")
    value = _forward_kl(logp, ref_logp, base)
    if not kind.endswith("+") or base in ("mse", "k2"):
        return value
    k2 = 0.5 * (logp - ref_logp).square()
    return k2 - k2.detach() + value.detach()


def importance_weighted_kl(kl: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                           level: str = "token") -> torch.Tensor:
    """DeepSeek-V3.2's unbiased KL estimate (arXiv 2512.02556, Eq. 7; TRL's `use_bias_correction_kl`): the per-token
    KL [B, T] times the importance ratio pi / pi_old, kept differentiable, so that the samples drawn from pi_old give
    the gradient of KL(pi || pi_ref). On-policy the ratio's value is 1 but its gradient adds KL x grad log pi.

    level "token": exp(logp - old_logp) per token; "sequence" (GSPO, TRL's importance_sampling_level=sequence): the
    row's exp(mean over its `mask` tokens of logp - old_logp), broadcast over the row."""
    log_ratio = logp - old_logp
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    elif level != "token":
        raise ValueError(f"importance_weighted_kl: level must be token | sequence, got {level!r}")
    return kl * torch.exp(log_ratio)


class FixedKLController:
    """Constant KL coefficient; `update` does nothing."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept for the controller interface)."""


class AdaptiveKLController:
    """Proportional controller that steers the observed KL towards `target_kl` over `horizon` samples."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ConfigError(f"algorithm.kl_ctrl.horizon must be > 0, got {horizon}")
        if target_kl <= 0:
            raise ConfigError(f"algorithm.kl_ctrl.target_kl must be > 0, got {target_kl}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """beta <- beta * (1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon)."""
        error = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000):
    """`fixed` or `adaptive` controller from `algorithm.kl_ctrl` values."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ConfigError(f"algorithm.kl_ctrl.type: unknown controller {kind!r}; valid: fixed, adaptive")


def apply_kl_in_reward(
    token_scores: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """token_rewards = token_scores - kl_coef * KL_t (masked), as verl's `apply_kl_penalty`.

    Args:
        token_scores, old_logp, ref_logp, response_mask: [B, T].
    Returns:
        (token_rewards [B, T], metrics) with `kl` = the batch mean of each sequence's mean token KL
        (feed float(metrics["kl"]) to the controller's update) and `kl_coef`.
    """
    kld = kl_penalty(old_logp, ref_logp, kind) * response_mask.to(token_scores.dtype)
    rewards = token_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean()
    return rewards, {"kl": current_kl.detach(), "kl_coef": torch.tensor(float(kl_coef))}
