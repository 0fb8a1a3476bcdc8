"""Masked statistics, group ids and the name registry shared by every module of `tiller.algos`.

Shapes: `B` = sequences, `T` = response tokens. A mask is 1 on tokens that count and 0 elsewhere
(bool, int or float 0/1). Every reduction ignores the values at masked positions, even inf or NaN,
so padding can never leak into a loss.

Deviations from verl (`verl/utils/torch_functional.py`):
- `masked_mean` of an all-zero mask is 0 (verl divides by `sum + 1e-8`, which is also ~0).
- `masked_var` of fewer than two valid elements is the biased variance (0 for one element) where
  verl raises; RL batches with one valid token are legal, so tiller keeps going.
- `masked_whiten` returns 0 at masked positions (verl leaves shifted padding values there).
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Generic, Sequence, TypeVar

import numpy as np
import torch

from tiller.errors import ConfigError, DataError

F = TypeVar("F", bound=Callable[..., Any])


def _fmask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(dtype=like.dtype if like.is_floating_point() else torch.float32)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` where `mask` is set; values under a zero mask are ignored (even NaN)."""
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over `mask` (all of it, or along `dim`); 0 where the mask is empty.

    Args:
        x: any shape, e.g. [B, T].
        mask: same shape as `x`, 0/1.
    """
    count = _fmask(mask, x).sum() if dim is None else _fmask(mask, x).sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of all of `x` over `mask` (scalar); Bessel-corrected when `unbiased` and >= 2 elements."""
    count = _fmask(mask, x).sum()
    mean = masked_mean(x, mask)
    sq = masked_sum((x - mean) ** 2, mask) / count.clamp(min=1)
    if unbiased:
        sq = sq * torch.where(count > 1, count / (count - 1).clamp(min=1), torch.ones_like(count))
    return sq


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with mean and unbiased var over `mask`; 0 at masked positions.

    With `shift_mean=False` the mean is added back (only the scale changes), as in verl.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros((), dtype=out.dtype, device=out.device))


def group_ids(group_index: Any, device: torch.device | str | None = None) -> tuple[torch.Tensor, int]:
    """Map per-sample group labels to dense integer ids 0..G-1.

    Args:
        group_index: [B] ints or strings: a list, a numpy array (object arrays too) or a tensor.
    Returns:
        (ids [B] long tensor, G). Labels are compared by value: "a" and "a" are one group.
    """
    if isinstance(group_index, torch.Tensor):
        arr = group_index.detach().cpu().numpy()
    else:
        arr = np.asarray(group_index)
    if arr.ndim != 1:
        raise DataError(f"group_index must be one label per sample (1-D), got shape {arr.shape}")
    if arr.dtype == object:
        try:
            arr = np.asarray([str(v) if not isinstance(v, (int, np.integer)) else v for v in arr])
        except Exception as exc:  # pragma: no cover - exotic labels
            raise DataError(f"group_index labels cannot be compared: {exc}") from exc
    _, inverse = np.unique(arr, return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device), int(inverse.max(initial=-1)) + 1


def group_counts(ids: torch.Tensor, num_groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Members per group: [G] (index_add rather than bincount: it has kernels on every device)."""
    ones = torch.ones(ids.shape[0], dtype=dtype, device=ids.device)
    return torch.zeros(num_groups, dtype=dtype, device=ids.device).index_add_(0, ids, ones)


def group_mean(scores: torch.Tensor, ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Mean score of each group: scores [B] -> [G] (0 for an empty group id)."""
    sums = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, scores)
    return sums / group_counts(ids, num_groups, scores.dtype).clamp(min=1)


def group_std(scores: torch.Tensor, ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Unbiased (n - 1) std of each group: [B] -> [G]; NaN for singleton groups (as torch.std)."""
    mean = group_mean(scores, ids, num_groups)
    sq = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, (scores - mean[ids]) ** 2)
    n = group_counts(ids, num_groups, scores.dtype)
    return torch.sqrt(sq / (n - 1))


class Registry(Generic[F]):
    """Name -> function table with one signature per registry.

    `register(name)` is a decorator; a duplicate name is an error. `get(name)` raises ConfigError
    listing the valid names (and the closest match) for an unknown one.
    """

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._fns: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self._fns and self._fns[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered ({sorted(self._fns)})")
            self._fns[name] = fn
            return fn

        return deco

    def get(self, name: str) -> F:
        if name not in self._fns:
            close = difflib.get_close_matches(str(name), list(self._fns), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{self.config_key}: unknown {self.kind} {name!r}{hint}; valid: {', '.join(sorted(self._fns))}"
            )
        return self._fns[name]

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns


def reject_unknown(fn_name: str, extra: dict[str, Any], allowed: Sequence[str]) -> None:
    """Raise TypeError for keyword arguments no function of the registry knows (catches typos)."""
    unknown = sorted(k for k in extra if k not in allowed)
    if unknown:
        raise TypeError(f"{fn_name}: unknown hyper-parameter(s) {unknown}; known: {sorted(allowed)}")
