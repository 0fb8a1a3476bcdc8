"""Micro-batches of a worker's batch: fixed row counts, or token budgets (verl's `use_dynamic_bsz`).

`split_micro_batches(batch, rows=..., max_tokens=None)` cuts `batch` into micro-batches of `rows` samples
(contiguous, as `Batch.split`). With `max_tokens` it packs them by padded size instead: each micro-batch
holds at most `max_tokens` tokens of rows x (longest prompt + longest response) among its rows (an image
prompt's length counts its image tokens: one per merged patch, as they are in the sequence), which is
what the trimmed, padded forward (`tiller.workers.common.response_forward`) materialises, so peak memory
follows the budget rather than the row count. Samples of one prompt stay together while they fit
(`tiller.data.seqlen.token_budget_micro_batches`), so the shared-prompt forward still runs each prompt
once per micro-batch; a group too large for the budget is split into pieces (longest responses first),
each piece still sharing its prompt.

The update stays exact: every loss is normalised with the mini-batch's global token / sequence counts
(`global_counts`), so how a mini-batch is cut into micro-batches does not change the accumulated gradient.

Under torch.distributed every rank must run the same number of forwards (FSDP2 all-gathers, DDP buffer
broadcasts), as verl does (`rearrange_micro_batches`, max over the data-parallel group): ranks agree on the
largest count, a rank with fewer micro-batches halves its largest ones, and when it runs out of rows to
split it runs extra copies of one row with an all-zero response mask (they add nothing to the loss and
their outputs are dropped).

Letters: `B` samples, `P` prompt width, `T` response width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiller.data.seqlen import token_budget_micro_batches
from tiller.distributed import context as dist_ctx
from tiller.errors import ConfigError
from tiller.protocol import Batch
from tiller.workers.common import image_keys, response_lengths


@dataclass
class MicroBatches:
    """The micro-batches of a batch and how to put per-row outputs back in the batch's order."""

    batches: list[Batch]
    indices: list[torch.Tensor]  # rows of the batch in each micro-batch (a padding copy: row 0)
    padding: list[bool]  # micro-batches that only keep ranks in step (outputs dropped)

    def restore(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """Per-micro-batch outputs `[b_i, ...]` -> `[B, ...]` in the batch's row order."""
        kept = [(o, idx) for o, idx, pad in zip(outputs, self.indices, self.padding) if not pad]
        stacked = torch.cat([o for o, _ in kept], dim=0)
        order = torch.cat([idx for _, idx in kept]).to(stacked.device)
        out = torch.empty_like(stacked)
        out[order] = stacked
        return out


def prompt_units(batch: Batch) -> torch.Tensor:
    """[B] id of each row's prompt (tokens and padding, and images), as the shared-prompt forward groups them."""
    P = batch["prompts"].shape[1]
    key = torch.cat([batch["input_ids"][:, :P], batch["attention_mask"][:, :P].long()], dim=1)
    if "multi_modal_inputs" in batch:  # image prompts: the same text over other images is another prompt
        key = torch.cat([key, image_keys(list(batch["multi_modal_inputs"]), len(key), key.device)], dim=1)
    return torch.unique(key, dim=0, return_inverse=True)[1]


def token_budget_indices(batch: Batch, max_tokens: int, key: str = "") -> list[torch.Tensor]:
    """Rows of each token-budget micro-batch of `batch` (see the module docstring)."""
    P = batch["prompts"].shape[1]
    prompt_lens = batch["attention_mask"][:, :P].sum(-1).tolist()
    response_lens = response_lengths(batch["response_mask"]).clamp(min=1).tolist()
    try:
        parts = token_budget_micro_batches(prompt_lens, response_lens, prompt_units(batch).tolist(), max_tokens)
    except ValueError as err:
        raise ConfigError(f"{key or 'token budget'}={max_tokens}: {err}; raise it") from None
    return [torch.tensor(p, dtype=torch.long) for p in parts]


def split_micro_batches(batch: Batch, *, rows: int, max_tokens: int | None = None, key: str = "") -> MicroBatches:
    """Micro-batches of `rows` samples, or of at most `max_tokens` padded tokens (`key`: the config key of
    the budget, for errors). Ranks of a torch.distributed group get the same number of micro-batches."""
    if max_tokens is None:
        indices = [torch.arange(s, min(s + rows, len(batch))) for s in range(0, len(batch), rows)]
    else:
        indices = token_budget_indices(batch, max_tokens, key)
    padding = [False] * len(indices)
    if max_tokens is not None and dist_ctx.is_distributed():
        target = max(dist_ctx.all_gather_object(len(indices)))
        while len(indices) < target:
            largest = max(range(len(indices)), key=lambda j: (len(indices[j]) if not padding[j] else 0, -j))
            if len(indices[largest]) > 1 and not padding[largest]:
                part = indices.pop(largest)
                padding.pop(largest)
                half = len(part) // 2
                indices[largest:largest] = [part[:half], part[half:]]
                padding[largest:largest] = [False, False]
            else:
                indices.append(torch.zeros(1, dtype=torch.long))
                padding.append(True)
    batches = []
    for idx, pad in zip(indices, padding):
        mb = batch.index(idx)
        if pad:
            mb["response_mask"] = torch.zeros_like(mb["response_mask"])
        batches.append(mb)
    return MicroBatches(batches, indices, padding)


def lane_rows(n: int, rows: int, lanes: int) -> int:
    """Rows per micro-batch when `n` samples in micro-batches of at most `rows` run in `lanes` parallel lanes:
    the micro-batch count rounded up to a multiple of the lanes, the rows shared evenly (200 samples, rows 128,
    2 lanes: 2 micro-batches of 100; 16, 16, 2: 2 of 8)."""
    if lanes <= 1 or not rows:
        return rows
    count = -(-n // rows)
    return max(1, -(-n // (-(-count // lanes) * lanes)))


__all__ = ["MicroBatches", "split_micro_batches", "token_budget_indices", "prompt_units", "lane_rows"]
