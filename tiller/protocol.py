"""Batch: the one container passed between tiller's workers (rollout, reward, actor, critic).

A `Batch` holds named tensors that share their first dimension B (one row per sample), per-sample
non-tensor fields (strings, dicts, ground truths) stored as 1-D numpy object arrays of length B,
and a `meta` dict for batch-level values (temperature, step, ...). It plays the role of verl's
`DataProto` (tensors + `non_tensor_batch` + `meta_info`) without TensorDict.

Operations return new batches that share storage where torch / numpy do (slices are views); nothing
is modified in place except `b[key] = value`. Pickling (e.g. through Ray's object store) converts
tensors to numpy arrays, which is several times cheaper than pickling torch tensors; dtypes survive the
round trip, bfloat16 (which numpy lacks) travelling as its int16 bit pattern. Tensors always come back
on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

Index = int | slice | Sequence[int] | np.ndarray | torch.Tensor


def _as_object_array(values: Any) -> np.ndarray:
    """1-D numpy object array with one element per sample (nested lists stay whole elements)."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    values = list(values)
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


def _index_array(idx: Index, n: int) -> np.ndarray | slice:
    """Normalise an index to a slice or an int64 numpy array (bool masks become positions)."""
    if isinstance(idx, slice):
        return idx
    if isinstance(idx, int | np.integer):
        idx = [int(idx)]
    if isinstance(idx, torch.Tensor):
        idx = idx.detach().cpu().numpy()
    arr = np.asarray(idx)
    if arr.dtype == bool:
        if arr.shape != (n,):
            raise ValueError(f"Batch: boolean mask has shape {arr.shape}, batch has {n} rows")
        return np.nonzero(arr)[0]
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"Batch: cannot index with dtype {arr.dtype}")
    return arr.astype(np.int64).reshape(-1)


def _values_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b.to(a.device)))
    if len(a) != len(b):
        return False
    try:
        return all(bool(np.all(x == y)) for x, y in zip(a, b))
    except (ValueError, TypeError):
        return False


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device` without waiting for the device: a host tensor goes through pinned memory, non-blocking, to a
    GPU. (PyTorch synchronizes the stream after a blocking host-to-device copy: the host would wait for every kernel
    queued before it, e.g. the last micro-batch's backward, and the device then for the host.)"""
    device = torch.device(device)
    if device.type == "cpu" and t.device.type != "cpu":  # back to the host: complete when it returns
        return t.to(device)
    if t.device.type == "cpu" and device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class Batch:
    """Named tensors `[B, ...]` plus per-sample fields `[B]` and batch-level `meta`.

    >>> b = Batch({"x": torch.arange(4)}, {"tag": ["a", "b", "c", "d"]})
    >>> b.repeat(2)["tag"].tolist()
    ['a', 'a', 'b', 'b', 'c', 'c', 'd', 'd']
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None = None,
                 fields: Mapping[str, Any] | None = None, meta: Mapping[str, Any] | None = None):
        self.tensors: dict[str, torch.Tensor] = {}
        self.fields: dict[str, np.ndarray] = {}
        self.meta: dict[str, Any] = dict(meta or {})
        for k, v in (tensors or {}).items():
            self[k] = v
        for k, v in (fields or {}).items():
            self[k] = _as_object_array(v)

    # ---- basic access -------------------------------------------------------------------------
    def __len__(self) -> int:
        for t in self.tensors.values():
            return t.shape[0]
        for f in self.fields.values():
            return len(f)
        return 0

    def keys(self) -> list[str]:
        return [*self.tensors, *self.fields]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.fields

    def __getitem__(self, key):
        if isinstance(key, str):
            if key in self.tensors:
                return self.tensors[key]
            if key in self.fields:
                return self.fields[key]
            raise KeyError(f"Batch has no key {key!r}; keys: {', '.join(self.keys()) or '(none)'}")
        return self.index(key)

    def __setitem__(self, key: str, value) -> None:
        """Add or replace a tensor (torch.Tensor) or a per-sample field (anything else)."""
        is_tensor = isinstance(value, torch.Tensor)
        if is_tensor and value.dim() == 0:
            raise ValueError(f"Batch: tensor {key!r} is 0-dimensional; per-sample tensors need a batch dimension")
        if not is_tensor:
            value = _as_object_array(value)
        n_new = value.shape[0] if is_tensor else len(value)
        others = [k for k in self.keys() if k != key]
        if others:
            ref = others[0]
            n_ref = self.tensors[ref].shape[0] if ref in self.tensors else len(self.fields[ref])
            if n_new != n_ref:
                raise ValueError(f"Batch: {key!r} has length {n_new} but {ref!r} has length {n_ref}; "
                                 "all tensors and fields must share the first dimension")
        self.tensors.pop(key, None)
        self.fields.pop(key, None)
        (self.tensors if is_tensor else self.fields)[key] = value

    def pop(self, key: str):
        if key in self.tensors:
            return self.tensors.pop(key)
        if key in self.fields:
            return self.fields.pop(key)
        raise KeyError(f"Batch has no key {key!r}; keys: {', '.join(self.keys()) or '(none)'}")

    def __repr__(self) -> str:
        ts = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in self.tensors.items())
        return f"Batch(len={len(self)}, tensors={{{ts}}}, fields={list(self.fields)}, meta={list(self.meta)})"

    def _new(self, tensors, fields, meta=None) -> Batch:
        out = Batch(meta=self.meta if meta is None else meta)
        out.tensors, out.fields = dict(tensors), dict(fields)  # already validated: skip the checks
        return out

    # ---- selection ------------------------------------------------------------------------------
    def select(self, keys: Iterable[str]) -> Batch:
        """A batch with only `keys` (tensors and fields; storage shared)."""
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no key(s) {missing}; keys: {', '.join(self.keys()) or '(none)'}")
        return self._new({k: v for k, v in self.tensors.items() if k in keys},
                         {k: v for k, v in self.fields.items() if k in keys})

    def index(self, idx: Index) -> Batch:
        """Rows by int, slice, int list / array / LongTensor (any order, repeats allowed) or bool mask [B]."""
        ix = _index_array(idx, len(self))
        if isinstance(ix, slice):
            return self._new({k: v[ix] for k, v in self.tensors.items()}, {k: v[ix] for k, v in self.fields.items()})
        n = len(self)
        if ix.size and (ix.max() >= n or ix.min() < -n):
            raise IndexError(f"Batch: index {int(ix.max() if ix.max() >= n else ix.min())} out of range for {n} rows")
        tix = torch.from_numpy(ix)
        return self._new({k: v[tix.to(v.device)] for k, v in self.tensors.items()},
                         {k: v[ix] for k, v in self.fields.items()})

    def reorder(self, indices: Index) -> Batch:
        """Rows permuted by `indices`, which must be a permutation of range(len(self))."""
        ix = _index_array(indices, len(self))
        if isinstance(ix, slice) or sorted(ix.tolist()) != list(range(len(self))):
            raise ValueError(f"Batch.reorder: indices must be a permutation of range({len(self)})")
        return self.index(ix)

    # ---- split / join ---------------------------------------------------------------------------
    def split(self, size: int) -> list[Batch]:
        """Consecutive batches of `size` rows (the last may be smaller)."""
        if size <= 0:
            raise ValueError(f"Batch.split: size must be positive, got {size}")
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    def chunk(self, n: int) -> list[Batch]:
        """Exactly `n` consecutive batches whose sizes differ by at most one (larger ones first)."""
        if n <= 0:
            raise ValueError(f"Batch.chunk: n must be positive, got {n}")
        base, extra = divmod(len(self), n)
        out, start = [], 0
        for i in range(n):
            size = base + (1 if i < extra else 0)
            out.append(self.index(slice(start, start + size)))
            start += size
        return out

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order; they must have the same keys. `meta` is the union (first wins)."""
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.concat: no batches given")
        keys = set(batches[0].keys())
        for i, b in enumerate(batches[1:], 1):
            if set(b.keys()) != keys:
                raise ValueError(f"Batch.concat: batch {i} has keys {sorted(b.keys())}, batch 0 has {sorted(keys)}")
        tensors = {}
        for k in batches[0].tensors:
            try:
                tensors[k] = torch.cat([b.tensors[k] for b in batches], dim=0)
            except RuntimeError as err:
                shapes = [tuple(b.tensors[k].shape) for b in batches]
                raise ValueError(f"Batch.concat: tensor {k!r} shapes do not match: {shapes}") from err
        fields = {k: np.concatenate([b.fields[k] for b in batches]) for k in batches[0].fields}
        meta: dict[str, Any] = {}
        for b in reversed(batches):
            meta.update(b.meta)
        return batches[0]._new(tensors, fields, meta)

    def union(self, other: Batch) -> Batch:
        """Keys of both batches (same length); a key in both must hold equal values."""
        if len(other) != len(self) and self.keys() and other.keys():
            raise ValueError(f"Batch.union: lengths differ ({len(self)} vs {len(other)})")
        for k in set(self.keys()) & set(other.keys()):
            if not _values_equal(self[k], other[k]):
                raise ValueError(f"Batch.union: key {k!r} is in both batches with different values")
        return self._new({**self.tensors, **other.tensors}, {**self.fields, **other.fields},
                         {**other.meta, **self.meta})

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row `n` times: interleave=True gives [a,a,b,b] (samples of a prompt adjacent), False [a,b,a,b]."""
        if n < 1:
            raise ValueError(f"Batch.repeat: n must be >= 1, got {n}")
        if interleave:
            tensors = {k: v.repeat_interleave(n, dim=0) for k, v in self.tensors.items()}
            fields = {k: np.repeat(v, n) for k, v in self.fields.items()}
        else:
            tensors = {k: v.repeat(n, *([1] * (v.dim() - 1))) for k, v in self.tensors.items()}
            fields = {k: np.tile(v, n) for k, v in self.fields.items()}
        return self._new(tensors, fields)

    def pad_to_multiple(self, k: int) -> tuple[Batch, int]:
        """Append copies of the first rows (cycling) so len is a multiple of `k`; returns (batch, pad)."""
        n = len(self)
        pad = (-n) % k
        if pad == 0:
            return self, 0
        if n == 0:
            raise ValueError("Batch.pad_to_multiple: cannot pad an empty batch")
        return Batch.concat([self, self.index(np.arange(pad) % n)]), pad

    def unpad(self, pad: int) -> Batch:
        """Drop the last `pad` rows added by `pad_to_multiple`."""
        return self if pad == 0 else self.index(slice(0, len(self) - pad))

    def to(self, device: str | torch.device, non_blocking: bool = False) -> Batch:
        return self._new({k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()}, self.fields)

    # ---- pickling (Ray, multiprocessing) --------------------------------------------------------
    def __getstate__(self) -> dict:
        arrays = {}
        for k, t in self.tensors.items():
            t = t.detach().cpu()
            dtype = str(t.dtype).removeprefix("torch.")
            if t.dtype == torch.bfloat16:
                t = t.view(torch.int16)
            arrays[k] = (dtype, t.numpy())
        return {"tensors": arrays, "fields": self.fields, "meta": self.meta}

    def __setstate__(self, state: dict) -> None:
        self.tensors = {}
        for k, (dtype, arr) in state["tensors"].items():
            t = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
            self.tensors[k] = t.view(torch.bfloat16) if dtype == "bfloat16" else t
        self.fields = state["fields"]
        self.meta = state["meta"]
