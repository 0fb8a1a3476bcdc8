"""Token entropy and log-probabilities from logits, chunked; Skywork-OR1's adaptive entropy control.

`entropy_from_logits(logits[..., V])` -> [...]: H = logsumexp(z) - sum_v softmax(z)_v z_v, computed
`chunk_size` rows at a time, by a custom autograd function whose backward uses the closed form
dH/dz = -p (z - E_p[z]) and fills the gradient buffer chunk by chunk: besides the logits and their
gradient, only one chunk's softmax (chunk_size x V) is ever alive.

`logprobs_from_logits(logits[..., V], labels[...])` -> [...]: log_softmax gathered at the labels,
= z_label - logsumexp(z), chunked the same way (gradient onehot(label) - p); no full log_softmax
tensor is materialised. Both are first-order differentiable only (no double backward).

`sum_pi_squared_from_logits(logits[..., V])` -> [...]: sum_v softmax(z)_v^2 per position, chunked, no
gradient (the optimal token baseline's variance proxy; verl computes it in the actor's forward).

AdaptiveEntropyController (Skywork-OR1, He et al. 2025, arXiv 2505.22312, "adaptive entropy
control"): a coefficient c_k, target entropy H*, step delta and cap c_max. After each step with
observed entropy H_k: c_{k+1} = clip(c_k + delta * sign(H* - H_k), 0, c_max). The entropy bonus
actually used is `c_k * 1[H_k < H*]` (`effective_coeff`): the term only applies while entropy is
below target, so it never pushes entropy up once it is high enough. At H_k == H* the coefficient
does not move (sign 0); the paper's text uses <= for the raise, which differs only at equality.
`inclusive=True` is TRL's controller: the bonus applies at H_k <= H*, and the coefficient rises there and falls
otherwise (never holds); `min_coeff` (TRL's entropy_coef_min) replaces the floor 0.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from tiller.errors import ConfigError


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def _out_dtype(logits: torch.Tensor) -> torch.dtype:
    return _upcast(logits[:0]).dtype


def _check_chunk(chunk_size: int) -> None:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")


class _ChunkedEntropy(torch.autograd.Function):
    """H(z) per row, computed and differentiated `chunk` rows at a time.

    dH/dz = -p * (z - sum_v p_v z_v): the backward rebuilds p for one chunk at a time and writes
    straight into the gradient buffer, so no [N, V] temporary beyond that buffer is ever alive.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk: int) -> torch.Tensor:  # logits [N, V]
        out = torch.empty(logits.shape[0], dtype=_out_dtype(logits), device=logits.device)
        for s in range(0, logits.shape[0], chunk):
            z = _upcast(logits[s : s + chunk])
            out[s : s + chunk] = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
        ctx.save_for_backward(logits)
        ctx.chunk = chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (logits,) = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            z = _upcast(logits[s : s + ctx.chunk])
            p = torch.softmax(z, -1)
            mean_z = (p * z).sum(-1, keepdim=True)
            grad[s : s + ctx.chunk] = (-p * (z - mean_z) * grad_out[s : s + ctx.chunk, None]).to(grad.dtype)
        return grad, None


class _ChunkedLogProb(torch.autograd.Function):
    """log softmax(z)[y] per row, chunked; d/dz = onehot(y) - p, written chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:  # [N, V], [N]
        out = torch.empty(logits.shape[0], dtype=_out_dtype(logits), device=logits.device)
        for s in range(0, logits.shape[0], chunk):
            z = _upcast(logits[s : s + chunk])
            picked = z.gather(-1, labels[s : s + chunk, None]).squeeze(-1)
            out[s : s + chunk] = picked - torch.logsumexp(z, -1)
        ctx.save_for_backward(logits, labels)
        ctx.chunk = chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            go = grad_out[s : s + ctx.chunk, None]
            g = -torch.softmax(_upcast(logits[s : s + ctx.chunk]), -1) * go
            g.scatter_add_(1, labels[s : s + ctx.chunk, None], go.to(g.dtype))
            grad[s : s + ctx.chunk] = g.to(grad.dtype)
        return grad, None, None


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 256) -> torch.Tensor:
    """Categorical entropy per position: logits [..., V] -> [...] (float32 for half inputs)."""
    _check_chunk(chunk_size)
    flat = logits.reshape(-1, logits.shape[-1])
    return _ChunkedEntropy.apply(flat, chunk_size).reshape(logits.shape[:-1])


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = 256) -> torch.Tensor:
    """log softmax(logits)[labels]: logits [..., V], labels [...] (long) -> [...]."""
    _check_chunk(chunk_size)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    flat = logits.reshape(-1, logits.shape[-1])
    return _ChunkedLogProb.apply(flat, labels.reshape(-1).long(), chunk_size).reshape(labels.shape)


@torch.no_grad()
def sum_pi_squared_from_logits(logits: torch.Tensor, chunk_size: int = 256) -> torch.Tensor:
    """sum_v softmax(logits)_v^2 per position: logits [..., V] -> [...] float32 (no gradient)."""
    _check_chunk(chunk_size)
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for s in range(0, flat.shape[0], chunk_size):
        out[s : s + chunk_size] = torch.softmax(flat[s : s + chunk_size].float(), dim=-1).pow(2).sum(-1)
    return out.reshape(logits.shape[:-1])


class AdaptiveEntropyController:
    """Skywork-OR1 adaptive entropy coefficient (see module doc). Holds Python floats."""

    def __init__(self, init_coeff: float, target_entropy: float, delta: float, max_coeff: float,
                 min_coeff: float = 0.0, inclusive: bool = False) -> None:
        if max_coeff < 0 or delta < 0:
            raise ConfigError(f"adaptive_entropy: delta ({delta}) and max_coeff ({max_coeff}) must be >= 0")
        if min_coeff > max_coeff:
            raise ConfigError(f"adaptive_entropy: min_coeff ({min_coeff}) must be <= max_coeff ({max_coeff})")
        self.min_coeff = float(min_coeff)
        self.value = min(max(float(init_coeff), self.min_coeff), float(max_coeff))
        self.target = float(target_entropy)
        self.delta = float(delta)
        self.max_coeff = float(max_coeff)
        self.inclusive = bool(inclusive)

    def _below(self, entropy: float) -> bool:
        return entropy <= self.target if self.inclusive else entropy < self.target

    def effective_coeff(self, current_entropy: float) -> float:
        """The coefficient to use this step: value while entropy < target (<= when inclusive), else 0."""
        return self.value if self._below(current_entropy) else 0.0

    def update(self, current_entropy: float) -> float:
        """c <- clip(c + delta * sign(target - entropy), min_coeff, max_coeff) (inclusive: +delta at entropy <=
        target, else -delta); returns the new c."""
        if self.inclusive:
            step = self.delta if current_entropy <= self.target else -self.delta
        else:
            step = self.delta * (0.0 if current_entropy == self.target
                                 else math.copysign(1.0, self.target - current_entropy))
        self.value = min(max(self.value + step, self.min_coeff), self.max_coeff)
        return self.value
