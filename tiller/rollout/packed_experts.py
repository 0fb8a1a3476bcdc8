"""A mixture-of-experts block's expert matmuls on packed weights, for the native engine on a CPU.

transformers runs an experts module (`@use_experts_implementation`: Qwen2-MoE, Qwen3-MoE, Qwen3-VL-MoE, Mixtral,
GLM-4.5) through `grouped_mm` by default, whose CPU kernel is one row-major `mm` per expert. At decode time an expert
sees a few rows (rows x top-k / experts), so a step streams every expert's weights from memory for little arithmetic,
and those small row-major GEMMs read them at a quarter of the memory rate. Here each expert's gate-up and down
matrices are packed once per weight sync, and a block's (token, slot) pairs are grouped by expert on the host (a CPU
step has no device to keep the routing on):

    order = stable argsort of the (token, slot) expert ids;  x_e = hidden[order // k] for expert e's slots
    y_e = down_e(silu(gate) * up of x_e W_gu,e^T) x weight
    out[token] = sum over its k slots of y             (the slots' order, in fp32, as `grouped_mm`)

Two ways to run the matmuls, both on weights packed once per sync:
- the C kernel `kernels/experts.c` (a whole block's experts in one call: the weights in 16-column panels, each read
  from memory once per call with software prefetch, the activation and the weighted scatter fused; fp32 accumulation;
  bf16 by AVX512-BF16 dot products of k pairs where the CPU has them, else widened), where it applies: a C compiler
  (built as `tiller.rollout.decode_kernel`'s kernel is), SiLU gating (every family above), widths that are multiples
  of 16, fp32 / bf16. The expert matmuls of 10 layers x 32 experts of the 30M bench shape, 8 rows per expert, cold,
  1 thread on a 2-core AMD EPYC (AVX-512 BF16): fp32 57 ms (oneDNN packed 89 ms, row-major 175 ms), bf16 28 ms
  (oneDNN packed 51 ms, row-major 87 ms);
- else oneDNN's packed matmul per expert (`torch.ops.mkldnn._linear_pointwise`, ~2x the row-major one).

The router, any shared expert and the block's own arithmetic stay the model's: the block's `forward` runs with this
object in place of its `experts` (`run_block`), so routing hooks (`tiller.models.routing`) see the same router calls.
Results differ from transformers' experts by summation order (~1e-6 relative in fp32); in bf16 the kernel keeps the
gate-up output in fp32 where transformers rounds it to bf16 (tests: at least as close to fp32 as transformers).
`TILLER_EXPERTS_KERNEL=0` keeps oneDNN.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from tiller.rollout.decode_kernel import compile_library, run_parts

PACK_ROWS = 64
"""Row count oneDNN picks the experts' packed layout for (any row count runs on it). A decode step gives an expert a
few rows (64 rows x top-4 / 32 experts = 8): measured with 3-32 rows per expert, layouts for 8 and 64 rows read the
weights at the same rate, the one for 16 at ~25% less (1 thread, AMD EPYC AVX-512)."""

_SOURCE = Path(__file__).with_name("kernels") / "experts.c"
_LOCK = threading.Lock()
_LIB: list = []  # [the built library or None], once per process
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def packable(experts: torch.nn.Module) -> bool:
    """transformers' experts layout this runs: gate and up concatenated in `gate_up_proj` [E, 2I, H], `down_proj`
    [E, H, I], no biases, no post-expert norm, all experts local (not expert-parallel), fp32 / bf16 on the CPU."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3
            and getattr(experts, "has_gate", False) and getattr(experts, "is_concatenated", False)
            and not getattr(experts, "is_transposed", True) and not getattr(experts, "has_bias", True)
            and not getattr(experts, "has_post_expert_norm", True) and not getattr(experts, "_is_expert_parallel", True)
            and gate_up.shape[0] == down.shape[0] and gate_up.shape[2] == down.shape[1]
            and gate_up.shape[1] == 2 * down.shape[2] and gate_up.device.type == "cpu"
            and gate_up.dtype in (torch.float32, torch.bfloat16) and gate_up.dtype == down.dtype)


def _silu_gated(experts: torch.nn.Module) -> bool:
    """The module gates as transformers' default does (act(gate) * up), with SiLU: what the C kernel computes."""
    from transformers.integrations.moe import _default_apply_gate

    act = type(getattr(experts, "act_fn", None)).__name__
    return getattr(type(experts), "_apply_gate", None) is _default_apply_gate and act in ("SiLUActivation", "SiLU")


def _library() -> ctypes.CDLL | None:
    with _LOCK:
        if not _LIB:
            lib = None
            if os.environ.get("TILLER_EXPERTS_KERNEL", "1") != "0":
                lib = compile_library(_SOURCE, (), "experts", "the experts kernel", "experts run on oneDNN")
            if lib is not None:
                for name in ("experts_f32", "experts_bf16"):
                    fn = getattr(lib, name)
                    fn.restype, fn.argtypes = None, [_P, _P, _I64, _I64, _P, _P, _P, _P, _P, _P, _I64, _I64]
                lib.experts_bf16_pairs.restype, lib.experts_bf16_pairs.argtypes = ctypes.c_int, []
            _LIB.append(lib)
        return _LIB[0]


def panels(weight: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """[E, N, K] -> the kernel's panels [E, N / 16, K, 16]: P[e, n, k, j] = W[e, 16 n + j, k]; `pairs` (bf16 on a CPU
    with AVX512-BF16): [E, N / 16, K / 2, 16, 2], P[e, n, i, j, t] = W[e, 16 n + j, 2 i + t]."""
    e, n, k = weight.shape
    if pairs:
        return weight.detach().view(e, n // 16, 16, k // 2, 2).permute(0, 1, 3, 2, 4).contiguous()
    return weight.detach().view(e, n // 16, 16, k).transpose(2, 3).contiguous()


class PackedExperts:
    """Experts module `experts`' weights packed per expert; called as the module is: (hidden [N, H], top_k_index
    [N, k], top_k_weights [N, k]) -> [N, H]. `kernel`: None picks the C kernel where it applies."""

    def __init__(self, experts: torch.nn.Module, kernel: bool | None = None):
        self.experts = experts
        self.num_experts, hidden = experts.down_proj.shape[:2]
        inter = experts.down_proj.shape[2]
        fits = hidden % 16 == 0 and inter % 16 == 0 and _silu_gated(experts)
        self.lib = _library() if fits and kernel is not False else None
        if kernel and self.lib is None:
            raise ValueError("experts kernel: not available here (no C compiler, a failed build, "
                             "TILLER_EXPERTS_KERNEL=0) or not for this module (SiLU gating, widths multiple of 16)")
        with torch.no_grad():
            if self.lib is not None:
                pairs = experts.down_proj.dtype == torch.bfloat16 and bool(self.lib.experts_bf16_pairs())
                self.gate_up, self.down = panels(experts.gate_up_proj, pairs), panels(experts.down_proj, pairs)
            else:
                self.gate_up = [torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS)
                                for w in experts.gate_up_proj]
                self.down = [torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS) for w in experts.down_proj]

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        n, k = top_k_index.shape
        if n == 0:
            return torch.zeros_like(hidden)
        flat = top_k_index.reshape(-1)
        low, high = int(flat.min()), int(flat.max())
        if low < 0 or high >= self.num_experts:
            bad = low if low < 0 else high
            raise ValueError(f"experts: an expert id {bad} beyond the block's {self.num_experts} experts")
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        rows = hidden.index_select(0, order // k)
        weights = top_k_weights.reshape(-1)[order]
        if self.lib is not None:
            slots = self._kernel(rows, counts, weights.float(), order, self.experts.down_proj.dtype)
        else:
            slots = self._onednn(rows, counts.tolist(), weights, order)
        return slots.view(n, k, hidden.shape[-1]).sum(dim=1).to(hidden.dtype)

    def _onednn(self, rows, counts: list[int], weights, order) -> torch.Tensor:
        apply_gate = self.experts._apply_gate
        outs, start = [], 0
        for e, c in enumerate(counts):
            if c:
                x = rows[start : start + c]
                y = apply_gate(torch.ops.mkldnn._linear_pointwise(x, self.gate_up[e], None, "none", [], ""))
                outs.append(torch.ops.mkldnn._linear_pointwise(y, self.down[e], None, "none", [], ""))
                start += c
        weighted = torch.cat(outs) * weights.unsqueeze(-1)
        slots = torch.empty_like(weighted)
        slots[order] = weighted
        return slots

    def _kernel(self, rows, counts, weights, order, dtype) -> torch.Tensor:
        """Every slot's weighted expert output, fp32 [S, H] in slot order; the experts split over torch's threads
        by their row counts."""
        hidden, inter = self.experts.down_proj.shape[1:]
        rows = rows.to(dtype).contiguous()
        off = torch.zeros(self.num_experts + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=off[1:])
        out = torch.empty(len(order), hidden, dtype=torch.float32)
        fn = self.lib.experts_f32 if dtype == torch.float32 else self.lib.experts_bf16
        bounds = off.tolist()
        total = bounds[-1]
        threads = max(1, min(torch.get_num_threads(), self.num_experts, total))
        # contiguous runs of experts with about total / threads rows each
        cuts = [0] + [min(range(self.num_experts + 1), key=lambda e: abs(bounds[e] - total * i / threads))
                      for i in range(1, threads)] + [self.num_experts]
        largest = int(counts.max()) if total else 0
        scratch = torch.empty(threads, max(1, largest) * (3 * inter + hidden), dtype=torch.float32)
        order = order.contiguous()

        def run(i: int) -> None:
            fn(rows.data_ptr(), off.data_ptr(), cuts[i], cuts[i + 1], self.gate_up.data_ptr(), self.down.data_ptr(),
               weights.data_ptr(), order.data_ptr(), out.data_ptr(), scratch[i].data_ptr(), hidden, inter)

        run_parts(run, threads)
        return out


class _BlockView:
    """Block `block` seen with `experts` in place of its own: attribute reads fall through to the block."""

    def __init__(self, block: torch.nn.Module, experts: PackedExperts):
        self.__dict__["_block"] = block
        self.__dict__["experts"] = experts

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_block"], name)


def run_block(block: torch.nn.Module, experts: PackedExperts, hidden: torch.Tensor):
    """`block`'s forward on hidden [1, N, H] with its expert matmuls run by `experts`; the block itself is not
    changed (another thread may run it meanwhile). A block with hooks of its own runs as a module, unpacked."""
    if block._forward_hooks or block._forward_pre_hooks:
        return block(hidden)
    return type(block).forward(_BlockView(block, experts), hidden)
