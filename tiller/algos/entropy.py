"""Token entropy and log-probabilities from logits, chunked; Skywork-OR1's adaptive entropy control.

`entropy_from_logits(logits[..., V])` -> [...]: H = logsumexp(z) - sum_v softmax(z)_v z_v, computed
`chunk_size` rows at a time. When the logits require grad each chunk runs under activation
checkpointing, so the softmax of only one chunk is alive at a time in forward and backward: peak
extra memory ~ chunk_size x V instead of N x V.

`logprobs_from_logits(logits[..., V], labels[...])` -> [...]: log_softmax gathered at the labels,
= z_label - logsumexp(z), chunked the same way (no full log_softmax tensor is materialised).

AdaptiveEntropyController (Skywork-OR1, He et al. 2025, arXiv 2505.22312, "adaptive entropy
control"): a coefficient c_k, target entropy H*, step delta and cap c_max. After each step with
observed entropy H_k: c_{k+1} = clip(c_k + delta * sign(H* - H_k), 0, c_max). The entropy bonus
actually used is `c_k * 1[H_k < H*]` (`effective_coeff`): the term only applies while entropy is
below target, so it never pushes entropy up once it is high enough. At H_k == H* the coefficient
does not move (sign 0); the paper's text uses <= for the raise, which differs only at equality.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from tiller.errors import ConfigError


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def _logprob_rows(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _chunked(fn, chunk_size: int, *tensors: torch.Tensor) -> torch.Tensor:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    n = tensors[0].shape[0]
    if n <= chunk_size:
        return fn(*tensors)
    use_ckpt = torch.is_grad_enabled() and tensors[0].requires_grad
    outs = []
    for start in range(0, n, chunk_size):
        parts = [t[start : start + chunk_size] for t in tensors]
        outs.append(checkpoint(fn, *parts, use_reentrant=False) if use_ckpt else fn(*parts))
    return torch.cat(outs, dim=0)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """Categorical entropy per position: logits [..., V] -> [...] (float32 for half inputs)."""
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    return _chunked(_entropy_rows, chunk_size, flat).reshape(lead)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """log softmax(logits)[labels]: logits [..., V], labels [...] (long) -> [...]."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    lead = labels.shape
    flat = logits.reshape(-1, logits.shape[-1])
    return _chunked(_logprob_rows, chunk_size, flat, labels.reshape(-1).long()).reshape(lead)


class AdaptiveEntropyController:
    """Skywork-OR1 adaptive entropy coefficient (see module doc). Holds Python floats."""

    def __init__(self, init_coeff: float, target_entropy: float, delta: float, max_coeff: float) -> None:
        if max_coeff < 0 or delta < 0:
            raise ConfigError(f"adaptive_entropy: delta ({delta}) and max_coeff ({max_coeff}) must be >= 0")
        self.value = min(max(float(init_coeff), 0.0), float(max_coeff))
        self.target = float(target_entropy)
        self.delta = float(delta)
        self.max_coeff = float(max_coeff)

    def effective_coeff(self, current_entropy: float) -> float:
        """The coefficient to use this step: value while entropy < target, else 0."""
        return self.value if current_entropy < self.target else 0.0

    def update(self, current_entropy: float) -> float:
        """c <- clip(c + delta * sign(target - entropy), 0, max_coeff); returns the new c."""
        step = self.delta * (0.0 if current_entropy == self.target else math.copysign(1.0, self.target - current_entropy))
        self.value = min(max(self.value + step, 0.0), self.max_coeff)
        return self.value
