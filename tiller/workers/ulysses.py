"""Ulysses sequence parallelism for the actor's packed forward (verl's `ulysses_sequence_parallel_size`).

DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509) as verl runs it: the `S` ranks of a sequence-parallel
group hold the same micro-batch; its rows are packed into one sequence (`tiller.workers.packed`), padded to a
multiple of S, and each rank runs the model on its contiguous 1/S of the tokens. Everything but attention is per
token, so it runs on the slice as is (rotary embeddings take each token's own position id). Attention needs the
whole sequence: before it, one all-to-all turns "my tokens, all heads" into "all tokens, my 1/S of the heads", the
packed attention (each row causal over its own tokens) runs on that, and a second all-to-all turns it back. Layer
activations, the LM head and the logits are 1/S per rank; the parameters are FSDP2's (sharded over all ranks).

The LM head runs only on the positions of this rank's slice that predict a response token. The per-token results
(log-probs, entropies, ...) are computed there and gathered over the group (`SeqLayout.gather`), so the logits of
the whole micro-batch never exist on one rank. Every rank of the group then computes the same loss; the gather's
backward hands each rank the gradient of its own slice, so the group's parameter gradients sum to the gradient of
that loss, and the ranks' sum (tiller's convention, `tiller.distributed.context`) over the data-parallel groups is
the data-parallel gradient. Global token and sequence counts are summed over the data-parallel group only (the
group's ranks hold copies of the same rows): `context.set_data_group`.

Requirements (checked at start): `actor_rollout_ref.model.use_remove_padding=True` (verl asserts it too), the world
size a multiple of S, the attention heads a multiple of S (key / value heads that are not are repeated up to the
query heads, as verl does), text rows (image rows keep the padded forward, which has no sequence split).

Letters: `S` group size, `N` packed tokens (padded to a multiple of S), `n = N / S` tokens per rank, `K` positions
that predict a response token, `V` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tiller.distributed import context
from tiller.errors import ConfigError
from tiller.protocol import to_device
from tiller.workers.packed import attention_switch, head_at, pack_micro_batch


@dataclass(frozen=True)
class SeqParallel:
    """This rank's sequence-parallel group: `size` consecutive ranks, this one at `rank` within it."""

    group: Any
    size: int
    rank: int

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """query [1, Hq, n, D], key / value [1, Hk, n, D] (this rank's tokens) -> [1, n, Hq, D]; `attend` runs the
        packed attention on [1, h, N, D] tensors (all tokens, a share of the heads) and returns [1, N, h, D]."""
        hq, hk = query.shape[1], key.shape[1]
        if hk % self.size:  # too few key / value heads to split: repeat them up to the query heads
            key, value = key.repeat_interleave(hq // hk, dim=1), value.repeat_interleave(hq // hk, dim=1)
        q, k, v = (_seq_to_heads(x[0], self) for x in (query, key, value))
        out = attend(q[None], k[None], v[None])  # [1, N, Hq / S, D]
        return _heads_to_seq(out[0].transpose(0, 1), self).transpose(0, 1)[None]


def seq_parallel_groups(size: int, key: str = "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
                        data_group: bool = True) -> SeqParallel | None:
    """Split the world into groups of `size` consecutive ranks (sequence parallel) and, with `data_group` (the RL
    workers, whose group ranks hold copies of the same rows and compute the same per-row sums), make the ranks at the
    same place of every group the data-parallel group (`context.set_data_group`). None when `size` is 1.
    Every rank must call it (process-group creation is collective)."""
    if size <= 1:
        return None
    world, me = context.world_size(), context.rank()
    if world % size:
        raise ConfigError(f"{key}={size} does not divide the {world} workers (trainer.nnodes x "
                          "trainer.n_gpus_per_node)")
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= me < first + size:
            mine = SeqParallel(group, size, me - first)
    for place in range(size if data_group else 0):
        group = dist.new_group(list(range(place, world, size)))
        if me % size == place:
            context.set_data_group(group)
    return mine


def check_heads(config, size: int, key: str | None = None) -> None:
    """The attention heads must split evenly over the group (checked when the worker starts)."""
    text = getattr(config, "text_config", None) or config
    heads = getattr(text, "num_attention_heads", None)
    key = key or f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={size}"
    if heads is not None and heads % size:
        raise ConfigError(f"{key}: the model's {heads} attention heads do not split evenly over {size} ranks")


class _AllToAll(torch.autograd.Function):
    """x [S, ...] -> y [S, ...] with y[i] = rank i's x[me] (equal splits); its own inverse, so also its backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
        ctx.sp = sp
        return _all_to_all(x, sp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.sp), None


def _all_to_all(x: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=sp.group)
    return out


def _seq_to_heads(x: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
    """[H, n, D] (my tokens, every head) -> [H / S, N, D] (every token in rank order, my heads)."""
    h, n, d = x.shape
    y = _AllToAll.apply(x.reshape(sp.size, h // sp.size, n, d), sp)  # y[i]: rank i's tokens of my heads
    return y.transpose(0, 1).reshape(h // sp.size, sp.size * n, d)


def _heads_to_seq(x: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
    """[H / S, N, D] (every token, my heads) -> [H, n, D] (my tokens, every head in rank order)."""
    h, big_n, d = x.shape
    n = big_n // sp.size
    y = _AllToAll.apply(x.reshape(h, sp.size, n, d).transpose(0, 1), sp)  # y[i]: rank i's heads of my tokens
    return y.reshape(sp.size * h, n, d)


class _Gather(torch.autograd.Function):
    """x [k, ...] on every rank of the group -> [S, k, ...]; backward: this rank's part of the group's mean
    gradient (every rank computes the same loss from the gathered values, so each rank's gradient is the loss's)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
        ctx.sp = sp
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.sp.group)
        return grad[ctx.sp.rank] / ctx.sp.size, None


@dataclass
class SeqLayout:
    """Where this rank's LM-head outputs sit in the micro-batch: `keep [B, t]` the response slots that have a
    predicting position (row-major order = packed order), `slots [K]` their indices in the flattened [B * t] (on the
    device: indexing by them asks the device for nothing, where a boolean index syncs), `counts[i]` how many of them
    rank i holds."""

    keep: torch.Tensor
    slots: torch.Tensor
    t_used: int
    counts: list[int]
    sp: SeqParallel

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, t, ...] -> this rank's kept slots [k, ...] (one placeholder row when it holds none, as the LM head
        ran on one placeholder position there)."""
        first, count = sum(self.counts[: self.sp.rank]), self.counts[self.sp.rank]
        flat = x.reshape(-1, *x.shape[2:])
        return flat.index_select(0, self.slots[first: first + count]) if count else flat[:1]

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """values [k, ...] (this rank's kept slots, as `local`) -> [B, t, ...] over the whole micro-batch (zeros at
        slots without a predicting position), differentiable."""
        width = max(max(self.counts), 1)
        padded = F.pad(values, (0, 0) * (values.dim() - 1) + (0, width - len(values)))
        parts = _Gather.apply(padded, self.sp)
        kept = torch.cat([parts[i, :c] for i, c in enumerate(self.counts)])
        b, t = self.keep.shape
        return kept.new_zeros((b * t, *kept.shape[1:])).index_copy(0, self.slots, kept).view(b, t, *kept.shape[1:])


def ulysses_response_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                             response_mask: torch.Tensor, sp: SeqParallel,
                             logits_to_keep: bool = True, device=None) -> tuple[torch.Tensor, SeqLayout]:
    """`packed_response_forward` on this rank's slice of the packed micro-batch: (logits [k, V] of the slice's
    response-predicting positions, in packed order; one placeholder row when it has none, and the layout to gather
    per-token results with). input_ids, attention_mask [B, P + T] (the same on every rank of the group), on the
    host (packed and sliced there, the slice moved to `device`) or on `device` (default: theirs).
    A value model (logits_to_keep False): V = 1, its values at those positions."""
    device = input_ids.device if device is None else device
    flat_ids, positions, predictor, keep, lengths, t_used = pack_micro_batch(input_ids, attention_mask, prompt_width,
                                                                             response_mask)
    total = flat_ids.shape[1]
    n = -(-total // sp.size)
    pad = n * sp.size - total
    lengths = lengths + ([pad] if pad else [])  # the padding: a row of its own
    flat_ids = F.pad(flat_ids, (0, pad))
    positions = torch.cat([positions, torch.arange(pad, device=positions.device)[None]], dim=1)
    cu = to_device(torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32), device)
    kept = predictor[keep]  # increasing packed positions
    bounds = torch.searchsorted(kept, torch.arange(sp.size + 1, device=kept.device) * n).tolist()
    counts = [b - a for a, b in zip(bounds, bounds[1:])]
    lo = sp.rank * n
    mine = kept[bounds[sp.rank]: bounds[sp.rank + 1]] - lo
    if not len(mine):  # a slice of prompt tokens only: one placeholder position keeps the LM head in the graph
        mine = torch.zeros(1, dtype=torch.long, device=flat_ids.device)
    mine, ids, pos, slots = (to_device(x, device) for x in (mine, flat_ids[:, lo: lo + n], positions[:, lo: lo + n],
                                                            keep.reshape(-1).nonzero().squeeze(-1)))
    with attention_switch(model.config, (lengths, cu, max(lengths)), sp):
        out = head_at(model, mine, logits_to_keep, input_ids=ids, attention_mask=None, position_ids=pos,
                      use_cache=False)
    return out, SeqLayout(keep, slots, t_used, counts, sp)


def ulysses_token_forward(model, ids: torch.Tensor, positions: torch.Tensor, lengths: list[int], sp: SeqParallel,
                          *per_token: torch.Tensor, fill: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The whole-sequence forward of packed tokens (SFT): ids, positions [N] of sequences of `lengths` (summing to
    N) laid end to end; this rank runs its 1/S of them. Returns (logits [n, V] of this rank's tokens, each of
    `per_token` [N] cut to the same tokens, padding positions filled with `fill`). A loss summed over a rank's tokens
    and divided by a global count sums, over the group, to the whole sequence's."""
    total = ids.numel()
    n = -(-total // sp.size)
    pad = n * sp.size - total
    lengths = [x for x in lengths if x > 0] + ([pad] if pad else [])
    ids = F.pad(ids, (0, pad))
    positions = torch.cat([positions, torch.arange(pad, device=positions.device)])
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(ids.device)
    lo = sp.rank * n
    with attention_switch(model.config, (lengths, cu, max(lengths)), sp):
        out = model(input_ids=ids[None, lo: lo + n], position_ids=positions[None, lo: lo + n], attention_mask=None,
                    use_cache=False)
    return out.logits[0], [F.pad(x, (0, pad), value=fill)[lo: lo + n] for x in per_token]


def gather_tokens(values: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
    """Per-token values [n, ...] of this rank's slice (`ulysses_token_forward`) -> [S n, ...] of the whole padded
    sequence in order, on every rank of the group (differentiable: each rank gets its own slice's gradient)."""
    parts = _Gather.apply(values, sp)
    return parts.reshape(-1, *values.shape[1:])
