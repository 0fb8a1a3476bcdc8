"""Token losses of supervised fine-tuning.

- `nll`: l_t = -log p_t, the usual cross-entropy on the target token.
- `dft` (Dynamic Fine-Tuning, Wu et al. 2025, arXiv 2508.05629, eq. 9): l_t = -sg(p_t) log p_t, the NLL of each
  token scaled by its own probability with the gradient stopped through the scale (sg = stop-gradient). The paper
  shows the SFT gradient is a policy gradient with an implicit 1/p weight; DFT cancels it. TRL's SFTTrainer
  `loss_type="dft"` is the same line.

Input `logp` is [B, T] (log-probability of each target token); the output is the per-token loss [B, T];
aggregation (token-mean over the step) is the caller's (`tiller.algos.aggregate_loss`).

Label smoothing (transformers' `LabelSmoother`, TRL's SFT `label_smoothing_factor`): with eps, the nll token loss
becomes (1 - eps) (-log p_t) + eps mean_v(-log p_v), the cross-entropy against the target mixed with the uniform
distribution over the V vocabulary entries; mean_v(-log p_v) = logsumexp(z) - mean_v(z) from the logits z, so no
[B, T, V] log-softmax is kept (`smoothing_term`). Worked numbers: logits (0, ln 3) over V = 2 -> p = (1/4, 3/4); target
1, eps 0.1: 0.9 x -ln(3/4) + 0.1 x (ln 4 + ln 4/3) / 2 = 0.9 x 0.28768 + 0.1 x 0.83699 = 0.34261.
"""

from __future__ import annotations

import torch

from tiller.errors import ConfigError

SFT_LOSSES = ("nll", "dft")


def sft_token_loss(logp: torch.Tensor, kind: str = "nll") -> torch.Tensor:
    """Per-token SFT loss [B, T] from target log-probs `logp` [B, T]: nll = -logp, dft = -exp(logp).detach() * logp."""
    if kind == "nll":
        return -logp
    if kind == "dft":
        return -logp.exp().detach() * logp
    raise ConfigError(f"algorithm.loss: unknown SFT loss {kind!r}; valid: {', '.join(SFT_LOSSES)}")


def smoothing_term(logits: torch.Tensor) -> torch.Tensor:
    """mean over the vocabulary of -log softmax(logits) [..., V] -> [...]: logsumexp(z) - mean(z)."""
    return torch.logsumexp(logits, dim=-1) - logits.mean(dim=-1)


def label_smoothed_loss(logp: torch.Tensor, logits: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-token nll with label smoothing eps (module docstring) from target log-probs [B, T] and logits [B, T, V]."""
    return (1.0 - eps) * -logp + eps * smoothing_term(logits.float())
