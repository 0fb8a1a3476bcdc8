"""Sequence-length balancing: split items into parts of equal total length, or into token budgets.

Pure functions on lists of lengths (no tensors, no config), used for verl's `trainer.balance_batch`
(`balanced_order`) and `use_dynamic_bsz`:

- `balanced_partitions(weights, k, equal_size)`: k parts whose weight sums are as equal as the largest
  differencing method (Karmarkar & Karp 1982) makes them; verl's `get_seqlen_balanced_partitions`. With
  `equal_size` every part has len / k items.
- `token_budget_micro_batches(prompt_lens, response_lens, units, budget)`: micro-batches whose padded size,
  rows x (longest prompt + longest response), stays within `budget` tokens (what a padded forward
  materialises: tiller pads each micro-batch and trims it to the columns its rows use). Rows of one unit
  (the samples of one prompt) stay in one micro-batch while it fits, so the shared-prompt forward still
  runs each prompt once. First-fit decreasing over units. verl's `rearrange_micro_batches` instead picks
  ceil(total tokens / budget) parts and balances them, which suits its padding-free kernels; with padding
  the bound has to be on the padded size.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def balanced_partitions(weights: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Indices of `weights` in k parts with near-equal sums (each part's indices sorted).

    Largest differencing method: every item starts as a k-tuple of parts (the item in one, the rest
    empty; with `equal_size` a tuple holds the next k items in sorted order, one per part); the two
    tuples with the largest spread (max part - min part) are merged, the heaviest part of one with the
    lightest of the other, until one tuple is left.

    >>> balanced_partitions([8, 7, 6, 5, 4], 2)  # sums 16 and 14 (the optimum, 15 / 15, is not guaranteed)
    [[1, 3, 4], [0, 2]]
    >>> balanced_partitions([1, 1, 9, 9], 2, equal_size=True)
    [[0, 3], [1, 2]]
    """
    n = len(weights)
    if k < 1 or n < k:
        raise ValueError(f"cannot split {n} items into {k} non-empty parts")
    if equal_size and n % k:
        raise ValueError(f"{n} items do not split into {k} parts of equal size")
    order = sorted(range(n), key=lambda i: (weights[i], i))
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    count = 0

    def push(parts: list[tuple[float, list[int]]]) -> None:
        nonlocal count
        parts.sort(key=lambda p: (-p[0], p[1]))
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), count, parts))
        count += 1

    step = k if equal_size else 1
    for start in range(0, n, step):
        items = order[start:start + step]
        parts = [(float(weights[i]), [i]) for i in items] + [(0.0, []) for _ in range(k - len(items))]
        push(parts)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # heaviest of a with lightest of b, and so on (both sorted heaviest first)
        push([(wa + wb, ia + ib) for (wa, ia), (wb, ib) in zip(a, reversed(b))])
    parts = [sorted(idx) for _, idx in heap[0][2]]
    if any(not p for p in parts):
        raise ValueError(f"cannot split {n} items into {k} non-empty parts")
    return parts


def token_budget_micro_batches(prompt_lens: Sequence[int], response_lens: Sequence[int], units: Sequence[int],
                               budget: int) -> list[list[int]]:
    """Row indices of each micro-batch, padded size rows x (max prompt + max response) <= `budget`.

    prompt_lens, response_lens: [B] real tokens of each row; units: [B] rows with the same id (the samples
    of one prompt) are kept together while they fit. Raises ValueError when one row alone exceeds the
    budget. Micro-batches come in order of their first row, rows in order.

    >>> token_budget_micro_batches([2, 2, 3, 3], [4, 1, 2, 2], [0, 0, 1, 1], budget=12)
    [[0, 1], [2, 3]]
    >>> token_budget_micro_batches([2, 2, 3, 3], [4, 1, 2, 2], [0, 0, 1, 1], budget=6)
    [[0], [1], [2], [3]]
    """
    n = len(prompt_lens)
    for i in range(n):
        if prompt_lens[i] + response_lens[i] > budget:
            raise ValueError(f"a sequence of {prompt_lens[i] + response_lens[i]} tokens does not fit a micro-batch "
                             f"budget of {budget} tokens")
    by_unit: dict[int, list[int]] = {}
    for i, u in enumerate(units):
        by_unit.setdefault(int(u), []).append(i)
    pieces: list[list[int]] = []
    for rows in by_unit.values():
        pieces.extend(_split_to_budget(rows, prompt_lens, response_lens, budget))

    def width(rows: list[int]) -> tuple[int, int]:
        return max(prompt_lens[i] for i in rows), max(response_lens[i] for i in rows)

    pieces.sort(key=lambda rows: (-sum(width(rows)), -len(rows), rows[0]))
    bins: list[tuple[list[int], int, int]] = []  # (rows, max prompt, max response)
    for rows in pieces:
        p, r = width(rows)
        for j, (b_rows, bp, br) in enumerate(bins):
            if (len(b_rows) + len(rows)) * (max(bp, p) + max(br, r)) <= budget:
                bins[j] = (b_rows + rows, max(bp, p), max(br, r))
                break
        else:
            bins.append((list(rows), p, r))
    return sorted((sorted(rows) for rows, _, _ in bins), key=lambda rows: rows[0])


def _split_to_budget(rows: list[int], prompt_lens: Sequence[int], response_lens: Sequence[int],
                     budget: int) -> list[list[int]]:
    """One unit's rows, in pieces that each fit the budget (longest responses first when it must split)."""
    p = max(prompt_lens[i] for i in rows)
    if len(rows) * (p + max(response_lens[i] for i in rows)) <= budget:
        return [rows]
    out: list[list[int]] = []
    for i in sorted(rows, key=lambda i: (-response_lens[i], i)):
        if out:
            cur = out[-1]
            width = max(prompt_lens[j] for j in cur + [i]) + max(response_lens[j] for j in cur + [i])
            if (len(cur) + 1) * width <= budget:
                cur.append(i)
                continue
        out.append([i])
    return out


def balanced_order(tokens: Sequence[int], groups: Sequence[str], k: int) -> tuple[list[int], dict[str, float]]:
    """A row order whose k contiguous equal shares hold near-equal token sums (`trainer.balance_batch`).

    tokens: [B] tokens of each row (prompt + response); groups: [B] group id of each row (the samples of one
    prompt). Whole groups move together when they split evenly over the k shares (equal-size groups, a
    multiple of k of them), else single rows do. Also returns verl's `global_seqlen/*` metrics: min / max /
    minmax_diff of the shares before, balanced_min / balanced_max after, mean. B must be a multiple of k.

    >>> balanced_order([10, 10, 9, 9, 2, 2, 3, 3], ["a", "a", "b", "b", "c", "c", "d", "d"], 2)[0]
    [0, 1, 4, 5, 2, 3, 6, 7]
    """
    n = len(tokens)
    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    units = list(members.values())
    if len(units) % k or len({len(u) for u in units}) != 1:
        units = [[i] for i in range(n)]
    parts = balanced_partitions([sum(tokens[i] for i in u) for u in units], k, equal_size=True)
    order = [i for part in parts for u in part for i in units[u]]
    share = n // k
    before = [sum(tokens[j * share:(j + 1) * share]) for j in range(k)]
    after = [sum(tokens[i] for i in order[j * share:(j + 1) * share]) for j in range(k)]
    metrics = {"global_seqlen/min": float(min(before)), "global_seqlen/max": float(max(before)),
               "global_seqlen/minmax_diff": float(max(before) - min(before)),
               "global_seqlen/balanced_min": float(min(after)), "global_seqlen/balanced_max": float(max(after)),
               "global_seqlen/mean": float(sum(tokens)) / k}
    return order, metrics


__all__ = ["balanced_partitions", "balanced_order", "token_budget_micro_batches"]
