"""A static-shape decode step for the native engine, captured in CUDA graphs on a GPU (eager on a CPU).

Why: on a GPU the eager decode step of a 0.5B model is bound by Python and kernel launches, not by the device
(~950 launches and ~3 host syncs a step; the GPU busy 8% of the time, `shared/GPU.md`). Mature engines (vLLM,
SGLang, nano-vllm's `model_runner.py`, gpt-fast) capture the whole step once per batch-size bucket in a CUDA
graph and replay it: one launch a step. A graph replays fixed device addresses and shapes, so everything the
step touches lives in buffers allocated once and updated in place:

- the KV cache `[C, Hk, Lcap, D]` per layer (C = the largest bucket), one cache row per batch row;
- per batch row: the input token, its rotary position, the column it writes (`write`), its first live column
  (`start`: prompts are right-aligned), the output row it records to (`row_id`), its token counter, its `alive`
  flag and its sampling key;
- the outputs: sampled tokens and logprobs `[R + 1, T]`, each row's length `[R + 1]` (row R is the dummy).

One replay feeds each row's last token, writes its keys / values at `(row, write[row])`, attends over the
columns `[start, write]` of its own cache row (a bool mask built on the device from the two vectors, over the
first `Lb` columns: `Lb` is the live length rounded up to `kv_block`, so a step reads the live KV plus at most
one block, and each (bucket, Lb) pair is one graph, captured on first use), samples the next token, records it
and its logprob at `(row_id, counter)`, marks rows that drew a stop token (their length set on the device) and
advances the row's state. Nothing in the step syncs with the host: the host learns which rows are done through
a non-blocking copy of `alive` every `sync_every` steps, read `sync_every` steps later, and then compacts the
batch (live rows gathered to the front of every buffer, the cache included) into a smaller bucket.

Buckets are vLLM's capture sizes: 1, 2, 4, then multiples of 8 up to `max_num_seqs` (`rollout.cudagraph_capture_sizes`
overrides). A batch of `b` live rows runs at the smallest bucket >= b; the padding rows occupy cache rows past the
live ones (never read by a live row: attention is per row), record to the dummy output row R and are never alive.
A batch larger than every bucket runs the same step eagerly.

Sampling is per row and counter-based: row r's uniform for its token t is a hash of (the row's 32-bit key, t)
computed with integer ops on the device (`row_uniforms`), so it needs no generator state (graph-safe without
`register_generator_state`), is repeatable, and does not depend on which other rows share the batch or on the
bucket's padding. The filters and the draw are `tiller.rollout.sampling`'s (HF's warper order, CDF inversion).

Weight sync: the step reads the `FusedDecoder`'s fused weights and the model's own embedding / norm / rotary
tensors; `FusedDecoder.sync()` copies new weights into those same tensors (never new ones) when nothing is
prepacked, so a captured graph uses the synced weights without recapture.

Fewer kernels (`compile=True`, the default with CUDA graphs where Triton is installed): a graph removes the launch
cost, not the kernels; eagerly a layer is ~25 kernels (RMSNorm, rotary, residual adds and SiLU-times-up are several
1-4 us elementwise kernels each, `shared/GPU.md`). With `compile` each layer's body (norm, qkv matmul, rotary, the
cache write, attention, output matmul, residual, norm, gate-up, SiLU x up, down, residual) is one function compiled
by Inductor once for any batch and width (`dynamic=True`; the same code for every layer, its weights and cache
passed in), so the elementwise chains fuse into a few kernels around the matmuls and attention, and the graph
records those. A layer returns its MLP output unadded: the next layer adds it inside its first RMSNorm's kernel
(vLLM's fused add + RMSNorm), the last one's goes to the tail. On CUDA the step's edges are compiled too: its inputs
(`step_inputs`: the embedding, rotary cos / sin looked up in tables of every column, the attention mask: one kernel
on CPU for ~15 eager ops) and its tail (`tail_fn`: the last add with the final norm, the LM head, the sampler's
counter hash, filters and draw, and the bookkeeping: ~100 one-kernel ops eagerly, a few fused, the bookkeeping one
kernel writing the recorded tokens in place). A compile that fails warns once and that part runs eagerly
(`compile_error`).

On a CPU the same step runs eagerly (no capture); tests check it against the eager engine (greedy tokens equal,
logprobs close), that padding rows change nothing, and that seeded sampling is repeatable and batch-independent,
and the compiled layer (Inductor's C++ backend there) against the eager one.

Deviations from vLLM: no paged cache (one contiguous row per sequence, compacted as rows finish); stop strings
and partial-rollout weight hooks need the host every step, and penalties per-row token counts, so the engine keeps
its eager loop for those.

Letters: `b` batch rows (a bucket), `C` cache rows, `R` rows of the wave, `T` new tokens, `Lb` columns read.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tiller.errors import UserError
from tiller.models.compile import compile_failure
from tiller.protocol import to_device
from tiller.rollout import compiled_decode, triton_decode
from tiller.rollout.fused_decode import text_config
from tiller.rollout.sampling import draw_blocked, warp_logits

KV_BLOCK = 256
"""Columns a step reads beyond the live ones at most: the attention width is the live length rounded up to this."""

SYNC_EVERY = 8
"""Steps between the host's looks at which rows are done (each look is one step stale, so never a stall)."""

MAX_STOP_IDS = 16
"""Stop-token slots in the static stop buffer (more stop ids grow it and recapture)."""

_MASK32 = 0xFFFFFFFF

FLEX_BLOCK = 128
"""Columns per FlexAttention key block (`attention="flex"`): a row reads the blocks holding its live columns."""

ATTENTIONS = ("sdpa", "flex", "triton")
"""The static step's attention: SDPA over the first Lb columns under a mask, FlexAttention over each row's live
blocks (compiled step only), or tiller's Triton split-KV kernel over each row's live columns
(`tiller.rollout.triton_decode`; CUDA, or Triton's interpreter) (`rollout.engine_kwargs.static_attention`)."""


def capture_sizes(max_num_seqs: int, sizes: list[int] | None = None) -> list[int]:
    """The batch-size buckets: `sizes` when given (sorted, deduplicated), else vLLM's 1, 2, 4, 8, 16, ... up to
    `max_num_seqs` (itself included when it is not a multiple of 8).

    >>> capture_sizes(20)
    [1, 2, 4, 8, 16, 20]
    >>> capture_sizes(256, [64, 8, 8])
    [8, 64]
    """
    if sizes:
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
            raise UserError(f"rollout.cudagraph_capture_sizes: batch sizes must be positive integers, got {sizes}")
        return sorted({int(s) for s in sizes})
    out = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if out[-1] != max_num_seqs:
        out.append(max_num_seqs)
    return out


def bucket_for(rows: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding `rows`, or None when none does (the step then runs eagerly at `rows`)."""
    return next((s for s in sizes if s >= rows), None)


# ----------------------------------------------------------------------------------------- sampling
def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of 32-bit values held in int64 (every product stays below 2^63, so no overflow anywhere)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x297A2D39) & _MASK32
    return x ^ (x >> 15)


def row_keys(seed: int, rows: int) -> torch.Tensor:
    """The 32-bit sampling key of each of `rows` rows of a wave seeded `seed` (any int >= 0): [rows] int64 (CPU).
    Row r's key depends on the seed and r only."""
    base = _mix32(torch.tensor([seed & _MASK32, (seed >> 32) & _MASK32], dtype=torch.long))
    key = _mix32(base[0] ^ _mix32(base[1] ^ 0x5BD1E995))
    return _mix32(key ^ _mix32(torch.arange(rows, dtype=torch.long)))


def row_uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """keys [b], counters [b] int64 (>= 0) -> one uniform in [0, 1) per row, [b, 1] float64 (53 random bits from two
    32-bit hashes of (key, counter)). A pure function of its row's key and counter: batch-independent by design."""
    c = counters & _MASK32
    hi = _mix32(keys ^ _mix32(2 * c))
    lo = _mix32(keys ^ _mix32(2 * c + 1))
    bits = (hi << 21) | (lo >> 11)  # < 2^53
    return (bits.double() * (1.0 / 2 ** 53)).unsqueeze(-1)


@dataclass(frozen=True)
class Sampler:
    """The sampling parameters a graph is captured with (they are constants of the graph)."""

    do_sample: bool
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    @classmethod
    def of(cls, sampling) -> "Sampler":
        return cls(bool(sampling.do_sample), float(sampling.temperature), int(sampling.top_k), float(sampling.top_p),
                   float(sampling.min_p))

    def __call__(self, logits: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor):
        """logits [b, V] -> (tokens [b] long, logprobs [b] fp32); `sample_tokens`' math with per-row uniforms, the
        draw by blocks (`draw_blocked`: no [b, V] tensor written where compiled) and the logprob as score - logsumexp.
        """
        if self.do_sample:
            scores = warp_logits(logits, self.temperature, self.top_k, self.top_p, self.min_p)
        else:
            scores = logits.float()
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        tokens = (draw_blocked(scores, lse, row_uniforms(keys, counters)) if self.do_sample
                  else scores.argmax(dim=-1))
        return tokens, (scores.gather(-1, tokens.unsqueeze(-1)) - lse).squeeze(-1)


def _sample(sampler: Sampler, logits: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor):
    """`sampler(logits, keys, counters)` as a function Dynamo compiles (the sampler's fields are constants of the
    compiled graph: a new sampling setting compiles once more)."""
    return sampler(logits, keys, counters)


# ------------------------------------------------------------------------------ the compiled layer
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen2 / Llama RMSNorm (fp32 statistics, the weight applied in the input's dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def record_rows(tok, logp, counter, row_id, alive, stop, tokens, out_tokens, out_logp, lengths) -> None:
    """Record a step's sampled tokens / logprobs [b] at (row_id, counter) [b]; rows that drew a stop id end there
    (their length set, `alive` cleared); `tokens` [b] (the next step's inputs) becomes `tok`. In place, device only."""
    out_tokens[row_id, counter] = tok
    out_logp[row_id, counter] = logp
    hit = (tok[:, None] == stop[None, :]).any(-1) & alive
    lengths[row_id] = torch.where(hit, counter + 1, lengths[row_id])
    alive &= ~hit
    tokens.copy_(tok)


def step_inputs(tokens, positions, start, write, embed_w, cos_table, sin_table, columns, mask_dtype):
    """The step's inputs from its rows' state [b]: embeddings [b, E], rotary cos / sin [b, 1, D] looked up in tables
    made once per allocation (`GraphedDecoder._rope_tables`: the model's own rotary embedding at every column), and,
    with `mask_dtype`, the additive attention mask [b, 1, 1, len(columns)] (0 on each row's live columns [start, write],
    -inf elsewhere); None for the others' attention. Compiled on CUDA: ~15 one-kernel ops eagerly, a few fused."""
    x = F.embedding(tokens, embed_w)
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    if mask_dtype is None:
        return x, cos, sin, None
    live = (columns[None, :] >= start[:, None]) & (columns[None, :] <= write[:, None])
    return x, cos, sin, torch.zeros_like(live, dtype=mask_dtype).masked_fill(~live, float("-inf"))[:, None, None, :]


def tail_fn(eps: float):
    """The step after the last layer as one function (compiled on CUDA with the layers: eagerly ~25 one-kernel ops a
    step, plus the sampler's ~80): the last residual add with the final RMSNorm, the LM head, the row counters, the
    sampler (its settings constants of the compiled graph), `record_rows`, and the positions / write columns
    advanced; every state tensor [b] updated in place."""

    def tail(sampler, x, delta, norm_w, head_w, head_b, keys, counter, row_id, alive, stop, tokens, positions, write,
             out_tokens, out_logp, lengths):
        logits = F.linear(_rms(x + delta, norm_w, eps), head_w, head_b)
        counter += 1
        tok, logp = sampler(logits, keys, counter)
        record_rows(tok, logp, counter, row_id, alive, stop, tokens, out_tokens, out_logp, lengths)
        positions += 1
        write += 1

    return tail


def layer_step_fn(fused, attention: str = "sdpa"):
    """One decoder layer of the static step as a pure function of tensors (the weights and cache passed in), so a
    single compiled function serves every layer: (x [b, E], delta [b, E], cos / sin [b, 1, D], attn, rows [b],
    write [b], kc / vc [C, Hk, Lcap, D], then the layer's norm and linear weights) -> (x, delta) [b, E] each (the
    residual stream before and the MLP output to add: `layer_step`); writes the rows' keys / values
    at (rows, write) in kc / vc. `attn` is (mask [b, 1, 1, Lb],) for SDPA (every column < Lb read, masked), or
    (start [b], kv_blocks [b, 1, 1], kv_indices [b, 1, 1, Lb / FLEX_BLOCK]) for FlexAttention: each row reads
    only the 128-column blocks that hold its live columns [start, write] (the block lists are built once a step in
    `GraphedDecoder._forward_compiled`), or (start [b], columns [Lb]) for the Triton kernel (rows read their live
    columns [start, write] of the first Lb). (The SDPA mask is additive: 0 on live columns, -inf elsewhere.) None
    when the layers are not alike enough to share one function (different norm epsilons)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    from transformers.activations import ACT2FN

    d, n_q, n_kv, scaling = fused.head_dim, fused.n_q, fused.n_kv, fused.scaling
    group, qk_width = n_q // n_kv, (n_q + n_kv) * d
    layers = fused.inner.layers
    eps = {float(getattr(norm, "variance_epsilon", getattr(norm, "eps", -1.0)))
           for i, layer in enumerate(layers)
           for norm in (layer.input_layernorm, layer.post_attention_layernorm, *fused.qk_norms[i],
                        *fused.post_norms[i])}
    if len(eps) != 1 or min(eps) < 0:
        return None
    eps_value = eps.pop()
    act_name = getattr(text_config(fused.model), "hidden_act", None)
    # one activation object for every layer (a per-layer module would be a guard, hence a compile, per layer)
    act = F.silu if act_name == "silu" else (ACT2FN[act_name] if act_name else fused.acts[0])

    def attend(q, k, v, attn, write):
        b = q.shape[0]
        if attention == "sdpa":
            (mask,) = attn
            return F.scaled_dot_product_attention(q.reshape(b, n_kv, group, d), k, v, attn_mask=mask, scale=scaling)
        if attention == "triton":
            return torch.ops.tiller.decode_attention_live(q.reshape(b, n_kv, group, d), k, v, attn[0], write,
                                                          scaling)
        start, kv_blocks, kv_indices = attn

        def live(bi, h, qi, kv):
            return (kv >= start[bi]) & (kv <= write[bi])

        mask = BlockMask.from_kv_blocks(kv_blocks, kv_indices, BLOCK_SIZE=FLEX_BLOCK, mask_mod=live,
                                        seq_lengths=(1, k.shape[2]))
        # q its own [b, Hq, 1, D] buffer, not a view of the rotary output (Inductor's CPU flex template reads the
        # query's buffer layout as 4-D)
        q = q.unsqueeze(2).clone(memory_format=torch.contiguous_format)
        return flex_attention(q, k, v, block_mask=mask, scale=scaling, enable_gqa=group > 1)

    def layer_step(x, delta, cos, sin, attn, rows, write, kc, vc, ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w,
                   down_w, down_b, q_norm=None, k_norm=None, post_attn=None, post_mlp=None):
        """(delta: the previous layer's MLP output, added here, so the residual add and this layer's first norm are
        one kernel (vLLM's fused add + RMSNorm); zeros before the first layer. Returns (x, the MLP output), the add
        left to the next layer or the step's tail. q_norm, k_norm: Qwen3's per-head norm weights; post_attn,
        post_mlp: GLM-4's post norm weights; None where the layers have none. gate_up_w None: an experts layer,
        returned after attention's residual add (x only); its experts block runs after, as the model's module)"""
        x = x + delta
        b = x.shape[0]
        lb = attn[0].shape[-1] if attention == "sdpa" else (
            attn[1].shape[-1] if attention == "triton" else attn[2].shape[-1] * FLEX_BLOCK)
        qkv = F.linear(_rms(x, ln1, eps_value), qkv_w, qkv_b)
        qk = qkv[:, :qk_width].view(b, n_q + n_kv, d)
        if q_norm is not None:
            q, k = qk.split([n_q, n_kv], dim=1)
            qk = torch.cat([_rms(q, q_norm, eps_value), _rms(k, k_norm, eps_value)], dim=1)
        q, k = fused.rotate(qk, cos, sin).split([n_q, n_kv], dim=1)
        kc[rows, :, write] = k
        vc[rows, :, write] = qkv[:, qk_width:].view(b, n_kv, d)
        o = F.linear(attend(q, kc[:b, :, :lb], vc[:b, :, :lb], attn, write).reshape(b, n_q * d), o_w, o_b)
        x = x + (o if post_attn is None else _rms(o, post_attn, eps_value))
        if gate_up_w is None:
            return x
        gate, up = F.linear(_rms(x, ln2, eps_value), gate_up_w).chunk(2, dim=-1)
        mlp = F.linear(act(gate) * up, down_w, down_b)
        return x, (mlp if post_mlp is None else _rms(mlp, post_mlp, eps_value))

    def flex_layer_step(*args):
        return layer_step(*args)

    # each attention its own code object, so its compiles never meet the other's in Dynamo's per-code cache (after
    # an SDPA compile in the same process, Inductor's CPU flex template emitted C++ that did not compile)
    return flex_layer_step if attention == "flex" else layer_step


def uncapturable_experts(fused) -> str | None:
    """Why this model's decode step cannot be captured in a CUDA graph, or None. An experts layer runs as the
    model's module through transformers' `grouped_mm` experts, and torch's grouped matmul runs its own kernel for
    bfloat16 weights only: for other dtypes it loops over the experts with their offsets copied to the host, which a
    capture refuses (seen on an H200, torch 2.11: "Cannot copy between CPU and CUDA tensors during CUDA graph
    capture")."""
    for i, gate_up in enumerate(fused.gate_up):
        if gate_up is not None:
            continue
        stacked = [p for p in fused.inner.layers[i].mlp.parameters() if p.dim() == 3]
        if stacked and any(p.dtype != torch.bfloat16 for p in stacked):
            return (f"layer {i}'s experts are {stacked[0].dtype}: torch's grouped matmul syncs with the host for "
                    "experts not in bfloat16, so the decode step runs without CUDA graphs (rollout dtype bfloat16 "
                    "captures it)")
    return None


# --------------------------------------------------------------------------------------- the step
class GraphedDecoder:
    """The static buffers and the captured decode steps of one `FusedDecoder` (one model's weights).

    `capture`: record CUDA graphs (default: on CUDA); False runs the same static-shape step eagerly. `compile`:
    each layer's body compiled by Inductor (`layer_step_fn`; needs Triton on CUDA, a C++ compiler on CPU), its
    attention `attention` (one of ATTENTIONS; "flex" needs `compile`)."""

    def __init__(self, fused, sizes: list[int], kv_block: int = KV_BLOCK, sync_every: int = SYNC_EVERY,
                 capture: bool | None = None, compile: bool = False, attention: str = "sdpa",
                 compile_edges: bool | None = None):
        if attention not in ATTENTIONS or (attention == "flex" and not compile):
            raise UserError(f"static_attention={attention!r}: choose one of {list(ATTENTIONS)}; 'flex' runs "
                            "compiled only (rollout.enforce_eager=false / compile_decode=true)")
        device_type = next(fused.model.parameters()).device.type
        if attention == "triton" and not triton_decode.available(device_type):
            raise UserError("static_attention='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 to "
                            "run its interpreter on a CPU); use 'sdpa'")
        if attention == "flex" and kv_block % FLEX_BLOCK:
            raise ValueError(f"kv_block {kv_block} is not a multiple of FlexAttention's block {FLEX_BLOCK}")
        self.attention = attention
        self.fused = fused
        self.sizes = sizes
        self.kv_block = kv_block
        self.sync_every = max(1, sync_every)
        p = next(fused.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.capture = (self.device.type == "cuda") if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.cap = (0, 0, 0, 0)  # (cache rows C, columns Lcap, output rows R + 1, tokens T)
        self.stop = torch.empty(0, dtype=torch.long)
        self.replays = self.captures = self.eager_steps = 0  # counters (tests and the GPU check read them)
        self.capture_error: str | None = None
        self.compile_error: str | None = None
        if self.capture:
            self.capture_error = uncapturable_experts(fused)
            if self.capture_error is not None:  # the step runs eagerly (static shapes, no graphs); said once
                self.capture = False
                warnings.warn(f"tiller: {self.capture_error}", stacklevel=2)
        # `warm` every (bucket, KV width) of a wave before it starts: where capturing (then no wave stops to capture);
        # True elsewhere runs those steps eagerly (the tests check they leave the wave's rows unchanged)
        self.precapture = self.capture
        self._layer = None  # the compiled layer body, or None: the eager step
        # rotary cos / sin looked up per row in tables of every column (made in `_allocate`) where the model's
        # rotary embedding depends on the position alone (not dynamic / longrope, whose frequencies follow the
        # batch's longest position) and the embedding is a plain lookup: ~10 one-kernel ops a step fewer
        inner = fused.inner
        self.table_rope = (getattr(inner.rotary_emb, "rope_type", "default") not in ("dynamic", "longrope")
                           and type(inner.embed_tokens) is torch.nn.Embedding)
        self.cos_table = self.sin_table = None
        # with `compile` (the step's edges by default on CUDA only): its inputs (`step_inputs`) and its tail (final
        # norm, head, sampler, bookkeeping: `tail_fn`) compiled too, each a few fused kernels for ~120 one-kernel ops
        # eagerly (a 3-layer step on CPU: 111 of its 244 ops are the sampler's)
        self._inputs = self._tail = None
        if compile:
            body = layer_step_fn(fused, attention)
            if body is None:
                self.compile_error = "the layers' norms differ: no shared compiled layer"
            else:
                self._layer = torch.compile(compiled_decode.own_code(body), dynamic=True, fullgraph=True)
        if self._layer is not None and (self.device.type == "cuda" if compile_edges is None else compile_edges):
            if self.table_rope:
                self._inputs = torch.compile(compiled_decode.own_code(step_inputs), dynamic=True, fullgraph=True)
            if type(inner.norm) is type(inner.layers[0].input_layernorm):  # (the RMSNorm `_rms` writes out)
                eps = float(getattr(inner.norm, "variance_epsilon", getattr(inner.norm, "eps", 1e-6)))
                self._tail = torch.compile(compiled_decode.own_code(tail_fn(eps)), dynamic=True, fullgraph=True)

    # ------------------------------------------------------------------------------------- storage
    def _ensure(self, rows: int, cols: int, new_tokens: int, stop_ids: list[int]) -> None:
        """(Re)allocate the static buffers when this wave needs more than they hold (dropping every graph)."""
        bucket = bucket_for(rows, self.sizes) or rows
        c_rows, c_cols, c_out, c_t = self.cap
        n_stop = max(MAX_STOP_IDS, len(stop_ids))
        if bucket > c_rows or cols > c_cols or rows + 1 > c_out or new_tokens > c_t or n_stop > len(self.stop):
            c_rows, c_out = max(bucket, c_rows), max(rows + 1, c_out)
            c_cols = max(c_cols, -(-cols // self.kv_block) * self.kv_block)
            c_t = max(c_t, new_tokens)
            self._allocate(c_rows, c_cols, c_out, c_t, n_stop)
        self.stop.fill_(-1)
        if stop_ids:
            self.stop[: len(stop_ids)] = to_device(torch.tensor(sorted(stop_ids)), self.device)

    def _drop_graphs(self) -> None:
        """Forget every captured graph and their memory pool: the next capture starts a new pool. (Capturing into
        the old pool's id after its graphs are gone trips the CUDA allocator's `use_count > 0` assert when a
        tensor made during a capture still lives there, e.g. a replay's output kept by the caller.)"""
        self.graphs.clear()
        self._pool = None

    def _allocate(self, c_rows: int, c_cols: int, c_out: int, c_t: int, n_stop: int) -> None:
        self._drop_graphs()
        self.kc = self.vc = None
        f, dev = self.fused, self.device
        shape = (c_rows, f.n_kv, c_cols, f.head_dim)
        layers = len(f.inner.layers)
        # zeros: masked columns still enter the attention matmuls, and 0 * NaN garbage would be NaN
        self.kc = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(layers)]
        self.vc = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(layers)]
        long = dict(dtype=torch.long, device=dev)
        self.state = {name: torch.zeros(c_rows, **long)
                      for name in ("tokens", "positions", "write", "start", "row_id", "counter", "keys")}
        self.alive = torch.zeros(c_rows, dtype=torch.bool, device=dev)
        self.arange = torch.arange(c_rows, **long)
        self.columns = torch.arange(c_cols, **long)
        self.out_tokens = torch.zeros((c_out, c_t), **long)
        self.out_logp = torch.zeros((c_out, c_t), dtype=torch.float32, device=dev)
        self.lengths = torch.zeros(c_out, **long)
        self.stop = torch.full((n_stop,), -1, **long)
        self.zeros = torch.zeros((c_rows, text_config(f.model).hidden_size), dtype=self.dtype, device=dev)
        self.cap = (c_rows, c_cols, c_out, c_t)
        self._rope_tables()

    def _rope_tables(self) -> None:
        """cos / sin [Lcap, D] of every column as a position, from the model's rotary embedding (what the step
        would compute for those positions: its output is elementwise in the position), when `table_rope`."""
        if not self.table_rope:
            return
        f = self.fused
        with torch.no_grad():
            x = f.inner.embed_tokens(self.columns[:1])
            cos, sin = f.rope_tables(*f.inner.rotary_emb(x, self.columns[:, None]))
        if cos.shape[0] != len(self.columns) or cos.dim() != 3:  # (a rotary embedding of another layout: per step)
            self.table_rope = False
            return
        self.cos_table, self.sin_table = cos[:, 0], sin[:, 0]

    # ---------------------------------------------------------------------------------- the step body
    def _forward(self, b: int, lb: int) -> torch.Tensor:
        """Rows [:b]: feed their tokens, write their keys / values, attend over columns [:lb]; logits [b, V]."""
        x, delta = self._hidden(b, lb)
        f = self.fused
        return f._apply(f._norm(f.inner.norm, x + delta), f.head)

    def _hidden(self, b: int, lb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers on rows [:b] (their keys / values written, columns [:lb] read): (x, delta) [b, E],
        the residual stream before the last MLP output and that output (the final norm's input is their sum)."""
        if self._layer is not None:
            try:
                return self._hidden_compiled(b, lb)
            except Exception as err:  # Inductor could not compile (or run) the layer here: eager from now on
                # (re-running the step is safe: its cache writes are the same values at the same columns)
                self._layer, self._inputs, self.compile_error = None, None, compile_failure(err)
                warnings.warn(f"tiller: compiling the decode step's layer failed ({self.compile_error}); the step "
                              "runs eagerly", stacklevel=4)
        f, s = self.fused, self.state
        inner = f.inner
        d, n_q, n_kv = f.head_dim, f.n_q, f.n_kv
        write, rows = s["write"][:b], self.arange[:b]
        if self.attention == "triton":  # each row's live columns [start, write]
            start = s["start"][:b]

            def attend(q, k, v):
                return triton_decode.decode_attention_live(q, k, v, start, write, f.scaling)
        else:  # the first lb columns, masked to each row's live ones
            cols = self.columns[:lb]
            mask = ((cols[None, :] >= s["start"][:b, None]) & (cols[None, :] <= write[:, None]))[:, None, None, :]

            def attend(q, k, v):
                return f.decode_attention(q, k, v, mask)
        x, cos, sin = self._embed(b)
        delta = None
        for i, layer in enumerate(inner.layers):
            if delta is not None:
                x = x + delta
            qkv = f._apply(f._norm(layer.input_layernorm, x), f.qkv[i])
            qk = qkv[:, : (n_q + n_kv) * d].view(b, n_q + n_kv, d)
            if f.qk_norms[i]:  # Qwen3: RMSNorm over each query / key head
                qk = f.norm_heads(qk, i)
            q, k = f.rotate(qk, cos, sin).split([n_q, n_kv], dim=1)
            v = qkv[:, (n_q + n_kv) * d :].view(b, n_kv, d)
            self.kc[i][rows, :, write] = k
            self.vc[i][rows, :, write] = v
            o = attend(q.reshape(b, n_kv, n_q // n_kv, d), self.kc[i][:b, :, :lb], self.vc[i][:b, :, :lb])
            x = f.add_branch(x, f._apply(o.reshape(b, n_q * d), f.o[i]), i, 0)
            delta = self._mlp_branch(x, i)
        return x, delta

    def _embed(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows [:b]'s input embeddings [b, E] and rotary cos / sin [b, 1, D] (from the tables where `table_rope`)."""
        f, s = self.fused, self.state
        x = f.inner.embed_tokens(s["tokens"][:b])
        if self.cos_table is not None:
            positions = s["positions"][:b]
            return x, self.cos_table[positions].unsqueeze(1), self.sin_table[positions].unsqueeze(1)
        return (x, *f.rope_tables(*f.inner.rotary_emb(x[:1], s["positions"][:b, None])))  # [b, 1, D]: over heads

    def _mlp_branch(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Layer i's MLP (or experts block) output on the residual stream x, post-normed where the layer has post
        norms (GLM-4): what its residual add adds."""
        f = self.fused
        out = f.mlp(f._norm(f.inner.layers[i].post_attention_layernorm, x), i)
        post = f.post_norms[i]
        return f._norm(post[1], out) if post else out

    def _hidden_compiled(self, b: int, lb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`_hidden` with each layer's body in the compiled `layer_step_fn` (unpacked weights: Inductor traces
        plain tensors; on CUDA they are the only ones) and its inputs in the compiled `step_inputs` (CUDA)."""
        f, s = self.fused, self.state
        inner = f.inner
        write, rows, start = s["write"][:b], self.arange[:b], s["start"][:b]
        attn = None
        if self._inputs is not None and self.cos_table is not None:
            x, cos, sin, mask = self._inputs(s["tokens"][:b], s["positions"][:b], start, write,
                                             inner.embed_tokens.weight, self.cos_table, self.sin_table,
                                             self.columns[:lb], self.dtype if self.attention == "sdpa" else None)
            attn = None if mask is None else (mask,)
        else:
            x, cos, sin = self._embed(b)
        if self.attention == "flex":  # each row's live blocks: first .. last, then repeats of the last (unread)
            first, last, nb = start // FLEX_BLOCK, write // FLEX_BLOCK, lb // FLEX_BLOCK
            blocks = torch.minimum(first[:, None] + self.columns[:nb][None, :], last[:, None])
            attn = (start, (last - first + 1).to(torch.int32)[:, None, None], blocks.to(torch.int32)[:, None, None, :])
        elif self.attention == "triton":
            attn = (start, self.columns[:lb])
        elif attn is None:  # an additive mask in the cache's dtype, made once a step (a bool mask: SDPA converts it
            cols = self.columns[:lb]  # in every layer)
            live = (cols[None, :] >= start[:, None]) & (cols[None, :] <= write[:, None])
            attn = (torch.zeros(live.shape, dtype=self.dtype, device=self.device).masked_fill_(~live, float("-inf"))
                    [:, None, None, :],)
        delta = self.zeros[:b]
        for i, layer in enumerate(inner.layers):
            extra = [n.weight for n in f.qk_norms[i]] or [None, None]
            extra += [n.weight for n in f.post_norms[i]] or [None, None]
            dense = f.gate_up[i] is not None  # else an experts layer: its block runs as the model's module
            out = self._layer(x, delta, cos, sin, attn, rows, write, self.kc[i], self.vc[i],
                              layer.input_layernorm.weight, f.qkv[i][0], f.qkv[i][1], f.o[i][0], f.o[i][1],
                              layer.post_attention_layernorm.weight,
                              *(f.gate_up[i][0], f.down[i][0], f.down[i][1]) if dense else (None, None, None), *extra)
            x, delta = out if dense else (out, self._mlp_branch(out, i))
        return x, delta

    def _record(self, b: int, tokens: torch.Tensor, logp: torch.Tensor) -> None:
        """Record rows [:b]'s sampled tokens at their counters; stop rows that drew a stop token (device only)."""
        s = self.state
        record_rows(tokens, logp, s["counter"][:b], s["row_id"][:b], self.alive[:b], self.stop, s["tokens"][:b],
                    self.out_tokens, self.out_logp, self.lengths)

    def _step(self, b: int, lb: int, sampler: Sampler) -> None:
        """One decode step of rows [:b], everything in place in the static buffers (what a graph records)."""
        s = self.state
        x, delta = self._hidden(b, lb)
        f = self.fused
        if self._tail is not None:
            try:
                self._tail(sampler, x, delta, f.inner.norm.weight, f.head[0], f.head[1], s["keys"][:b],
                           s["counter"][:b], s["row_id"][:b], self.alive[:b], self.stop, s["tokens"][:b],
                           s["positions"][:b], s["write"][:b], self.out_tokens, self.out_logp, self.lengths)
                return
            except Exception as err:  # (it failed before changing any state: the tail runs eagerly below)
                self._tail = None
                warnings.warn(f"tiller: compiling the decode step's tail (norm, head, sampler) failed "
                              f"({compile_failure(err)}); it runs eagerly", stacklevel=3)
        logits = f._apply(f._norm(f.inner.norm, x + delta), f.head)
        s["counter"][:b] += 1
        self._record(b, *sampler(logits, s["keys"][:b], s["counter"][:b]))
        s["positions"][:b] += 1
        s["write"][:b] += 1

    def run_step(self, b: int, lb: int, sampler: Sampler) -> None:
        """One decode step of rows [:b] over columns [:lb] (`_run`)."""
        self._run((b, lb, sampler), b, lambda: self._step(b, lb, sampler))

    def _run(self, key: tuple, b: int, body) -> None:
        """Replay the graph of `key`, capturing `body` on first use; eager when not capturing or b is no bucket.
        The first use runs the body eagerly on a side stream (the warm-up torch.cuda.graph needs), which is this
        step's real work; capture records without running."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return
        if not self.capture or b not in self.sizes:
            body()
            self.eager_steps += 1
            return
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.eager_steps += 1
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                body()
        except Exception as err:  # an op that cannot be captured here: keep decoding eagerly, say so once
            self.capture, self.capture_error = False, compile_failure(err)
            warnings.warn(f"tiller: capturing the decode step in a CUDA graph failed ({self.capture_error}); "
                          "decoding eagerly", stacklevel=2)
            return
        if self._pool is None:  # one memory pool for every graph: each keeps nothing alive in it past its replay
            self._pool = graph.pool()  # (all its results go to the static buffers), and they never run concurrently
        self.graphs[key] = graph
        self.captures += 1

    # ------------------------------------------------------------------------- capturing ahead of a wave
    def wave_keys(self, rows: int, width: int, new_tokens: int) -> list[tuple[int, int]]:
        """Every (bucket, KV width) a wave of `rows` rows, prompts right-aligned at `width` columns, can step at while
        it decodes `new_tokens` tokens: each bucket up to its rows' (compaction moves the rows down the buckets), each
        KV width (`decode`'s `lb`) from its first step's to its last's. Within the allocated buffers (`_ensure`)."""
        if new_tokens < 2:  # (token 0 comes from the prefill: no decode step)
            return []
        top = bucket_for(rows, self.sizes) or rows
        widths = sorted({min(self.cap[1], -(-(width + t) // self.kv_block) * self.kv_block)
                         for t in (1, new_tokens - 1)})
        widths = list(range(widths[0], widths[-1] + 1, self.kv_block))
        return [(b, lb) for b in self.sizes if b <= top and b <= self.cap[0] for lb in widths]

    def warm(self, keys: list[tuple[int, int]], sampler: Sampler) -> int:
        """Run one step of each (bucket, KV width) in `keys` not yet captured for `sampler` (on CUDA: capture its
        graph; elsewhere: the step eagerly), on padding rows: their writes go to cache column 0 and the dummy output
        row, so this runs before a wave's prefill (which, with `start_wave`, writes and resets all a wave reads).
        vLLM captures every size at start-up for the same reason: a wave never stops to capture. Returns the steps
        run."""
        todo = [(b, lb) for b, lb in keys if (b, lb, sampler) not in self.graphs]
        capturing = self.capture
        for i, (b, lb) in enumerate(todo):
            if capturing and not self.capture:  # a capture failed (said once): the wave decodes eagerly
                return i
            self._pad_rows(0)  # (each step from a fresh state: counters stay inside the output buffer)
            self.run_step(b, lb, sampler)
        return len(todo)

    # ----------------------------------------------------------------------------- host bookkeeping
    def _pad_rows(self, live: int) -> None:
        """Rows [live:] become padding: never alive, recording to the dummy output row, writing column 0."""
        s = self.state
        for name in ("tokens", "positions", "write", "start", "counter", "keys"):
            s[name][live:] = 0
        s["row_id"][live:] = self.cap[2] - 1
        self.alive[live:] = False

    def _compact(self, keep: torch.Tensor, upto: int) -> None:
        """Gather batch rows `keep` [b'] (device long) to the front of every buffer; cache columns < `upto`."""
        nb = len(keep)
        for buf in (*self.state.values(), self.alive):
            buf[:nb] = buf[keep]
        for caches in (self.kc, self.vc):
            for c in caches:
                c[:nb, :, :upto] = c[keep, :, :upto]
        self._pad_rows(nb)

    def start_wave(self, first_logits: torch.Tensor, prompt_len: torch.Tensor, width: int, seed: int,
                   sampler: Sampler) -> None:
        """Rows [:R] after the prefill (keys / values at right-aligned columns [width - len, width)): sample
        token 0 from `first_logits` [R, V] and set every row's state. `prompt_len` [R] long on the device."""
        rows = first_logits.shape[0]
        s = self.state
        self._pad_rows(0)
        self.lengths.fill_(self.cap[3])
        s["keys"][:rows] = to_device(row_keys(seed, rows), self.device)
        s["row_id"][:rows] = self.arange[:rows]
        s["positions"][:rows] = prompt_len
        s["start"][:rows] = width - prompt_len
        s["write"][:rows] = width
        self.alive[:rows] = True
        self._record(rows, *sampler(first_logits, s["keys"][:rows], s["counter"][:rows]))

    def decode(self, rows: int, width: int, new_tokens: int, sampler: Sampler, compact_fraction: float) -> None:
        """Decode tokens 1 .. new_tokens - 1 of the wave set up by `start_wave`, compacting finished rows away."""
        live = rows
        pending: tuple[torch.Tensor, object] | None = None
        host_alive = torch.empty(self.cap[0], dtype=torch.bool, pin_memory=self.device.type == "cuda")
        for t in range(1, new_tokens):
            if (t - 1) % self.sync_every == 0:
                if pending is not None:
                    count, event = pending
                    if event is not None:
                        event.synchronize()
                    alive = host_alive[:count]
                    n_alive = int(alive.sum())
                    if n_alive == 0:
                        return
                    if count - n_alive >= max(1, compact_fraction * count):
                        keep = alive.nonzero().squeeze(-1)
                        self._compact(to_device(keep, self.device), width + t - 1)
                        live = n_alive
                host_alive[:live].copy_(self.alive[:live], non_blocking=True)
                event = None
                if self.device.type == "cuda":
                    event = torch.cuda.Event()
                    event.record()
                pending = (live, event)
            b = bucket_for(live, self.sizes) or live
            lb = min(self.cap[1], -(-(width + t) // self.kv_block) * self.kv_block)  # token t-1 writes width+t-1
            self.run_step(b, lb, sampler)

    def results(self, rows: int, new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
        """Each row's tokens and logprobs, cut at its length (one device-to-host copy: float64 holds both exactly)."""
        both = torch.cat([self.out_tokens[:rows, :new_tokens].double(), self.out_logp[:rows, :new_tokens].double(),
                          self.lengths[:rows, None].clamp_max(new_tokens).double()], dim=1).cpu()
        tokens = both[:, :new_tokens].long().tolist()
        logp = both[:, new_tokens: 2 * new_tokens].float().tolist()
        lengths = both[:, -1].long().tolist()
        return [t[:n] for t, n in zip(tokens, lengths)], [lp[:n] for lp, n in zip(logp, lengths)]



class SlotStep(GraphedDecoder):
    """The continuous batcher's decode forward (`tiller.rollout.continuous`) on the same static step: the cache is
    the batcher's slot cache (its tensors, bound while they stay the same: a slot cache that grows drops the
    graphs), each step feeds the live rows' last tokens, positions and columns and returns their logits; sampling,
    stop strings, grammars and admission stay with the batcher on the host, between replays. Live rows are slots
    [0, live) (the batcher keeps them at the front); a bucket's padding rows are free slots, writing column 0 of
    their own cache rows, which an admitted row's prefill overwrites before it is read."""

    def bind(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Use these cache tensors ([S, Hk, L, D] per layer); new tensors (a grown cache) drop every graph."""
        ident = tuple((k.data_ptr(), v.data_ptr(), k.shape) for k, v in zip(keys, values))
        if getattr(self, "_bound", None) == ident:
            return
        self._drop_graphs()
        slots, cols = keys[0].shape[0], keys[0].shape[2]
        self.kc, self.vc = list(keys), list(values)
        long = dict(dtype=torch.long, device=self.device)
        self.state = {name: torch.zeros(slots, **long) for name in ("tokens", "positions", "write", "start")}
        self.arange = torch.arange(slots, **long)
        self.columns = torch.arange(cols, **long)
        self.zeros = torch.zeros((slots, text_config(self.fused.model).hidden_size), dtype=self.dtype,
                                 device=self.device)
        self.cos_table = self.sin_table = None  # (a served row's position may pass its column: rope per step)
        self.logits = None
        self._bound = ident

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                key_len: int) -> torch.Tensor:
        """tokens / positions / start / end [live] long on the device (end: the column each row writes); key_len:
        max(end) + 1 (the batcher knows it without a sync). Returns the live rows' logits [live, V]."""
        live, slots, cols = len(tokens), len(self.arange), len(self.columns)
        b = bucket_for(live, self.sizes) or live
        if b > slots:
            b = live
        s = self.state
        for name, value in (("tokens", tokens), ("positions", positions), ("start", start), ("write", end)):
            s[name][:live] = value
            s[name][live:b] = 0
        lb = min(cols, -(-key_len // self.kv_block) * self.kv_block)
        if self.logits is None:
            self.logits = torch.empty((slots, self.fused.head[0].shape[0]), dtype=self.dtype, device=self.device)
        self._run((b, lb), b, lambda: self.logits[:b].copy_(self._forward(b, lb)))
        return self.logits[:live]


# ------------------------------------------------------------------------------------- the engine's use
def native_decode_options(enforce_eager: bool | None, device_type: str,
                          sizes: list[int] | None = None) -> dict:
    """The native engine's decode options for verl's `rollout.enforce_eager` on `device_type`: on CUDA, null (the
    default) or False captures the static-shape step in CUDA graphs, each layer's body compiled by Inductor where
    Triton is installed (vLLM's default: compile, then capture; `scripts/gpu_check.py`'s graphed_decode and continuous
    checks pass on an H200, docs/gpu.md), True decodes eagerly; on a CPU, False compiles the fused step with Inductor
    (`tiller.rollout.compiled_decode`, ~10-30 s of compiling, so not the default), null or True decodes eagerly.
    `sizes` is `rollout.cudagraph_capture_sizes`.

    >>> native_decode_options(None, "cuda") == native_decode_options(False, "cuda")
    True
    >>> native_decode_options(True, "cuda"), native_decode_options(False, "cpu"), native_decode_options(None, "cpu")
    ({}, {'compile_decode': True}, {})
    """
    if device_type == "cuda":
        if enforce_eager:
            return {}
        return {"static_decode": True, "cuda_graphs": True, "capture_sizes": sizes,
                "compile_decode": compiled_decode.available("cuda")}
    return {"compile_decode": True} if enforce_eager is False else {}


def decoder_for(engine, model) -> GraphedDecoder | None:
    """The engine's static-shape decoder for `model` (kept across calls: its graphs and buffers are reused), or
    None where it does not apply (static decode off, no fused decoder for this model)."""
    fused = engine._fused
    if not engine.static_decode or fused is None or fused.model is not model:
        return None
    graphed = getattr(engine, "_graphed", None)
    if graphed is None or graphed.fused is not fused:
        graphed = GraphedDecoder(fused, capture_sizes(engine.max_num_seqs, engine.capture_sizes),
                                 capture=engine.cuda_graphs, compile=engine.compile_decode,
                                 attention=engine.static_attention)
        engine._graphed = graphed
    return graphed


def generate_wave(engine, graphed: GraphedDecoder, model, prompts: list[list[int]], sampling, stop_ids,
                  generator: torch.Generator, pad_id: int, make_cache):
    """The native engine's `_generate_wave` on the static-shape step: (tokens, logprobs, versions) per row.
    `make_cache(rows, columns, device)` is the engine's cache class (its prefill writes through that contract)."""

    n, new_tokens = sampling.n, sampling.max_new_tokens
    rows, width = len(prompts) * n, max(len(p) for p in prompts)
    graphed._ensure(rows, width + new_tokens, new_tokens, sorted(stop_ids))
    sampler = Sampler.of(sampling)
    if graphed.precapture:  # every graph this wave can replay, captured before it starts (and before its prefill)
        graphed.warm(graphed.wave_keys(rows, width, new_tokens), sampler)
    cache = make_cache(rows, graphed.cap[1], graphed.device)
    cache.keys, cache.values = list(graphed.kc), list(graphed.vc)
    first_logits = engine._prefill(model, prompts, cache, width, n, pad_id)
    # the wave's seed: one draw from the call's generator, so waves differ and a seeded call repeats
    seed = int(torch.randint(2 ** 62, (1,), generator=generator, device=generator.device))
    prompt_len = to_device(torch.tensor([len(p) for p in prompts]), graphed.device).repeat_interleave(n)
    graphed.start_wave(first_logits, prompt_len, width, seed, sampler)
    graphed.decode(rows, width, new_tokens, sampler, engine.compact_fraction)
    tokens, logprobs = graphed.results(rows, new_tokens)
    return tokens, logprobs, [[] for _ in range(rows)]
