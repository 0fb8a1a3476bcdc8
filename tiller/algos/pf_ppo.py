"""Preference-feedback PPO's sample reweighting (PF-PPO, Xu et al. 2024, arXiv 2409.06957; verl's
`algorithm.use_pf_ppo`): after the advantages, the step's batch is replaced by as many samples drawn from it with
replacement, each with probability proportional to a weight of its sequence score, so the update sees the samples
whose reward is most informative more often.

Weights of the scores s (verl's `compute_pf_ppo_reweight_data`):
- `pow`: |s| ** weight_pow (large rewards of either sign);
- `max_min`: 1 where s is the batch's max or min, else 0;
- `max_random`: 0.4 where s is the batch's max, else 0.1;
then w + 1e-8, clamped to >= 1e-8 (every sample keeps a tiny chance), drawn with `torch.multinomial`.
"""

from __future__ import annotations

import torch

PF_PPO_METHODS = ("pow", "max_min", "max_random")


def pf_ppo_weights(scores: torch.Tensor, method: str = "pow", weight_pow: float = 2.0) -> torch.Tensor:
    """Resampling weights [B] of the sequence scores [B], in their dtype (unnormalised; see the module docstring).
    Scores [1, -2, 0.5, 0]: pow 2 -> [1, 4, 0.25, 1e-8], max_min -> [1, 1, 1e-8, 1e-8],
    max_random -> [0.4, 0.1, 0.1, 0.1] (each + 1e-8)."""
    scores = scores.float()
    if method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).float()
    elif method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1).float()
    else:
        raise ValueError(f"pf_ppo reweight_method {method!r}: choose one of {PF_PPO_METHODS}")
    return (weights + 1e-8).clamp(min=1e-8)


def pf_ppo_resample(scores: torch.Tensor, method: str = "pow", weight_pow: float = 2.0,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices [B] of the resampled batch: B draws with replacement, P(i) proportional to `pf_ppo_weights`."""
    weights = pf_ppo_weights(scores, method, weight_pow)
    return torch.multinomial(weights, len(weights), replacement=True, generator=generator)
