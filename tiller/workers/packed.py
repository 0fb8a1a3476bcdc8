"""The update's forward without padding (verl's `use_remove_padding=True`): a micro-batch's rows packed into one.

A micro-batch of RL samples is `[B, P + T]`: left-padded prompts, right-padded responses. The padded forward
(`tiller.workers.common.response_forward`) trims the columns no row uses, but every row still runs at the width of
the longest prompt plus the longest response. Packed, each row's real tokens (attention mask 1) are laid end to end
in one sequence `[1, N]`, N = the micro-batch's real tokens, with position ids restarting at 0 for every row:

    row 0: p p p r r r          ->   p p p r r r q q r r r r s s s r
    row 1:     q q r r r r                      (positions 0 1 2 3 4 5 0 1 2 3 4 5 0 1 2 3)
    row 2:   s s s r

The attention runs per row: for the packed forward the model's attention implementation is switched to
`tiller_packed` (registered with transformers' `AttentionInterface`; no mask is built), which attends causally
inside each row's slice: `torch.nn.attention.varlen.varlen_attn` on CUDA in bf16 / fp16 (FlashAttention's varlen
kernel in torch), else one SDPA call per row with `is_causal=True`. Attention costs the sum of the rows' squared lengths, never the
packed length's square, and no `[N, N]` mask exists. The matmuls run on N tokens instead of B x (P + T); the LM
head runs only on the positions that predict a response token (`logits_to_keep` as an index tensor), scattered back
to `[B, t, V]`. Every real token gets the position id and the keys it has in the padded forward, so logprobs and
gradients are the padded forward's up to summation order (tests/trainer/test_packed_forward.py).

Under gradient checkpointing (`enable_gradient_checkpointing`) a layer's forward is rerun inside `backward()`, after
the packed forward has returned; `enable_checkpointing` installs `recompute_contexts`, which re-enters the attention
switch with the same rows for each rerun (without it the rerun attends across rows: torch's CheckpointError).

Deviations from verl: rows are packed per micro-batch (the micro-batching stays tiller's, token-budgeted or not);
no flash-attn package needed (torch's own varlen kernel on CUDA). Slots past a row's response are zero logits (the padded
forward has pad-token logits there); both are masked by `response_mask` downstream.

Letters: `B` rows, `W` trimmed columns, `N` packed tokens, `K` kept (response-predicting) positions, `V` vocabulary.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tiller.models import routing
from tiller.models.layer_masks import RECURRENT_KINDS, has_recurrent_layers, text_config
from tiller.models.varlen import attention_dtype, uses_varlen, varlen_attention
from tiller.protocol import to_device
from tiller.workers.common import Float32Head, position_ids_from_mask, trim_bounds

IMPL = "tiller_packed"
"""The attention implementation name the packed forward switches the model to while it runs."""

# (the model's config, (row lengths on the host, cumulative offsets [B + 1] int32 on the device, longest row),
# the sequence-parallel group or None) of the running packed forward
_SEGMENTS: contextvars.ContextVar = contextvars.ContextVar("tiller_packed_segments", default=None)
_SWITCH = threading.Lock()
_ACTIVE: dict[int, list] = {}  # id(config) -> [packed forwards running, the implementation to restore]


def packed_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' attention-interface contract for the packed sequence: query [1, Hq, N, D], key / value
    [1, Hk, N, D] -> ([1, N, Hq, D], None), each row attending causally to its own tokens only.
    Under sequence parallelism (`tiller.workers.ulysses`) the inputs are this rank's slice of the sequence with
    every head; the attention itself runs on the whole sequence with this rank's share of the heads."""
    running = _SEGMENTS.get()
    if running is None:
        raise RuntimeError(f"the {IMPL!r} attention runs only inside tiller.workers.packed.packed_response_forward")
    lengths, cu, longest = running[1]
    # what the layer asks of its attention beyond causal: a sliding window (Mistral, Gemma 2 / 3, gpt-oss, ...),
    # attention sinks (gpt-oss's `s_aux`), a logit soft-cap (Gemma 2)
    window, sinks, softcap = kwargs.get("sliding_window"), kwargs.get("s_aux"), kwargs.get("softcap")
    window = int(window) if window and window < longest else None
    sp = running[2]
    if sinks is not None and sp is not None:  # under sequence parallelism this rank attends with its share of heads
        sinks = sinks.reshape(sp.size, -1)[sp.rank]

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        dtype = attention_dtype(query)
        if dropout == 0.0 and uses_varlen(dtype, query.device) and sinks is None and softcap is None:
            q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))
            return varlen_attention(q, k, v, cu, longest, scaling, window).unsqueeze(0)
        gqa = query.shape[1] != key.shape[1]
        # the rows as views of one split (its backward is one concatenation; a slice per row would make each row's
        # gradient a zero tensor of the whole packed length, B of them per layer)
        outs = []
        for q, k, v in zip(*(torch.split(x, lengths, dim=2) for x in (query, key, value))):
            n = q.shape[2]
            if sinks is not None or softcap is not None:
                outs.append(_eager_row(q, k, v, scaling, window, sinks, softcap, dropout, module.training))
            elif window is not None and n > window:
                i = torch.arange(n, device=q.device)
                band = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
                outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=band, dropout_p=dropout, scale=scaling,
                                                           enable_gqa=gqa))
            else:
                outs.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                                           enable_gqa=gqa))
        return torch.cat(outs, dim=2).transpose(1, 2)

    return (attend(query, key, value) if sp is None else sp.attention(query, key, value, attend)), None


def _eager_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale, window: int | None, sinks, softcap,
               dropout: float, training: bool) -> torch.Tensor:
    """One row's causal attention as transformers' eager path computes it with a soft-cap (Gemma 2: scores ->
    tanh(scores / cap) * cap) and / or attention sinks (gpt-oss: a per-head logit joining each softmax, then
    dropped); q [1, Hq, n, D], k / v [1, Hk, n, D] -> [1, Hq, n, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    n = q.shape[2]
    i = torch.arange(n, device=q.device)
    allowed = i[:, None] >= i[None, :]
    if window is not None:
        allowed = allowed & (i[:, None] - i[None, :] < window)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).expand(1, -1, n, 1).to(scores.dtype)
        both = torch.cat([scores, sink], dim=-1)
        both = both - both.max(dim=-1, keepdim=True).values
        probs = both.softmax(dim=-1, dtype=both.dtype)[..., :-1]
    else:
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs.to(v.dtype), p=dropout, training=training)
    return torch.matmul(probs, v)


def packs(module, key: str, asked: bool) -> bool:
    """Whether the update packs rows (`key`, verl's use_remove_padding, as `asked`): not for a model with recurrent
    layers (Qwen3.5 / Qwen3-Next's Gated DeltaNet, Mamba, LFM2's convolutions), whose state would run from one
    packed row into the next, nor with chunked attention (Llama 4, whose chunks the packed attention does not cut);
    those run the padded forward, which gives the same logprobs, and say so once."""
    config = text_config(module.config)
    if asked and "chunked_attention" in (getattr(config, "layer_types", None) or ()):
        print(f"{key}=True: {config.model_type}'s chunked-attention layers (Llama 4's) are not packed; its update runs "
              "the padded forward (the same logprobs)", file=sys.stderr)
        return False
    if not (asked and has_recurrent_layers(module)):
        return asked
    kinds = sorted(set(config.layer_types) & set(RECURRENT_KINDS))
    print(f"{key}=True: {config.model_type}'s recurrent layers ({', '.join(kinds)}) would carry their state from one "
          "packed row into the next; its update runs the padded forward (the same logprobs)", file=sys.stderr)
    return False


def _register() -> None:
    from transformers import AttentionInterface

    # opaque to torch.compile (compiled decoder layers, tiller.models.compile): it reads the running forward's rows
    # from a context variable and picks its kernel on the host, so the layer's graph breaks here, once
    AttentionInterface.register(IMPL, torch.compiler.disable(packed_attention))


@contextlib.contextmanager
def attention_switch(config, segments: tuple[list[int], torch.Tensor, int], sp=None):
    """Run the model's attention as `packed_attention` over rows `segments` (lengths, offsets, longest): a
    thread-safe, counted switch of `config._attn_implementation` (concurrent packed forwards of one model share
    it, the last one restores it). `sp`: the sequence-parallel group (`tiller.workers.ulysses.SeqParallel`) when
    the forward runs on a slice of the packed sequence."""
    _register()
    token = _SEGMENTS.set((config, segments, sp))
    with _SWITCH:
        entry = _ACTIVE.setdefault(id(config), [0, config._attn_implementation])
        entry[0] += 1
        config._attn_implementation = IMPL
    try:
        yield
    finally:
        with _SWITCH:
            entry[0] -= 1
            if entry[0] == 0:
                config._attn_implementation = entry[1]
                del _ACTIVE[id(config)]
        _SEGMENTS.reset(token)


def recompute_contexts():
    """`context_fn` of `torch.utils.checkpoint.checkpoint` (non-reentrant): (forward context, recompute context).

    Gradient checkpointing reruns a layer's forward inside `backward()`, after `packed_response_forward` has left
    its attention switch: the rerun would use the model's own attention over the packed sequence (every row
    attending to the rows before it, and another count of saved tensors: torch's CheckpointError). The recompute
    context re-enters the switch with the segments of the forward that saved the layer's inputs, and a routing
    replay's session and view (`tiller.models.routing.resume`: the rerun routes as the forward did)."""
    running = _SEGMENTS.get()
    attention = attention_switch(*running) if running is not None else contextlib.nullcontext()
    return contextlib.nullcontext(), _both(attention, routing.resume())


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def enable_checkpointing(module) -> None:
    """Gradient (activation) checkpointing on an HF `module`, non-reentrant, with the packed forward's attention
    restored in each recompute (`recompute_contexts`)."""
    kwargs = {"use_reentrant": False, "context_fn": recompute_contexts}
    # the new name first: the old one warns on transformers >= 5.24 (both take the checkpoint kwargs first)
    enable = getattr(module, "activation_checkpointing_enable", None) or module.gradient_checkpointing_enable
    enable(kwargs)


def pack_rows(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, mask [B, W] -> (packed ids [1, N], position ids [1, N] restarting at each row, index [B, W] of each
    column in the packed sequence; -1 for padding)."""
    valid = mask.bool()
    index = torch.where(valid, valid.reshape(-1).long().cumsum(0).view_as(valid) - 1, -1)
    return ids[valid][None], position_ids_from_mask(mask)[valid][None], index


LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields of causal LMs whose forward transforms the head's output (Gemma 2 / 3's soft-cap, Cohere's scale,
Granite's divisor): their logits are not the head's, so their head does not run fused (`fused_head`)."""


def fused_head(model) -> tuple[torch.nn.Module, torch.nn.Linear] | str:
    """(the decoder, the LM head) of `model` where its forward is the decoder then the head alone, so the head can run
    fused with the log-probs (`tiller.algos.entropy.head_logprobs_and_entropy`, verl's use_fused_kernels): a causal
    LM (a PEFT model's base) whose `.model` holds the decoder layers and whose head is a plain Linear (or a
    `Float32Head`), not sharded (FSDP2's DTensor) and with no logit transform (`LOGIT_TRANSFORMS`); else why not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = getattr(base, "model", None), base.get_output_embeddings()
    config = text_config(base.config)
    if decoder is None or not hasattr(decoder, "layers"):
        return f"{type(base).__name__} has no decoder stack at .model"
    if type(head) not in (torch.nn.Linear, Float32Head):
        return f"its LM head is a {type(head).__name__}, not a plain Linear"
    if any(getattr(config, k, None) not in (None, 1.0) for k in LOGIT_TRANSFORMS):
        return f"{config.model_type} transforms the head's logits ({', '.join(LOGIT_TRANSFORMS)})"
    if hasattr(head.weight, "full_tensor"):
        return "its LM head is sharded (FSDP2)"
    return decoder, head


def head_at(model, keep: torch.Tensor, logits_to_keep: bool = True, **inputs) -> torch.Tensor:
    """`model(**inputs)`'s head output [K, C] at packed positions `keep` [K] (batch 1): through HF's `logits_to_keep`
    where the forward takes it (a causal LM's LM head then runs on those positions only), else the whole output
    indexed (a value model, whose head is one column)."""
    if logits_to_keep:
        return model(**inputs, logits_to_keep=keep).logits[0]
    return model(**inputs).logits[0, keep]


def pack_micro_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                     response_mask: torch.Tensor):
    """An RL micro-batch [B, P + T] trimmed and packed: (flat ids [1, N], position ids [1, N], predictor [B, t] (the
    packed position predicting response slot j, -1 where none), keep [B, t] (predictor >= 0), row lengths, t)."""
    left, right = trim_bounds(attention_mask, prompt_width, response_mask)
    t_used = right - prompt_width
    ids, mask = input_ids[:, left : right - 1], attention_mask[:, left : right - 1]
    flat_ids, positions, index = pack_rows(ids, mask)
    # response slot j is predicted at trimmed column (P - left) - 1 + j
    predictor = index[:, prompt_width - left - 1 + torch.arange(t_used, device=ids.device)]  # [B, t]
    lengths = [n for n in mask.sum(1).tolist() if n > 0]
    return flat_ids, positions, predictor, predictor >= 0, lengths, t_used


class PackedRows(NamedTuple):
    """A micro-batch packed where its tensors are (the host: its bookkeeping reads values, no device sync) and moved
    to the device: ids / positions [1, N], kept [K] (the packed positions predicting a response token), slots [K]
    (where in the flattened [B * t] each of those tokens goes), cu [B + 1] int32 on `device`; keep [B, t] (the
    response slots that have one) and lengths (the rows' token counts) where the inputs were."""

    ids: torch.Tensor
    positions: torch.Tensor
    kept: torch.Tensor
    slots: torch.Tensor
    cu: torch.Tensor
    keep: torch.Tensor
    lengths: list[int]
    t_used: int


def pack_to(device, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
            response_mask: torch.Tensor) -> PackedRows:
    """`pack_micro_batch` on the inputs' device, its results copied to `device` without waiting for it (a packing
    done on the GPU reads lengths and bounds back to the host: a sync per micro-batch, which stalls the update
    between the last micro-batch's backward and this forward)."""
    flat_ids, positions, predictor, keep, lengths, t_used = pack_micro_batch(input_ids, attention_mask, prompt_width,
                                                                             response_mask)
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    slots = keep.reshape(-1).nonzero().squeeze(-1)
    moved = (to_device(x, device) for x in (flat_ids, positions, predictor[keep], slots, cu))
    return PackedRows(*moved, keep, lengths, t_used)


def _packed_slots(grid: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                  response_mask: torch.Tensor) -> torch.Tensor:
    """The slots of `pack_micro_batch`'s packed tokens in a routing replay's grid [B, P + T]
    (`tiller.models.routing`)."""
    left, right = trim_bounds(attention_mask, prompt_width, response_mask)
    return grid[:, left: right - 1][attention_mask[:, left: right - 1].bool().to(grid.device)]


def packed_response_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                            response_mask: torch.Tensor, logits_to_keep: bool = True, packed: bool = False,
                            device=None, decoder=None):
    """`response_forward`'s contract, packed: (logits [B, t_used, V] over the response slots, t_used); column j
    predicts response token j (a value model: V = 1, the value of the state before token j). input_ids,
    attention_mask [B, P + T]; response_mask [B, T]: on the host (packed there: `pack_to`) or on `device` (default:
    theirs). logits_to_keep: the model's forward takes it (causal LMs). `packed`: (logits [K, V] of the response
    tokens only, the `PackedRows`: where they go), without the zero-filled [B, t_used, V] tensor. `decoder` (the
    model's, `fused_head`; with `packed`): its last hidden states [K, E] at those tokens instead of the logits."""
    rows = pack_to(input_ids.device if device is None else device, input_ids, attention_mask, prompt_width,
                   response_mask)
    with attention_switch(model.config, (rows.lengths, rows.cu, max(rows.lengths))), routing.view(
            lambda g: _packed_slots(g, attention_mask, prompt_width, response_mask)):
        inputs = dict(input_ids=rows.ids, attention_mask=None, position_ids=rows.positions, use_cache=False)
        if decoder is not None:
            return decoder(**inputs).last_hidden_state[0, rows.kept], rows  # [K, E]
        logits = head_at(model, rows.kept, logits_to_keep, **inputs)  # [K, V]
    if packed:
        return logits, rows
    return scatter_rows(logits, rows), rows.t_used


def scatter_rows(packed: torch.Tensor, rows: PackedRows) -> torch.Tensor:
    """Per-token values [K, ...] of the packed response tokens -> [B, t_used, ...], zeros where no token is: an
    `index_copy` at the slots found on the host (boolean indexing, or a masked scatter's backward, would ask the device
    for its count: a host sync)."""
    b, t = rows.keep.shape
    flat = packed.new_zeros((b * t, *packed.shape[1:])).index_copy(0, rows.slots, packed)
    return flat.view(b, t, *packed.shape[1:])
