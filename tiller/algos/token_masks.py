"""Token masks on the policy-gradient term (both TRL 1.16 GRPO options, as tiller actor keys).

`high_entropy_mask` (Wang et al. 2025, arXiv 2506.01939, "Beyond the 80/20 Rule"): train only on the "forking"
tokens, the `top_quantile` share of a batch's response tokens with the highest entropy. The threshold is the
(1 - top_quantile) quantile (`torch.quantile`, linear interpolation) of the entropies of the batch's valid tokens;
a token at or above it is kept. As TRL's `get_high_entropy_mask`, over one micro-batch (TRL: per device batch,
gathered over processes).

`off_policy_sequence_mask` (DeepSeek-V3.2's OPSM): drop a whole response from the policy gradient when its
advantage is negative and its mean per-token KL(behaviour || current) estimate, mean(log pi_behaviour - log pi),
exceeds `threshold`: a sample the policy has already moved far from, whose negative signal would mostly add noise.
As TRL's `get_off_policy_mask`; NaN behaviour log-probs count as 0.
"""

from __future__ import annotations

import torch


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """[B, T] float mask: the valid tokens whose entropy is at or above the batch's (1 - top_quantile) quantile.

    >>> high_entropy_mask(torch.tensor([[0.1, 0.9, 0.5, 0.3]]), torch.ones(1, 4), 0.5).tolist()
    [[0.0, 1.0, 1.0, 0.0]]
    """
    valid = mask.bool()
    values = entropy.detach()[valid].float()
    if values.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.float32)
    threshold = torch.quantile(values, 1.0 - top_quantile)
    return ((entropy.detach() * mask >= threshold) & valid).float()


def off_policy_sequence_mask(advantages: torch.Tensor, logp: torch.Tensor, behaviour_logp: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """[B, 1] float mask: 1 keeps a response (advantage >= 0, or mean KL estimate <= threshold), 0 drops it.

    advantages: [B] or [B, T] (then the response's mean advantage: an outcome advantage is constant over it).
    """
    adv = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1.0) if advantages.dim() == 2 else advantages
    kl = torch.nan_to_num(behaviour_logp - logp.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return ((adv >= 0) | (mean_kl <= threshold)).float().unsqueeze(-1)
