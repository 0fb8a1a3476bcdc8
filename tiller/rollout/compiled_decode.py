"""The fused decode step compiled with `torch.compile` (Inductor), opt-in: `enforce_eager=False` for the native
rollout engine, `tiller serve --compile` for the server.

At a few rows per step a decode step is the weight matmuls (prepacked, `tiller.rollout.fused_decode`) plus ~20
small ops per layer (RMSNorm, rotary, SiLU-times-up, residual adds, the cache write). Each small op costs a
dispatch, and right after a matmul that streamed megabytes of weights through the caches it runs cold: in eager
mode they are ~15-20% of a 16-row step of a 30M model. Compiled, Inductor fuses them into a few C++ loops.

The matmuls, the attention and any mixture-of-experts block stay what they are in eager mode, wrapped as opaque
custom ops (`tiller::packed_linear`, `tiller::decode_attention`, `tiller::experts`) that look their weights / cache
up in a registry by an integer handle, so Inductor never sees the oneDNN-prepacked tensors (it cannot trace them), nor
an experts block's data-dependent routing, and a weight sync
(new packed tensors under the same handle) needs no recompile. The graph is compiled once for any row count
(`dynamic=True`; one row is a second, specialised graph); the first step of each compiles (~10-30 s on 2 cores,
once per process). It needs a C++ compiler (Inductor's CPU backend) or Triton (CUDA); `available()` says whether
it is there.

Results equal the eager fused step up to float summation order (RMSNorm's mean is vectorised differently):
logits within ~1e-5 in fp32, tested along with greedy output equal to eager's.
"""

from __future__ import annotations

import importlib.util
import itertools
import shutil
import types
import weakref

import torch

_REGISTRY: "weakref.WeakValueDictionary[int, CompiledStep]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count()
_OPS_DEFINED = False


def available(device_type: str = "cpu") -> bool:
    """Inductor can compile for `device_type` here: its CPU backend needs a C++ compiler on PATH, its GPU
    backend Triton."""
    if device_type == "cuda":
        return importlib.util.find_spec("triton") is not None
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def _define_ops() -> None:
    global _OPS_DEFINED
    if _OPS_DEFINED:
        return

    @torch.library.custom_op("tiller::packed_linear", mutates_args=())
    def packed_linear(x: torch.Tensor, handle: int, index: int, n_out: int) -> torch.Tensor:
        return _REGISTRY[handle].linear(x, index)

    @packed_linear.register_fake
    def _(x, handle, index, n_out):
        return x.new_empty((*x.shape[:-1], n_out))

    # writes the step's keys / values into the cache it looks up: an effect the graph does not see, which is fine
    # because nothing else in the graph reads the cache and the op's output is always used
    @torch.library.custom_op("tiller::decode_attention", mutates_args=())
    def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int, layer: int) -> torch.Tensor:
        return _REGISTRY[handle].attention(q, k, v, layer)

    @decode_attention.register_fake
    def _(q, k, v, handle, layer):
        return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))

    # a mixture-of-experts block (data-dependent routing) run as the model's module, opaque to the graph
    @torch.library.custom_op("tiller::experts", mutates_args=())
    def experts(h: torch.Tensor, handle: int, layer: int) -> torch.Tensor:
        return _REGISTRY[handle].fused.mlp(h, layer)

    @experts.register_fake
    def _(h, handle, layer):
        return torch.empty_like(h)

    _OPS_DEFINED = True


class CompiledStep:
    """The compiled one-token step of a `FusedDecoder` (same weights, same cache contract)."""

    def __init__(self, fused):
        _define_ops()
        self.fused = fused
        self.handle = next(_HANDLES)
        _REGISTRY[self.handle] = self
        self._mask = self._cache = None
        self._fn = torch.compile(own_code(self._graph), dynamic=True, fullgraph=True)

    def close(self) -> None:
        _REGISTRY.pop(self.handle, None)

    # ----------------------------------------------------------------------- the opaque ops' bodies
    def _lin(self, index: int) -> tuple:
        f = self.fused
        layers = len(f.qkv)
        if index == 4 * layers:
            return f.head
        layer, kind = divmod(index, 4)
        return (f.qkv, f.o, f.gate_up, f.down)[kind][layer]

    def linear(self, x: torch.Tensor, index: int) -> torch.Tensor:
        return self.fused._apply(x, self._lin(index))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """q [B, Hq, D], k / v [B, Hk, D] of the new token: write k / v, attend over the cache (as the eager step)."""
        f = self.fused
        b, d = q.shape[0], f.head_dim
        k, v = self._cache.update(k.unsqueeze(2), v.unsqueeze(2), layer)
        o = f.decode_attention(q.reshape(b, f.n_kv, f.n_q // f.n_kv, d), k, v, self._mask)
        return o.reshape(b, f.n_q * d)

    # ----------------------------------------------------------------------- the traced step
    def _graph(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        f, h = self.fused, self.handle
        inner = f.inner
        d, n_q, n_kv = f.head_dim, f.n_q, f.n_kv
        b = x.shape[0]
        dense = next((i for i, lin in enumerate(f.gate_up) if lin is not None), None)
        width = [len_of(f.qkv[0]), len_of(f.o[0])]
        width += [len_of(f.gate_up[dense]), len_of(f.down[dense])] if dense is not None else [0, 0]
        for i, layer in enumerate(inner.layers):
            qkv = torch.ops.tiller.packed_linear(_rms(layer.input_layernorm, x), h, 4 * i, width[0])
            qk = qkv[:, : (n_q + n_kv) * d].view(b, n_q + n_kv, d)
            if f.qk_norms[i]:  # Qwen3: RMSNorm over each query / key head
                q, k = qk.split([n_q, n_kv], dim=1)
                qk = torch.cat([_rms(f.qk_norms[i][0], q), _rms(f.qk_norms[i][1], k)], dim=1)
            q, k = f.rotate(qk, cos, sin).split([n_q, n_kv], dim=1)
            v = qkv[:, (n_q + n_kv) * d :].view(b, n_kv, d)
            o = torch.ops.tiller.decode_attention(q, k, v, h, i)
            o = torch.ops.tiller.packed_linear(o, h, 4 * i + 1, width[1])
            post = f.post_norms[i]  # GLM-4: a norm on each branch before its residual add
            x = x + (_rms(post[0], o) if post else o)
            if f.gate_up[i] is None:  # an experts layer
                mlp = torch.ops.tiller.experts(_rms(layer.post_attention_layernorm, x), h, i)
            else:
                gate, up = torch.ops.tiller.packed_linear(_rms(layer.post_attention_layernorm, x), h, 4 * i + 2,
                                                          width[2]).chunk(2, dim=-1)
                mlp = torch.ops.tiller.packed_linear(f.acts[i](gate) * up, h, 4 * i + 3, width[3])
            x = x + (_rms(post[1], mlp) if post else mlp)
        return torch.ops.tiller.packed_linear(_rms(inner.norm, x), h, 4 * len(inner.layers), len_of(f.head))

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """One decode step (the `FusedDecoder.step` contract): input_ids, position_ids [B, 1]. Returns [B, V]."""
        inner = self.fused.inner
        x = inner.embed_tokens(input_ids[:, 0])
        cos, sin = self.fused.rope_tables(*inner.rotary_emb(x[:1], position_ids))  # [B, 1, D]: over the heads
        self._mask, self._cache = mask, cache
        try:
            return self._fn(x, cos, sin)
        finally:
            self._mask = self._cache = None


def own_code(fn):
    """`fn` (a function or a bound method) running a copy of its code object. Dynamo keeps the graphs it compiles per
    code object, at most `recompile_limit` (8) of them, and a step compiled for another model or engine is one more
    graph of the same code: a process that compiled 8 engines' steps would fail on the ninth (a hard error under
    `fullgraph=True`). With a code object of its own, each compiled step has a cache of its own."""
    func = getattr(fn, "__func__", fn)
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                              func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    bound = getattr(fn, "__self__", None)
    return copy if bound is None else types.MethodType(copy, bound)


def len_of(lin: tuple) -> int:
    """Output width of a fused linear (weight, bias, packed)."""
    return lin[0].shape[0]


def _rms(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's Llama / Qwen2 RMSNorm forward, written out so Inductor fuses it (fp32 statistics, cast back)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)
