"""`DeviceReads`: on a CPU, which host reads of device values (each a host sync on a GPU) a piece of code makes.

A GPU's work is queued: `float(t)`, `t.item()`, `t.tolist()`, `bool(t)`, `t.cpu()`, `t.nonzero()`, boolean
indexing and `torch.unique` of a device tensor make the host wait for everything queued before it, and the device
then waits for the host's next launches. A blocking copy of a host tensor to the device is one too (PyTorch
synchronizes the stream after it; `non_blocking=True` from pinned memory does not). On a CPU every tensor is a host
tensor, so this mode tells them apart: code under test runs with its device set to `DEVICE` (`cpu:0`, a CPU device
the tests can tell from the host's plain `cpu`); what is made there (`device=DEVICE`, `.to(DEVICE)`, the marked
model's parameters) and everything computed from it is a "device" tensor, and each read of one is recorded with the
tiller function that made it. Not seen: `.to("cpu")` of a device tensor (its `.device` is the host's `cpu` here, and
code moves tensors `.to(x.device)` all the time), nor a host tensor copied `.to(x.device)`; a tensor made with
`device=x.device` counts as the device's once device values are written into it (a blocking copy back into a host
tensor is taken for that too; an asynchronous `copy_(..., non_blocking=True)` stays the host's).
"""

from __future__ import annotations

import collections
import traceback
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

DEVICE = torch.device("cpu", 0)

T = torch.Tensor
READS = {T.item, T.tolist, T.cpu, T.numpy, T.__bool__, T.__float__, T.__int__, T.__index__, T.nonzero,
         torch.nonzero, T.masked_select, torch.masked_select, T.unique, torch.unique, torch.unique_consecutive,
         T.equal, torch.equal, torch.allclose, T.__repr__, T.__format__}
COPIES = {T.to, T.cuda, torch.tensor, torch.as_tensor}  # a host tensor or list copied to the device
INDEXING = {T.__getitem__, T.__setitem__, T.index_put, T.index_put_}


def _is_device(x) -> bool:
    return isinstance(x, torch.device) and x == DEVICE or isinstance(x, str) and x == "cpu:0"


class DeviceReads(TorchFunctionMode):
    """Records each host read of a device tensor: `reads` counts them by (what, where: `_where`). `modules`: models
    on the device (their parameters and buffers are device tensors)."""

    def __init__(self, *modules: torch.nn.Module):
        super().__init__()
        self._marked: dict[int, weakref.ref] = {}
        self.reads: collections.Counter = collections.Counter()
        for module in modules:
            for t in [*module.parameters(), *module.buffers()]:
                self._mark(t)

    def _mark(self, t: torch.Tensor) -> None:
        self._marked[id(t)] = weakref.ref(t)

    def marked(self, x) -> bool:
        ref = self._marked.get(id(x)) if isinstance(x, torch.Tensor) else None
        return ref is not None and ref() is x

    @staticmethod
    def _where() -> str:
        """tiller's innermost frame as "file.py:function" (+ " (in transformers)" when the read is the model's own)."""
        stack = traceback.extract_stack()
        mine = [i for i, f in enumerate(stack) if "/tiller/" in f.filename and "/tests/" not in f.filename]
        if not mine:
            return "?"
        f = stack[mine[-1]]
        inside = any("/transformers/" in g.filename for g in stack[mine[-1] + 1:])
        return f"{f.filename.split('/tiller/')[-1]}:{f.name}" + (" (in transformers)" if inside else "")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        device_in = any(self.marked(x) for x in flat)
        if device_in and (func in READS or func in INDEXING and len(args) > 1 and any(  # a boolean index (its count)
                self.marked(x) and x.dtype == torch.bool for x in tree_flatten(args[1])[0])):
            self.reads[(getattr(func, "__name__", str(func)), self._where())] += 1
        to_device = any(_is_device(x) for x in flat)
        if to_device and not device_in and func in COPIES and not kwargs.get("non_blocking", False):
            self.reads[("blocking copy to the device", self._where())] += 1  # (a stream sync after it on CUDA)
        out = func(*args, **kwargs)
        if func in READS:  # a host value: a copy, not the device tensor (on a CPU `cpu()` returns it)
            return out.clone() if isinstance(out, torch.Tensor) and out is args[0] else out
        if func is T.to and to_device and not device_in and isinstance(out, torch.Tensor) and out is args[0]:
            out = out.clone()  # a copy to the device: another tensor than the host's
        in_place = getattr(func, "__name__", "").endswith("_") or func is T.__setitem__
        target = args[0] if args else next(iter(kwargs.values()), None)
        if in_place and not self.marked(target):
            if func is T.copy_ and (kwargs.get("non_blocking") or len(args) > 2 and args[2]):
                return out  # an asynchronous copy back to a host tensor: it stays the host's
            if device_in and isinstance(target, torch.Tensor):  # device values written into it: a device buffer
                self._mark(target)  # (made with `device=x.device`, which reads as the host's `cpu` here)
                if target._base is not None:
                    self._mark(target._base)
            return out
        if device_in or to_device:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._mark(t)
        return out
