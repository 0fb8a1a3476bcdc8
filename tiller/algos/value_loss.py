"""Critic loss for PPO: clipped value loss and explained variance.

Clipped value loss (PPO2 / TRL / verl): v_clip = values + clip(vpreds - values, -c, c),
per-token loss = 0.5 * max((vpreds - returns)^2, (v_clip - returns)^2), aggregated like the policy
loss with `aggregate_loss` (global counts give micro-batch invariance). `vf_clipfrac` = fraction of
valid tokens where the clipped term is the larger one.

Explained variance: 1 - Var[returns - values] / Var[returns] over valid tokens (1 = perfect critic,
0 = no better than a constant, negative = worse). Var[returns] = 0 gives NaN, like numpy's form.

Deviation from verl: the function returns the per-token loss; verl aggregates inside.
"""

from __future__ import annotations

import torch

from tiller.algos.utils import masked_mean, masked_var


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss.

    Args:
        vpreds: [B, T] current critic predictions (carry the gradient).
        returns: [B, T] targets (from the advantage estimator).
        values: [B, T] critic predictions when the batch was collected.
        response_mask: [B, T].
        cliprange_value: c, the largest move of a prediction away from `values` that is rewarded.
    Returns:
        (per_token_loss [B, T] (0 outside the mask), {"vf_clipfrac", "vpred_mean"} detached 0-dim).
    """
    v_clip = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    loss1 = (vpreds - returns) ** 2
    loss2 = (v_clip - returns) ** 2
    loss = 0.5 * torch.maximum(loss1, loss2)
    loss = torch.where(response_mask.bool(), loss, torch.zeros((), dtype=loss.dtype))
    metrics = {
        "vf_clipfrac": masked_mean((loss2 > loss1).to(vpreds.dtype), response_mask).detach(),
        "vpred_mean": masked_mean(vpreds, response_mask).detach(),
    }
    return loss, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[returns - values] / Var[returns] over the mask (0-dim tensor). Shapes [B, T]."""
    return 1.0 - masked_var(returns - values, response_mask) / masked_var(returns, response_mask)
