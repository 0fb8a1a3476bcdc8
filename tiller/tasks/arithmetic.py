"""The demo task `tiller/arithmetic`: two-digit addition, scored by exact match of the last integer.

A prompt is one user turn `"47+38="`; the ground truth is the sum as a string (`"85"`). The scorer
(owned by `tiller.rewards`, data_source `tiller/arithmetic`) gives 1.0 when the last integer in the
response equals it. Train and test sets are disjoint: all (a, b) pairs with 10 <= a, b <= 99 are shuffled
with the seed and split, so held-out accuracy measures generalisation, not recall.
"""

from __future__ import annotations

import random
from pathlib import Path

from tiller.data.rl_dataset import write_rows

DATA_SOURCE = "tiller/arithmetic"


def make_row(a: int, b: int, split: str, index: int) -> dict:
    """One verl-schema row for `a + b`."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{a}+{b}="}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def n_pairs(lo: int = 10, hi: int = 99) -> int:
    """How many distinct (a, b) pairs the task draws from."""
    return (hi - lo + 1) ** 2


def make_splits(n_train: int = 2000, n_test: int = 256, seed: int = 0, lo: int = 10,
                hi: int = 99) -> tuple[list[dict], list[dict]]:
    """Disjoint train / test rows drawn from all pairs in [lo, hi]^2 (seeded)."""
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    if n_train + n_test > len(pairs):
        raise ValueError(f"only {len(pairs)} distinct pairs; asked for {n_train} + {n_test}")
    random.Random(seed).shuffle(pairs)
    test = [make_row(a, b, "test", i) for i, (a, b) in enumerate(pairs[:n_test])]
    train = [make_row(a, b, "train", i) for i, (a, b) in enumerate(pairs[n_test:n_test + n_train])]
    return train, test


def write_task(out_dir: str | Path, n_train: int = 2000, n_test: int = 256, seed: int = 0) -> dict[str, Path]:
    """Write `out_dir/{train,test}.parquet`; returns the paths."""
    train, test = make_splits(n_train, n_test, seed)
    out = Path(out_dir)
    return {"train": write_rows(train, out / "train.parquet"), "test": write_rows(test, out / "test.parquet")}
