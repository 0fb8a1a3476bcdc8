"""Token losses of supervised fine-tuning.

- `nll`: l_t = -log p_t, the usual cross-entropy on the target token.
- `dft` (Dynamic Fine-Tuning, Wu et al. 2025, arXiv 2508.05629, eq. 9): l_t = -sg(p_t) log p_t, the NLL of each
  token scaled by its own probability with the gradient stopped through the scale (sg = stop-gradient). The paper
  shows the SFT gradient is a policy gradient with an implicit 1/p weight; DFT cancels it. TRL's SFTTrainer
  `loss_type="dft"` is the same line.

Input `logp` is [B, T] (log-probability of each target token); the output is the per-token loss [B, T];
aggregation (token-mean over the step) is the caller's (`tiller.algos.aggregate_loss`).
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
