"""Causal attention over rows packed end to end in one sequence, shared by the update's packed forward
(`tiller.workers.packed`, verl's `use_remove_padding`) and the rollout's packed prefill (`tiller.rollout.native`).

Rows of lengths `lengths` lie end to end in `[N, H, D]` tensors (N = their sum); `cu` holds the offsets
`[0, l0, l0 + l1, ..., N]` (int32, on the tensors' device) and `longest` the largest length. Each query attends to
the keys of its own row up to itself: `torch.nn.attention.varlen.varlen_attn` (FlashAttention's varlen kernel,
shipped in torch) on CUDA in bf16 / fp16, else one SDPA call per row (`is_causal=True`); no `[N, N]` mask exists
either way.

Letters: `N` packed tokens, `Hq` / `Hk` query / key-value heads, `D` head dim.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

calls = 0  # calls that ran torch's varlen kernel (the GPU check reads it)


def varlen_available(device: torch.device) -> bool:
    """torch's varlen attention (FlashAttention) is there and applies: CUDA only."""
    if torch.device(device).type != "cuda":
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def attention_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype the packed attention runs in: the query's, or autocast's lower precision where autocast is on for
    its device. A model with fp32 weights under bf16 autocast (tiller's actor.dtype=bfloat16) computes its queries in
    fp32 after the rotary embedding (fp32 cos / sin); SDPA in the padded forward casts them to bf16 under autocast, and
    so does this, which is what lets the varlen kernel run (before, such an update on an H200 fell back to one SDPA
    call per row: 0.9% MFU)."""
    device = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(device):
        low = torch.get_autocast_dtype(device)
        if low in (torch.float16, torch.bfloat16):
            return low
    return query.dtype


def uses_varlen(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `causal_rows` runs torch's varlen kernel for queries of `dtype` on `device`."""
    return dtype in (torch.float16, torch.bfloat16) and varlen_available(device)


@functools.cache
def _varlen_params() -> frozenset[str]:
    """The keyword names this torch's `varlen_attn` takes (read once: `inspect.signature` costs ~10 us, and the
    attention runs once per layer per forward)."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale,
                     window: int | None = None) -> torch.Tensor:
    """q [N, Hq, D], k / v [N, Hk, D] -> causal attention within each row of `cu`, [N, Hq, D] (each query over its
    last `window` keys when given: FlashAttention's window_size=(window - 1, 0)); torch's varlen kernel (CUDA)."""
    from torch.nn.attention.varlen import varlen_attn

    global calls
    calls += 1
    params = _varlen_params()
    kw = {"scale": scale}
    if "window_size" in params:
        kw["window_size"] = (-1 if window is None else window - 1, 0)
    elif window is not None:
        raise RuntimeError("this torch's varlen_attn has no window_size for a sliding-window layer")
    else:
        kw["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return varlen_attn(q, k, v, cu, cu, longest, longest, **kw)


def causal_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], cu: torch.Tensor,
                longest: int, scale) -> torch.Tensor:
    """q [N, Hq, D], k / v [N, Hk, D] -> [N, Hq, D]: each row of `lengths` attends causally to its own keys
    (`varlen_attention` where `uses_varlen`, else SDPA per row over views of one split)."""
    if uses_varlen(q.dtype, q.device):
        return varlen_attention(q, k, v, cu, longest, scale)
    gqa = q.shape[1] != k.shape[1]
    outs = [F.scaled_dot_product_attention(*(x.transpose(0, 1).unsqueeze(0) for x in (qr, kr, vr)), is_causal=True,
                                           scale=scale, enable_gqa=gqa)[0].transpose(0, 1)
            for qr, kr, vr in zip(*(torch.split(x, lengths) for x in (q, k, v)))]
    return torch.cat(outs) if len(outs) > 1 else outs[0]
