"""One decode step's attention over each row's live cache columns only, in Triton (split-KV "flash decoding"), for
the static-shape step of `tiller.rollout.graphed_decode` (`static_attention="triton"`).

The masked SDPA of the static step reads every column below the step's 256-rounded live length for every row, and
its kernel is a prefill kernel run with one query position. Here each program takes one (row, KV head, split of
the columns): it loads the group's query heads once (GQA: the G query heads that share a KV head are the rows of
one `tl.dot`), then walks only the 64-column blocks that hold the row's live columns [start, end] inside its split
(a loop with bounds read from the device, so a short row costs little and nothing is read past `end`), keeping an
online softmax (running max, sum and weighted values in fp32). A second small kernel merges the splits (none
when the grid needs one split, e.g. 256 rows of 2 KV heads: the first kernel writes the output). The grid
depends only on (rows, columns), so a CUDA graph captures it once per bucket; nothing syncs with the host.

Tensors: q [b, Hk, G, D]; the cache [>= b, Hk, L, D] (last dim contiguous; batch row i is cache row i); start / end
[b] long (end inclusive: the column this step wrote). Output [b, Hk, G, D] in q's dtype. Registered as the custom op
`tiller::decode_attention_live` so `torch.compile` keeps it opaque.

Triton runs on CUDA; on a CPU its interpreter (`TRITON_INTERPRET=1`, with triton installed) runs the same kernels,
which is how the tests check it against SDPA there.
"""

from __future__ import annotations

import os

import torch

try:  # import cost: only the GPU (or the interpreter) needs it
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU wheels come without Triton
    triton = None

BLOCK_N = 64  # cache columns per inner step
TARGET_PROGRAMS = 512  # splits are added until the grid has about this many programs (a few per SM)


def available(device_type: str) -> bool:
    """Whether the kernels can run on `device_type`: Triton installed, and a CUDA device or the interpreter."""
    if triton is None:
        return False
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def splits_for(rows: int, kv_heads: int, columns: int) -> tuple[int, int]:
    """(splits, columns per split) for a step: more splits while the grid is small, each a whole number of blocks."""
    blocks = max(1, -(-columns // BLOCK_N))
    want = max(1, min(blocks, -(-TARGET_PROGRAMS // max(1, rows * kv_heads))))
    per = -(-blocks // want) * BLOCK_N
    return -(-columns // per), per


if triton is not None:

    @triton.jit
    def _partial_kernel(q_ptr, k_ptr, v_ptr, start_ptr, end_ptr, m_ptr, l_ptr, acc_ptr, o_ptr, scale,
                        s_qb, s_qh, s_qg, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_ob, s_oh, s_og, n_splits,
                        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                        SPLIT: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr, SINGLE: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        lo = tl.load(start_ptr + b)
        hi = tl.load(end_ptr + b) + 1  # live columns [lo, hi)
        c0 = s * SPLIT
        first = (tl.maximum(lo, c0) // BLOCK) * BLOCK
        stop = tl.minimum(hi, c0 + SPLIT)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        q = tl.load(q_ptr + b * s_qb + h * s_qh + g[:, None] * s_qg + d[None, :],
                    mask=(g[:, None] < G) & (d[None, :] < D), other=0.0)
        m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        n0 = first
        while n0 < stop:  # every block here holds at least one live column (a while: the interpreter's range
            cols = n0 + tl.arange(0, BLOCK)  # takes no device scalars)
            live = (cols >= lo) & (cols < stop)
            kv_mask = live[:, None] & (d[None, :] < D)
            k = tl.load(k_ptr + b * s_kb + h * s_kh + cols[:, None] * s_kl + d[None, :], mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G_PAD, BLOCK] fp32
            scores = tl.where(live[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + b * s_vb + h * s_vh + cols[:, None] * s_vl + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
            n0 += BLOCK
        if SINGLE:  # one split: the output itself (no partials to merge, no second kernel)
            out = acc / l_sum[:, None]
            tl.store(o_ptr + b * s_ob + h * s_oh + g[:, None] * s_og + d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=(g[:, None] < G) & (d[None, :] < D))
        else:
            base = (b * tl.num_programs(1) + h) * n_splits + s
            tl.store(m_ptr + base * G_PAD + g, m)
            tl.store(l_ptr + base * G_PAD + g, l_sum)
            tl.store(acc_ptr + (base * G_PAD + g[:, None]) * D_PAD + d[None, :], acc)

    @triton.jit
    def _merge_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, s_ob, s_oh, s_og,
                      G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                      n_splits: tl.constexpr, S_PAD: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, S_PAD)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        base = (b * tl.num_programs(1) + h) * n_splits
        valid = sp < n_splits
        m = tl.load(m_ptr + (base + sp[:, None]) * G_PAD + g[None, :], mask=valid[:, None], other=float("-inf"))
        l_sum = tl.load(l_ptr + (base + sp[:, None]) * G_PAD + g[None, :], mask=valid[:, None], other=0.0)
        top = tl.max(m, 0)  # [G_PAD]: finite, every row has a live column
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top[None, :]))  # [S_PAD, G_PAD]
        total = tl.sum(w * l_sum, 0)
        out = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        for i in range(0, n_splits):
            wi = tl.sum(tl.where(sp[:, None] == i, w, 0.0), 0)  # [G_PAD]
            part = tl.load(acc_ptr + ((base + i) * G_PAD + g[:, None]) * D_PAD + d[None, :])
            out += part * wi[:, None]
        out = out / total[:, None]
        tl.store(o_ptr + b * s_ob + h * s_oh + g[:, None] * s_og + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=(g[:, None] < G) & (d[None, :] < D))


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
            scale: float) -> torch.Tensor:
    b, hk, group, dim = q.shape
    columns = k.shape[2]
    n_splits, per = splits_for(b, hk, columns)
    g_pad, d_pad = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(dim))
    if q.stride(-1) != 1:  # (the step's q is a view of the rotary output, its last dim contiguous: read as it is,
        q = q.contiguous()  # no copy kernel)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    single = n_splits == 1  # (a grid of rows x heads >= TARGET_PROGRAMS, or one block: 256 rows of Qwen2.5's 2 heads)
    f32 = dict(dtype=torch.float32, device=q.device)
    shape = (b, hk, n_splits, g_pad) if not single else (1,)  # (one split: the partials are never written)
    m, l_sum = torch.empty(shape, **f32), torch.empty(shape, **f32)
    acc = torch.empty((*shape, d_pad) if not single else (1,), **f32)
    _partial_kernel[(b, hk, n_splits)](
        q, k, v, start, end, m, l_sum, acc, out, scale, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2), n_splits,
        G=group, G_PAD=g_pad, D=dim, D_PAD=d_pad, SPLIT=per, BLOCK=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SINGLE=single)  # (fp32: no TF32 score rounding)
    if single:
        return out
    _merge_kernel[(b, hk)](m, l_sum, acc, out, out.stride(0), out.stride(1), out.stride(2),
                           G=group, G_PAD=g_pad, D=dim, D_PAD=d_pad, n_splits=n_splits,
                           S_PAD=triton.next_power_of_2(n_splits))
    return out


@torch.library.custom_op("tiller::decode_attention_live", mutates_args=())
def decode_attention_live(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v over each row's columns [start, end] of the cache (see the module doc)."""
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode_attention_live: the cache's last dim must be contiguous")
    return _launch(q, k, v, start, end, scale)


@decode_attention_live.register_fake
def _(q, k, v, start, end, scale):
    return q.new_empty(q.shape)  # (contiguous, as the kernel's output)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
              scale: float) -> torch.Tensor:
    """The same attention with a masked SDPA over every column (what the static step runs without this kernel)."""
    b, columns = q.shape[0], k.shape[2]
    cols = torch.arange(columns, device=q.device)
    mask = ((cols[None, :] >= start[:, None]) & (cols[None, :] <= end[:, None]))[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q, k[:b], v[:b], attn_mask=mask, scale=scale)


__all__ = ["available", "decode_attention_live", "reference", "splits_for", "BLOCK_N"]
