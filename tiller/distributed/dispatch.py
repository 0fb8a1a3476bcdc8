"""How a worker-group call is split over ranks and how the rank results are put back together.

Dispatch modes (verl's ``Dispatch.ONE_TO_ALL`` / ``DP_COMPUTE_PROTO`` / ``RANK_ZERO``, plus ``all``):

- ``broadcast``: every rank gets the same arguments; the caller gets rank 0's result.
- ``dp``: the first positional argument is a `Batch`; it is padded (by cycling its first rows) to a
  multiple of the world size and cut into ``world_size`` consecutive equal chunks, chunk r to rank r.
  Batch results are concatenated in rank order and the padding rows dropped (a method that returns k
  rows per input row, e.g. n samples per prompt, must keep them in input order); dict results (metrics)
  come from rank 0 (ranks agree after their all-reduce); tuples are merged element by element.
  Padding duplicates rows, so training calls should pass batches whose length is a multiple of the
  world size (then no padding happens and the update equals the one-process update).
  With ``replicas=S`` (sequence parallelism: groups of S consecutive ranks share their rows), the batch is cut
  into ``world_size / S`` chunks, chunk g going to every rank of group g, and the results of each group's first
  rank are merged.
- ``dp_parts``: split as ``dp``, but the caller gets the list of rank results unmerged (rank order), for
  results whose rows per input row vary or whose widths differ by rank (agent episodes: the driver merges
  them with `tiller.trainer.episode_merge.merge_episode_parts`); the padding inputs were the last ones.
- ``rank0``: only rank 0 runs (it must not call collectives).
- ``all``: every rank gets the same arguments; the caller gets the list of all rank results.
"""

from __future__ import annotations

from typing import Any

from tiller.errors import ConfigError

DISPATCH_MODES = ("broadcast", "dp", "dp_parts", "rank0", "all")


def check_mode(dispatch: str) -> None:
    if dispatch not in DISPATCH_MODES:
        raise ConfigError(f"dispatch mode {dispatch!r} is not one of {', '.join(DISPATCH_MODES)}")


def split_dp(args: tuple, world_size: int, replicas: int = 1) -> tuple[list[tuple], int, int]:
    """Per-rank positional args for "dp": ``(per_rank_args, pad, padded_len)``; with `replicas`, each chunk goes
    to that many consecutive ranks."""
    if not args or not hasattr(args[0], "pad_to_multiple"):
        got = type(args[0]).__name__ if args else "no arguments"
        raise TypeError(f"dispatch='dp' needs a Batch as the first positional argument, got {got}")
    if replicas < 1 or world_size % replicas:
        raise ConfigError(f"dispatch replicas={replicas} does not divide the world size {world_size}")
    batch, rest = args[0], args[1:]
    padded, pad = batch.pad_to_multiple(world_size // replicas)
    chunks = padded.chunk(world_size // replicas)
    return [(chunks[r // replicas], *rest) for r in range(world_size)], pad, len(padded)


def _is_batch(x: Any) -> bool:
    return hasattr(x, "pad_to_multiple") and hasattr(x, "unpad")


def merge_dp(results: list, pad: int, padded_len: int):
    """Put the rank results of a "dp" call back together (see the module docstring)."""
    first = results[0]
    if _is_batch(first):
        merged = type(first).concat(results)
        if pad and padded_len and len(merged) % padded_len == 0:
            # k output rows per input row, in input order (e.g. n samples per prompt): drop the pad's
            return merged.unpad(pad * (len(merged) // padded_len))
        return merged
    if isinstance(first, tuple):
        return tuple(merge_dp([r[i] for r in results], pad, padded_len) for i in range(len(first)))
    return first


class WorkerError(RuntimeError):
    """A worker raised, or its process died, during a call; the message names group, rank and method."""

    def __init__(self, message: str, *, group: str, rank: int, method: str, died: bool = False):
        super().__init__(message)
        self.group, self.rank, self.method, self.died = group, rank, method, died
