"""Micro-batches for SFT: right-padded rows, or sequence packing without cross-contamination.

Packing puts several sequences into one row of at most `capacity` tokens (first-fit decreasing bin
packing: sequences longest first, each into the first row with room; deterministic), as in
TRL's `DataCollatorWithFlattening` / verl's `use_remove_padding`. Cross-contamination is prevented
twice over:

1. attention: `position_ids` restart at 0 at every sequence and the model is called with `use_cache=False`
   and, for the sdpa and eager implementations, tiller's own mask: causal within each sequence, with each layer
   kind's sliding window (`tiller.models.layer_masks.packed_masks`). transformers can infer the sequences from
   `position_ids` (`masking_utils.find_packed_sequence_indices`), but not in every model: gpt-oss's forward does
   not pass them to its mask functions, and its packed logits were off by 0.6 that way. FlashAttention
   implementations get `attention_mask=None` and read the boundaries from `position_ids`. A model with recurrent
   layers (Qwen3.5's Gated DeltaNet, Mamba) is refused: their state would cross sequences.
2. loss: the last token of a sequence has label -100 (`tiller.data.sft.shifted_labels`), so no
   position predicts the first token of the next sequence.

Trailing room in a row is filled with a pad "sequence" (its own position_ids from 0, labels -100).
Deviation: verl unpads to one flat row per micro-batch (flash-attn varlen); tiller keeps rows of
`capacity` tokens so memory per micro-batch stays bounded and micro-batch counts are predictable.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tiller.data.sft import IGNORE, SFTExample
from tiller.models.layer_masks import packed_masks
from tiller.models.vision import vision_inputs


def pack_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices of `lengths` grouped into bins whose lengths sum to <= capacity.

    A sequence longer than `capacity` gets a bin of its own. Ties keep input order (stable sort).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def collate_padded(examples: Sequence[SFTExample], pad_id: int) -> dict:
    """Right-padded rows: input_ids, attention_mask, labels, all [R, L] (L = longest example); with image
    conversations also `multi_modal` (per row None or {"pixel_values", "image_grid_thw"})."""
    length = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE, dtype=torch.long)
    attn = torch.zeros((len(examples), length), dtype=torch.long)
    for r, e in enumerate(examples):
        n = len(e.input_ids)
        ids[r, :n] = torch.tensor(e.input_ids)
        labels[r, :n] = torch.tensor(e.labels)
        attn[r, :n] = 1
    out = {"input_ids": ids, "attention_mask": attn, "labels": labels}
    if any(e.multi_modal is not None for e in examples):
        out["multi_modal"] = [e.multi_modal for e in examples]
    return out


def collate_packed(rows: Sequence[Sequence[SFTExample]], pad_id: int) -> dict[str, torch.Tensor]:
    """Each inner list becomes one row: input_ids, position_ids, labels [R, L] (L = longest row)."""
    length = max(sum(len(e.input_ids) for e in row) for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    pos = torch.zeros((len(rows), length), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for e in row:
            n = len(e.input_ids)
            ids[r, at:at + n] = torch.tensor(e.input_ids)
            labels[r, at:at + n] = torch.tensor(e.labels)
            pos[r, at:at + n] = torch.arange(n)
            at += n
        pos[r, at:] = torch.arange(length - at)  # the pad segment starts its own "sequence"
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def make_micro_batches(examples: Sequence[SFTExample], micro_batch_size: int, pad_id: int,
                       packing: bool = False, capacity: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Split one step's examples into micro-batches of `micro_batch_size` rows.

    Without packing a row is one example; with packing a row holds up to `capacity` tokens.
    """
    if not packing:
        return [collate_padded(examples[i:i + micro_batch_size], pad_id)
                for i in range(0, len(examples), micro_batch_size)]
    if capacity is None:
        raise ValueError("packing needs a row capacity")
    if any(e.multi_modal is not None for e in examples):
        raise ValueError("packing takes text sequences only (image conversations need per-sequence M-RoPE positions)")
    bins = pack_bins([len(e.input_ids) for e in examples], capacity)
    rows = [[examples[i] for i in b] for b in bins]
    return [collate_packed(rows[i:i + micro_batch_size], pad_id) for i in range(0, len(rows), micro_batch_size)]


def forward_logits(model, batch: dict) -> torch.Tensor:
    """Logits [R, L, V] of a padded (`attention_mask`) or packed (`position_ids`) micro-batch. Padded rows with
    images (`multi_modal`) take their pixels and the model's M-RoPE positions (`tiller.models.vision`)."""
    return forward_output(model, batch).logits


def forward_output(model, batch: dict, router_aux: bool = False):
    """The model's output for a micro-batch (as `forward_logits`); `router_aux`: a mixture-of-experts model also
    returns its router load-balancing loss (`output_router_logits=True`: `.aux_loss`, transformers'
    load_balancing_loss_func over the batch's tokens)."""
    extra = {"output_router_logits": True} if router_aux else {}
    if batch.get("multi_modal") is not None:
        vision, positions = vision_inputs(model, batch["input_ids"], batch["attention_mask"], batch["multi_modal"])
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=positions,
                     use_cache=False, **vision, **extra)
    if "position_ids" in batch:
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                     attention_mask=packed_masks(model, batch["position_ids"]), use_cache=False, **extra)
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False, **extra)


def flatten_micro_batch(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """A text micro-batch's sequences end to end: (ids [N], position ids [N], labels [N], sequence lengths). Padded
    rows (`attention_mask`) give their real tokens, one sequence a row; packed rows (`position_ids`) give every
    token, a sequence wherever the position ids restart (the trailing pad segment included, its labels -100)."""
    if "position_ids" in batch:
        pos = batch["position_ids"].reshape(-1)
        starts = (pos == 0).nonzero().squeeze(-1).tolist() + [len(pos)]
        lengths = [b - a for a, b in zip(starts, starts[1:])]
        return batch["input_ids"].reshape(-1), pos, batch["labels"].reshape(-1), lengths
    keep = batch["attention_mask"].bool()
    pos = (batch["attention_mask"].cumsum(-1) - 1)[keep]
    return batch["input_ids"][keep], pos, batch["labels"][keep], batch["attention_mask"].sum(-1).tolist()
