"""`native` rollout engine: tiller's batched sampler for Hugging Face causal LMs (Qwen2, Llama, ...).

What it does, per call (Kwon et al. 2023 "PagedAttention" and nanochat's engine are the models; this is
the single-device, no-paging version):

1. Prefill each prompt once, in left-padded chunks of similar lengths (shortest first), or packed end to end
   without padding where torch's varlen attention kernel runs them (`packed_prefill`; a GPU's default), and write
   its keys / values into a preallocated cache *n times* (the n samples of a prompt share its prefill; only the
   first token's logits are kept).
2. Decode all rows together, one token per step: the HF module's own forward runs with our `KVBuffer`
   as `past_key_values` (keys / values written in place, attention over the filled prefix only), an
   explicit 4D padding mask and explicit position ids, and `logits_to_keep=1`. For Llama / Qwen2 the
   decode step instead runs `FusedDecoder` (same modules, q/k/v and gate/up fused into one matmul each).
3. Sample on the device (`tiller.rollout.sampling`: penalties, then temperature, top-k, top-p, min-p in HF's
   order) with a seeded `torch.Generator`, and keep the sampled token's logprob. With penalties each row's prompt
   tokens and response counts ride along as [B, V] tensors (`PenaltyState`), and the call decodes eagerly (the
   static / CUDA-graph step keeps no counts). With `SamplingParams.regex` each row has an llguidance matcher
   (`tiller.rollout.constrained.GrammarRows`): forbidden tokens are masked after the penalties, eos is allowed once
   the text matches (and ends the row, ignore_eos or not); that call decodes eagerly too.
4. Rows that hit a stop token or stop string (watched incrementally on a window of decoded text) leave:
   once enough rows are done the batch and its cache are compacted, so work tracks live rows.

Layout: all rows share one write position. Prompts are right-aligned at column `P` (the longest prompt);
response token t sits at column `P + t` for every row; a row's columns before `P - len(prompt)` are
masked. Position ids are `len(prompt) + t`, as HF's `generate` computes them from the attention mask, so
greedy output equals `model.generate`'s token for token.

bf16: `dtype="bfloat16"` runs a bf16 copy of the weights (refreshed by `update_weights()`), which measured
faster than autocast on CPU (autocast re-casts every weight at every step). Logits are cast to fp32
before sampling.

Image prompts (Qwen2-VL / Qwen2.5-VL / Qwen3-VL, `multi_modal=[{"pixel_values", "image_grid_thw"} | None]` per
prompt, as the hf engine): the vision tower runs once per prompt in the prefill, which runs the model's own forward
with the image outputs and M-RoPE positions; decode positions continue from each prompt's largest position + 1; the
vision special tokens are never sampled; decode runs the fused (or compiled) step for Qwen2-VL / Qwen3-VL, not the
CUDA-graph one.
See `tiller.rollout.images`.

Deviations: no paged / prefix cache across calls; rows are grouped in waves of `max_num_seqs` rather than
refilled continuously; only `sdpa` and `eager` attention implementations are driven.

Letters: `B` live rows, `H` kv heads, `L` cache columns, `D` head dim, `V` vocabulary.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from tiller.errors import UserError
from tiller.models.loading import cache_keyword
from tiller.models import routing
from tiller.models.layer_masks import layout_of, to_attention_mask
from tiller.protocol import to_device
from tiller.rollout.base import (
    RolloutOutput,
    SamplingParams,
    StopStringWatcher,
    InProcessEngine,
    check_prompts,
    eval_mode,
    finalize_row,
    pad_token_id,
    stop_ids_for,
)
from tiller.models import varlen
from tiller.rollout import compiled_decode, graphed_decode, triton_decode
from tiller.rollout.images import ImagePrompts, check_multi_modal, next_positions, suppress_vision_tokens
from tiller.rollout.images import vision_ids_tensor, vision_token_ids
from tiller.rollout.fused_decode import FusedDecoder
from tiller.rollout.fused_decode import supports as supports_fused
from tiller.rollout.sampling import PenaltyState, sample_tokens


MAX_WASTE = 0.125
"""Default padding share of a prefill chunk (`prefill_chunks`); `PREFILL_WASTE` overrides it by device."""


def prefill_chunks(lengths: list[int], token_budget: int, max_waste: float = MAX_WASTE) -> list[list[int]]:
    """Group prompt indices into prefill chunks: shortest first; a chunk grows while its padded size
    (count x longest) stays within `token_budget` and its padding within `max_waste` of that size.

    >>> prefill_chunks([30, 10, 11, 29, 12], 4096)
    [[1, 2, 4], [3, 0]]
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    chunks: list[list[int]] = []
    chunk: list[int] = []
    real = 0
    for i in order:
        padded = lengths[i] * (len(chunk) + 1)  # sorted: the newcomer is the longest
        if chunk and (padded > token_budget or padded - real - lengths[i] > max_waste * padded):
            chunks.append(chunk)
            chunk, real = [], 0
        chunk.append(i)
        real += lengths[i]
    if chunk:
        chunks.append(chunk)
    return chunks


PREFILL_WASTE = {"cpu": 0.03}
"""Padding a prefill chunk may carry, by device (else `MAX_WASTE`): on a CPU a chunk's cost is its matmuls' FLOPs, padding
included, and a chunk more costs little (64 prompts of 16-48 tokens: 10% padding in 5 chunks at 0.125, 1.6% in 16
at 0.03, 6% less prefill time at 30M fp32); on a GPU each chunk is more launches and the FLOPs are cheap."""


def prefill_inputs(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts left-padded to their longest: (ids [c, w], position ids [c, w], attention mask [c, w, w] bool:
    causal over each prompt's own tokens; a pad query sees itself, so no softmax row is empty)."""
    c, w = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((c, w), pad_id, dtype=torch.long)
    valid_k = torch.zeros((c, w), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, w - len(p) :] = torch.tensor(p)
        valid_k[i, w - len(p) :] = True
    ids, valid_k = to_device(ids, device), to_device(valid_k, device)  # (no stream sync)
    pos = (valid_k.long().cumsum(-1) - 1).clamp_min(0)
    causal = torch.ones((w, w), dtype=torch.bool, device=device).tril()
    eye = torch.eye(w, dtype=torch.bool, device=device)
    return ids, pos, (causal[None] & valid_k[:, None, :]) | eye[None]


def packed_chunks(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group prompt indices, in order, into packed prefill chunks of at most `token_budget` tokens (a longer prompt
    is a chunk of its own).

    >>> packed_chunks([30, 10, 11, 29, 12], 60)
    [[0, 1, 2], [3, 4]]
    """
    chunks: list[list[int]] = []
    total = 0
    for i, n in enumerate(lengths):
        if not chunks or total + n > token_budget:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += n
    return chunks


def packed_prefill_inputs(prompts: list[list[int]], width: int, n: int, device):
    """Prompts end to end for `FusedDecoder.forward_packed`, their cache rows being those of prompt indices
    `0 .. len(prompts) - 1` with `n` samples each, right-aligned at `width` columns: (ids [N], positions [N], cu
    [c + 1] int32, (rows, columns, source tokens) [N x n] of each key / value, on `device`; lengths on the host)."""
    lengths = [len(p) for p in prompts]
    counts = torch.tensor(lengths)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    positions = torch.cat([torch.arange(k) for k in lengths])
    cu = torch.zeros(len(prompts) + 1, dtype=torch.int32)
    cu[1:] = counts.cumsum(0)
    prompt = torch.arange(len(prompts)).repeat_interleave(counts)  # [N]: each token's prompt
    rows = (prompt[:, None] * n + torch.arange(n)[None]).reshape(-1)
    cols = (width - counts[prompt] + positions).repeat_interleave(n)
    src = torch.arange(len(ids)).repeat_interleave(n)
    ids, positions, cu, rows, cols, src = (to_device(t, device) for t in (ids, positions, cu, rows, cols, src))
    return ids, positions, lengths, cu, (rows, cols, src)


class KVBuffer:
    """A preallocated key / value cache that HF attention layers write into through `update()`.

    Buffers are [B, H, L, D] per layer, allocated lazily at the first write (so head counts and dims come
    from the model itself). `write_pos` is the column the current forward writes at; `update` returns
    the filled prefix `[:, :, :write_pos + q]`. In prefill mode (`prefill_rows` set), the chunk's keys are
    copied into rows `prefill_rows` (a LongTensor; each chunk row repeated `repeat` times) at columns
    `prefill_cols`, and attention runs over the chunk's own keys.
    """

    is_compileable = False

    def __init__(self, batch: int, max_len: int, device: torch.device):
        self.batch, self.max_len, self.device = batch, max_len, device
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self.write_pos = 0
        self.prefill_rows: torch.Tensor | None = None
        self.prefill_cols: slice | None = None
        self.repeat = 1
        self.packed_dest: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # `write_packed`'s cells

    def _alloc(self, layer: int, like: torch.Tensor) -> None:
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        shape = (self.batch, like.shape[1], self.max_len, like.shape[3])
        # zeros, not empty: masked columns still enter the attention matmuls, and 0 * NaN garbage is NaN
        self.keys[layer] = torch.zeros(shape, dtype=like.dtype, device=self.device)
        self.values[layer] = torch.zeros(shape, dtype=like.dtype, device=self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states / value_states [B, H, q, D] -> the keys / values attention should use."""
        if layer_idx >= len(self.keys) or self.keys[layer_idx] is None:
            self._alloc(layer_idx, key_states)
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        if self.prefill_rows is not None:
            k, v = key_states, value_states
            if self.repeat > 1:
                k, v = k.repeat_interleave(self.repeat, dim=0), v.repeat_interleave(self.repeat, dim=0)
            k_buf[self.prefill_rows, :, self.prefill_cols] = k
            v_buf[self.prefill_rows, :, self.prefill_cols] = v
            return key_states, value_states
        end = self.write_pos + key_states.shape[2]
        k_buf[:, :, self.write_pos : end] = key_states
        v_buf[:, :, self.write_pos : end] = value_states
        return k_buf[:, :, :end], v_buf[:, :, :end]

    def write_packed(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        """A packed prefill's keys / values [N, H, D] (`FusedDecoder.forward_packed`) into the cells `packed_dest`
        names: (rows [M], columns [M], source tokens [M]), M = N x the samples per prompt."""
        if layer_idx >= len(self.keys) or self.keys[layer_idx] is None:
            self._alloc(layer_idx, key_states.transpose(0, 1)[None])
        rows, cols, src = self.packed_dest
        self.keys[layer_idx][rows, :, cols] = key_states[src]
        self.values[layer_idx][rows, :, cols] = value_states[src]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.write_pos

    # Recurrent layers (Gated DeltaNet, Mamba, short convolutions: `tiller.models.layer_masks`) keep a state per
    # row instead of keys: transformers' linear-attention cache API (`Cache.get_conv_state` ...). A prefill chunk
    # starts from no state (its prompts are new) and its final states land in its rows (repeated n times); a
    # one-token step reads the rows' states and the layer updates them (the conv state in place).

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """Intermediate recurrent states a layer should also return (transformers >= 5.25, for rolling back draft
        tokens): none, nothing here is rolled back."""
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """A layer updated its conv state in place for one token (transformers >= 5.25 counts tokens per linear
        layer); the lengths here are `write_pos`, kept by the engine."""

    def _state(self, kind: str, layer_idx: int, state_idx: int):
        if self.prefill_rows is not None:
            return None
        return self.__dict__.get("states", {}).get((kind, layer_idx, state_idx))

    def _store(self, kind: str, layer_idx: int, state_idx: int, state: torch.Tensor) -> torch.Tensor:
        states = self.__dict__.setdefault("states", {})
        key = (kind, layer_idx, state_idx)
        if self.prefill_rows is None:
            states[key] = state
            return state
        if key not in states:
            states[key] = torch.zeros((self.batch, *state.shape[1:]), dtype=state.dtype, device=self.device)
        states[key][self.prefill_rows] = state.repeat_interleave(self.repeat, dim=0) if self.repeat > 1 else state
        return state

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._state("conv", layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._state("recurrent", layer_idx, state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """conv_states [B, C, T] (a multi-token forward's inputs) -> what the causal convolution runs over: the
        previous state's columns then these (a prefill has none: zeros pad a T shorter than the kernel)."""
        previous = self._state("conv", layer_idx, state_idx)
        if previous is not None:
            full = torch.cat([previous, conv_states], dim=-1)
            size = previous.shape[-1]
        else:
            size = conv_kernel_size or conv_states.shape[-1]
            full = conv_states
            if full.shape[-1] < size:
                full = torch.nn.functional.pad(full, (size - full.shape[-1], 0))
        self._store("conv", layer_idx, state_idx, full[..., -size:].clone())
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        return self._store("recurrent", layer_idx, state_idx, recurrent_states)

    def select_rows(self, keep: torch.Tensor, upto: int) -> None:
        """Keep only rows `keep` (LongTensor [B']); columns >= `upto` are not copied (not written yet)."""
        for i in range(len(self.keys)):
            for bufs in (self.keys, self.values):
                old = bufs[i]
                if old is None:  # a recurrent layer's slot
                    continue
                new = torch.zeros((len(keep), *old.shape[1:]), dtype=old.dtype, device=old.device)
                new[:, :, :upto] = old[keep, :, :upto]
                bufs[i] = new
        states = self.__dict__.get("states", {})
        for key in states:
            states[key] = states[key][keep]
        self.batch = len(keep)


class NativeRolloutEngine(InProcessEngine):
    """Batched sampling with a static KV cache; shares the actor module (or a dtype-cast copy of it).

    Options: `dtype` ("bfloat16" | "float32" | None), `seed`, `max_num_seqs` (rows decoded together; more
    prompts run in waves), `prefill_tokens` (tokens per prefill chunk, padding included), `packed_prefill` (prompts
    prefilled end to end without padding, `FusedDecoder.forward_packed`; None, the default: where torch's varlen
    attention kernel runs them, CUDA in bf16 / fp16; on a CPU the padded chunks of similar lengths are faster for
    models of 30M+ parameters, `PREFILL_WASTE`), `compact_fraction` (compact
    the batch once this fraction of its rows is done), `num_threads` (torch threads during generate),
    `dtype_fallback` (bf16 on a CPU without fast bf16 matmuls runs fp32 instead, with a warning),
    `fused_decode` (the `fused_decode.SUPPORTED` families: decode with fused qkv and gate-up matmuls,
    `tiller.rollout.fused_decode`),
    `compile_decode` (that step compiled by Inductor, `tiller.rollout.compiled_decode`; verl's
    `rollout.enforce_eager=False`; needs a C++ compiler, the first decode step compiles for ~10-30 s),
    `decode_kernel` (on CPU, the fused step's one-token attention in a C kernel built once with the C compiler
    on PATH, `tiller.rollout.decode_kernel`; SDPA where it does not apply), `static_decode` (the same families: decode
    with the static-shape step of `tiller.rollout.graphed_decode`, captured in CUDA graphs per batch-size bucket when
    `cuda_graphs`, each layer's body compiled by Inductor with `compile_decode`; without stop strings or a weights
    hook), `capture_sizes` (its buckets; default vLLM's), `static_attention` ("sdpa": masked SDPA over the live
    length rounded up to 256 columns; "flex": FlexAttention reading each row's live 128-column blocks only;
    "triton": tiller's split-KV Triton kernel reading each row's live columns only, `tiller.rollout.triton_decode`),
    `record_routing` (a mixture-of-experts model: each row's experts per token and layer, prompt and response, in
    `RolloutOutput.routed_experts`, for routing replay (verl's R3, `tiller.models.routing`); the calls decode with the
    fused or compiled step, not the static / CUDA-graph one).
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, *, dtype=None, seed: int = 0,
                 max_num_seqs: int = 256, prefill_tokens: int = 4096, compact_fraction: float = 0.25,
                 num_threads: int | None = None, dtype_fallback: bool = True, fused_decode: bool = True,
                 compile_decode: bool = False, decode_kernel: bool = True, static_decode: bool = False,
                 cuda_graphs: bool | None = None, capture_sizes: list[int] | None = None,
                 static_attention: str = "sdpa", record_routing: bool = False, packed_prefill: bool | None = None):
        impl = getattr(model.config, "_attn_implementation", "eager")
        if impl not in ("sdpa", "eager"):
            raise UserError(
                f"rollout.name=native drives the 'sdpa' or 'eager' attention implementation, the model uses "
                f"{impl!r}; load it with attn_implementation='sdpa' or use rollout.name=hf"
            )
        super().__init__(model, tokenizer, dtype=dtype, seed=seed, dtype_fallback=dtype_fallback)
        self.max_num_seqs = max_num_seqs
        self.prefill_tokens = prefill_tokens
        self.packed_prefill = packed_prefill
        self.compact_fraction = compact_fraction
        self.num_threads = num_threads
        self.fused_decode = fused_decode
        device_type = next(model.parameters()).device.type
        if compile_decode and not compiled_decode.available(device_type):
            raise UserError("compiling the decode step (rollout.enforce_eager=False / tiller serve --compile) needs "
                            + ("Triton for torch.compile on CUDA" if device_type == "cuda" else
                               "a C++ compiler on PATH (g++ or clang++) for torch.compile's CPU backend")
                            + "; install it or decode eagerly")
        self.compile_decode = compile_decode
        self.decode_kernel = decode_kernel
        self._fused: FusedDecoder | None = None
        self.static_decode, self.capture_sizes = static_decode, capture_sizes
        if static_attention not in graphed_decode.ATTENTIONS or (static_attention == "flex" and not compile_decode):
            raise UserError(f"rollout engine_kwargs.static_attention={static_attention!r}: choose one of "
                            f"{list(graphed_decode.ATTENTIONS)}; 'flex' (FlexAttention over each row's live blocks) "
                            "runs in the compiled static step only (static_decode and compile_decode)")
        if static_attention == "triton" and not triton_decode.available(device_type):
            raise UserError("rollout engine_kwargs.static_attention='triton' needs Triton and a CUDA device (or "
                            "TRITON_INTERPRET=1 for Triton's interpreter on a CPU); use 'sdpa'")
        self.static_attention = static_attention
        self.record_routing = record_routing
        self.cuda_graphs = (device_type == "cuda") if cuda_graphs is None else cuda_graphs
        if static_decode and self.cuda_graphs and device_type != "cuda":
            raise UserError("CUDA graphs (rollout.enforce_eager=False) need the model on a CUDA device")
        graphed_decode.capture_sizes(max_num_seqs, capture_sizes)  # a bad rollout.cudagraph_capture_sizes fails here
        if static_decode and vision_token_ids(model):
            import warnings

            warnings.warn("rollout: the static-shape / CUDA-graph decode step (a GPU's default; "
                          "rollout.enforce_eager=True turns it off) does not apply to a vision-language model "
                          "(per-row M-RoPE offsets, vision tokens "
                          "suppressed): it decodes with the fused step instead (tiller.rollout.images)", stacklevel=2)

    def grammar_for(self, regex: str):
        """The compiled grammar of `regex` (`SamplingParams.regex`), kept per pattern; the compiler (llguidance's view
        of the tokenizer) is built on first use."""
        # import cost: llguidance loads only when a call is constrained
        from tiller.rollout.constrained import GrammarCompiler

        cache = self.__dict__.setdefault("_grammars", {})
        if regex not in cache:
            if self.tokenizer is None:
                raise UserError("rollout: a regex constraint needs the engine's tokenizer")
            if "_grammar_compiler" not in self.__dict__:
                head = self.weights.module.get_output_embeddings()
                width = head.weight.shape[0] if head is not None else self.weights.module.config.vocab_size
                self._grammar_compiler = GrammarCompiler(self.tokenizer, width)
            cache[regex] = self._grammar_compiler.regex(regex)
        return cache[regex]

    def fused_for(self, model) -> FusedDecoder | None:
        """The fused decoder of `model` (built on first use, re-synced with its weights), or None where it does
        not apply (fused_decode off, or a model it does not support)."""
        if not (self.fused_decode and supports_fused(model)):
            self._fused = None
            return None
        if self._fused is None or self._fused.model is not model:
            self._fused = FusedDecoder(model, compile=self.compile_decode, decode_kernel=self.decode_kernel)
        self._fused.sync()
        return self._fused

    # ------------------------------------------------------------------------------------------ API

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams,
                 weights_hook: Callable[[], int] | None = None,
                 multi_modal: list[dict | None] | None = None) -> RolloutOutput:
        """Sample `sampling.n` completions per prompt. `weights_hook()` (asynchronous RL's partial rollouts) is
        called before the prefill and before every decode step: it may load new weights into the module this
        engine runs (which are then used from that step on, the KV cache so far kept) and returns the policy
        version in use, recorded per token in `RolloutOutput.token_versions`; it may raise to abort.
        `multi_modal`: per prompt None (text) or {"pixel_values", "image_grid_thw"} of a vision-language model
        (`tiller.rollout.images`)."""
        sampling.validate()
        self.weights.sync_if_stale()
        model = self.weights.module
        check_prompts(prompt_ids, model.get_input_embeddings().num_embeddings)
        multi_modal = check_multi_modal(model, prompt_ids, multi_modal)
        self.fused_for(model)
        device = next(model.parameters()).device
        seed = sampling.seed if sampling.seed is not None else self.generator_seed + self._calls
        self._calls += 1
        generator = torch.Generator(device=device).manual_seed(seed)
        stop_ids = stop_ids_for(model, self.tokenizer, sampling)
        if sampling.regex is not None:  # the grammar's eos ends a matched text, ignore_eos or not
            stop_ids = list(dict.fromkeys([*stop_ids, *self.grammar_for(sampling.regex).eos_ids]))
        watcher = StopStringWatcher(self.tokenizer, sampling.stop)
        per_wave = max(1, self.max_num_seqs // sampling.n)
        result = RolloutOutput()
        old_threads = torch.get_num_threads()
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        try:
            with eval_mode(model), torch.inference_mode():
                for start in range(0, len(prompt_ids), per_wave):
                    wave = prompt_ids[start : start + per_wave]
                    wave_mm = None if multi_modal is None else multi_modal[start : start + per_wave]
                    wave_mm = wave_mm if wave_mm and any(m is not None for m in wave_mm) else None  # text-only wave
                    routes = [] if self.record_routing else None
                    tokens, logprobs, versions = self._generate_wave(model, wave, sampling, stop_ids, watcher,
                                                                     generator, weights_hook, wave_mm, routes)
                    for row, (toks, lps) in enumerate(zip(tokens, logprobs)):
                        ids, lp, reason = finalize_row(toks, lps, stop_ids, watcher)
                        result.prompt_ids.append(list(wave[row // sampling.n]))
                        result.response_ids.append(ids)
                        result.logprobs.append(lp)
                        result.finish_reason.append(reason)
                        if weights_hook is not None:
                            result.token_versions.append(versions[row][:len(ids)])
                        if routes is not None:  # (finalize_row may have cut a stop string's tail)
                            result.routed_experts.append(routes[row][:len(result.prompt_ids[-1]) + len(ids)])
        finally:
            torch.set_num_threads(old_threads)
        return result

    # ------------------------------------------------------------------------------------ internals

    def _mask(self, valid: torch.Tensor, dtype: torch.dtype, impl: str) -> torch.Tensor:
        """bool valid [..] -> the 4D mask the attention implementation wants (bool for sdpa, additive else)."""
        return to_attention_mask(valid, dtype, impl)

    def _prefill(self, model, prompts, cache: KVBuffer, width: int, n: int, pad_id: int,
                 images: ImagePrompts | None = None, routes: routing.Recorder | None = None) -> torch.Tensor:
        """Run all prompts through the model in chunks, filling `cache`; returns first logits [G*n, V].

        Prompts go shortest first into chunks of similar lengths (`prefill_chunks`), so a chunk pads little;
        each chunk's keys / values land in its prompts' rows (n per prompt) at the right-aligned columns.
        `images` (image prompts): the chunk's vision outputs and M-RoPE positions go to the model's forward.
        `routes`: the experts of each prompt token are recorded in its first row's slots, then copied to the others.
        """
        device, impl = cache.device, model.config._attn_implementation
        dtype = next(model.parameters()).dtype
        if self.packs_prefill(model, device, dtype) and images is None and routes is None:
            return self._prefill_packed(prompts, cache, width, n)
        first_logits: torch.Tensor | None = None
        waste = PREFILL_WASTE.get(torch.device(device).type, MAX_WASTE)
        for chunk_idx in prefill_chunks([len(p) for p in prompts], self.prefill_tokens, waste):
            chunk = [prompts[i] for i in chunk_idx]
            w = max(len(p) for p in chunk)
            ids, pos, valid = prefill_inputs(chunk, pad_id, device)
            rows = to_device((torch.tensor(chunk_idx)[:, None] * n + torch.arange(n)[None]).reshape(-1), device)
            cache.prefill_rows, cache.prefill_cols, cache.repeat = rows, slice(width - w, width), n
            extra = {} if images is None else images.chunk_inputs(chunk_idx, w, device)
            firsts = to_device(torch.tensor(chunk_idx), device) * n
            recording = (routes.at(lambda g: g[firsts][:, width - w:width]) if routes is not None
                         else contextlib.nullcontext())
            with recording:
                last = self._chunk_forward(model, ids, pos, valid, cache, extra, dtype, impl)
            logits = last.float().repeat_interleave(n, dim=0)
            if first_logits is None:
                first_logits = torch.empty((len(prompts) * n, logits.shape[-1]), dtype=torch.float32, device=device)
            first_logits[rows] = logits
        cache.prefill_rows = cache.prefill_cols = None
        cache.repeat = 1
        if routes is not None and n > 1:  # the n samples of a prompt share its prefill, and its routing
            by_prompt = routes.by_row().view(len(prompts), n, *routes.by_row().shape[1:])
            by_prompt[:, 1:, :width] = by_prompt[:, :1, :width]
        return first_logits

    def packs_prefill(self, model, device, dtype: torch.dtype) -> bool:
        """Whether prompts are prefilled packed, without padding (`packed_prefill`; by default where torch's varlen
        attention kernel runs them: CUDA, bf16 / fp16): through the fused decoder only."""
        if self._fused is None or self._fused.model is not model:
            return False
        if self.packed_prefill is None:
            return varlen.uses_varlen(dtype, torch.device(device))
        return self.packed_prefill

    def _prefill_packed(self, prompts, cache: KVBuffer, width: int, n: int) -> torch.Tensor:
        """`_prefill` with prompts packed end to end in chunks of up to `prefill_tokens` tokens: no padding, no mask
        (`FusedDecoder.forward_packed`); each prompt's keys / values go to its n rows at right-aligned columns."""
        first_logits: torch.Tensor | None = None
        for chunk_idx in packed_chunks([len(p) for p in prompts], self.prefill_tokens):
            ids, pos, lengths, cu, dest = packed_prefill_inputs([prompts[i] for i in chunk_idx], width, n,
                                                                cache.device)
            first = chunk_idx[0] * n  # (a chunk's prompts are consecutive: so are their rows)
            cache.packed_dest = (dest[0] + first, dest[1], dest[2])
            logits = self._fused.forward_packed(ids, pos, lengths, cu, cache).float().repeat_interleave(n, dim=0)
            if first_logits is None:
                first_logits = torch.empty((len(prompts) * n, logits.shape[-1]), dtype=torch.float32,
                                           device=logits.device)
            first_logits[first : first + len(logits)] = logits
        cache.packed_dest = None
        return first_logits

    def _chunk_forward(self, model, ids, pos, valid, cache: KVBuffer, extra: dict, dtype, impl) -> torch.Tensor:
        """One prefill chunk's forward (`_prefill`): its last position's logits [c, V]."""
        if self._fused is not None and self._fused.model is model and not extra:  # prepacked weights
            return self._fused.forward(ids, pos, valid[:, None], cache)
        # a pad query sees itself; the last column is a real token in every row, so its row is the pads
        attn = layout_of(model).masks(valid[:, None], pos, pos, valid[:, -1, :], lambda m: self._mask(m, dtype, impl))
        return model(input_ids=ids, attention_mask=attn, **{"position_ids": pos, **extra}, use_cache=True,
                     logits_to_keep=1, **{cache_keyword(model) or 'past_key_values': cache}).logits[:, -1, :]

    def _new_weights(self, weights_hook, version: int) -> int:
        """Call the hook; when it reports another version, re-read the weights it loaded (cast copy, fused)."""
        new = weights_hook()
        if new != version:
            self.weights.sync_if_stale()
            if self._fused is not None:
                self._fused.sync()
        return new

    def _generate_wave(self, model, prompts, sampling: SamplingParams, stop_ids, watcher, generator,
                       weights_hook=None, multi_modal=None, routes_out: list | None = None):
        """Generate for one wave of prompts; returns raw (tokens, logprobs, versions) lists per row, row-major
        (versions: the policy version of each token's logits, from `weights_hook`; empty lists without it).
        `routes_out` (record_routing): each row's routing [prompt + response tokens, layers, top-k] is appended (the
        last token's is -1: no forward reads it)."""
        vision_ids = vision_ids_tensor(model, next(model.parameters()).device)
        graphed = (graphed_decode.decoder_for(self, model) if weights_hook is None and not watcher
                   and vision_ids is None and not sampling.penalized and sampling.regex is None
                   and routes_out is None else None)
        if graphed is not None:  # the static-shape step (CUDA graphs on a GPU)
            return graphed_decode.generate_wave(self, graphed, model, prompts, sampling, stop_ids, generator,
                                                pad_token_id(model, self.tokenizer), KVBuffer)
        device = next(model.parameters()).device
        impl = model.config._attn_implementation
        dtype = next(model.parameters()).dtype
        n, max_new = sampling.n, sampling.max_new_tokens
        rows_total = len(prompts) * n
        width = max(len(p) for p in prompts)
        cache = KVBuffer(rows_total, width + max_new, device)
        version = self._new_weights(weights_hook, -1) if weights_hook is not None else -1
        step_versions = [version]  # the version of the logits each token t is sampled from
        images = ImagePrompts(model, prompts, multi_modal) if multi_modal is not None else None
        routes = None
        if routes_out is not None:
            routes = routing.Recorder(model, rows_total, width + max_new,
                                      "actor_rollout_ref.rollout.enable_rollout_routing_replay")
        logits = self._prefill(model, prompts, cache, width, n, pad_token_id(model, self.tokenizer), images, routes)

        prompt_len = torch.tensor([len(p) for p in prompts], device=device).repeat_interleave(n)
        # each row's first response position: len(prompt), or past an image prompt's largest M-RoPE position
        first_pos = torch.tensor(next_positions(model, prompts, multi_modal), device=device).repeat_interleave(n)
        columns = torch.arange(width + max_new, device=device)
        valid_all = (columns[None, :] >= (width - prompt_len)[:, None])[:, None, None, :]  # [B, 1, 1, L]
        layout = layout_of(model)
        # plain models: one mask for every layer; else per layer kind from each column's sequence position
        mask_all = self._mask(valid_all, dtype, impl) if layout.plain else valid_all
        seq_pos = columns[None, :] - (width - prompt_len)[:, None]  # [B, L]
        out_tokens = torch.zeros((rows_total, max_new), dtype=torch.long, device=device)
        out_logp = torch.zeros((rows_total, max_new), dtype=torch.float32, device=device)
        lengths = torch.full((rows_total,), max_new, dtype=torch.long)
        rows = torch.arange(rows_total, device=device)  # original row of each live batch row
        alive = torch.ones(rows_total, dtype=torch.bool, device=device)
        stop_tensor = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
        sample_kw = dict(do_sample=sampling.do_sample, temperature=sampling.temperature, top_k=sampling.top_k,
                         top_p=sampling.top_p, min_p=sampling.min_p, generator=generator)
        penalties = (PenaltyState([p for p in prompts for _ in range(n)], logits.shape[-1], device,
                                  sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty)
                     if sampling.penalized else None)
        grammar = None
        if sampling.regex is not None:
            from tiller.rollout.constrained import GrammarRows  # import cost: llguidance, only for constrained calls

            grammar = GrammarRows(self.grammar_for(sampling.regex), rows_total)
        for t in range(max_new):
            logits = suppress_vision_tokens(logits, vision_ids)
            if penalties is not None:
                logits = penalties.penalize(logits)
            if grammar is not None:  # after the penalties, as the continuous batcher orders them
                logits = grammar.mask(logits)
            tokens, logp = sample_tokens(logits, **sample_kw)
            if penalties is not None:
                penalties.record(tokens)
            if grammar is not None:
                grammar.consume(tokens.tolist())
            out_tokens[rows, t] = tokens
            out_logp[rows, t] = logp
            done = torch.isin(tokens, stop_tensor) if len(stop_ids) else torch.zeros_like(alive)
            if watcher:
                window = out_tokens[rows, max(0, t + 1 - watcher.window) : t + 1].tolist()
                done |= torch.tensor(watcher.hits(window), device=device)
            done &= alive
            if bool(done.any()):
                lengths[rows[done].cpu()] = t + 1
                alive &= ~done
            if t + 1 == max_new or not bool(alive.any()):
                break
            n_alive = int(alive.sum())
            if len(alive) - n_alive >= max(1, self.compact_fraction * len(alive)):
                keep = alive.nonzero().squeeze(-1)
                cache.select_rows(keep, width + t)
                rows, tokens, alive = rows[keep], tokens[keep], alive[keep]
                first_pos, mask_all, seq_pos = first_pos[keep], mask_all[keep], seq_pos[keep]
                if penalties is not None:
                    penalties.select(keep)
                if grammar is not None:
                    grammar.select(keep.tolist())
            cache.write_pos = width + t
            if weights_hook is not None:  # partial rollout: newer weights from here on (KV cache kept)
                version = self._new_weights(weights_hook, version)
                step_versions.append(version)
            mask, positions = mask_all[..., : width + t + 1], (first_pos + t)[:, None]
            if not layout.plain:
                mask = layout.masks(mask, seq_pos[:, width + t : width + t + 1], seq_pos[:, : width + t + 1], None,
                                    lambda m: self._mask(m, dtype, impl))
            recording = (routes.at(lambda g: g[rows, width + t][:, None]) if routes is not None
                         else contextlib.nullcontext())
            with recording:
                if self._fused is not None:
                    logits = self._fused.step(tokens[:, None], positions, mask, cache)
                else:
                    logits = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions,
                                   use_cache=True, logits_to_keep=1,
                                   **{cache_keyword(model) or 'past_key_values': cache}).logits[:, -1, :]
        tokens_list, logp_list = out_tokens.tolist(), out_logp.tolist()
        lengths_list = lengths.tolist()
        if routes is not None:
            table = routes.by_row().cpu()
            # a row's last token has no routing: no forward reads it, except that a stopped row not yet compacted
            # away is fed its stop token once more; clear that, so what is kept does not depend on compaction
            fed = (lengths > 0).nonzero().squeeze(-1)
            table[fed, width + lengths[fed] - 1] = -1
            routes_out.extend(table[r, width - len(prompts[r // n]): width + lengths_list[r]]
                              for r in range(rows_total))
        return ([tokens_list[r][: lengths_list[r]] for r in range(rows_total)],
                [logp_list[r][: lengths_list[r]] for r in range(rows_total)],
                [step_versions[: lengths_list[r]] if weights_hook is not None else [] for r in range(rows_total)])
