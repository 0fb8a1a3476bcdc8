"""trainer.balance_batch: the step's batch reordered so each data-parallel worker's contiguous share holds
near-equal tokens (verl's `_balance_batch`); whole groups move when the groups split evenly over workers.
The 2-worker Ray run is in tests/distributed/test_rl_ray.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tiller.protocol import Batch
from tiller.trainer.rl import RLTrainer


def _batch(lengths: list[int], n: int) -> Batch:
    width = max(lengths)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    uids = [f"g{i // n}" for i in range(len(lengths))]
    return Batch({"attention_mask": mask, "row": torch.arange(len(lengths))}, {"uid": uids})


def _balance(batch: Batch, world: int) -> tuple[Batch, dict]:
    m: dict = {}
    return RLTrainer._balance_batch(SimpleNamespace(world_size=world), batch, m), m


def test_groups_move_together_and_tokens_balance():
    # 4 groups of 2, token totals 20, 18, 4, 6: the contiguous halves hold 38 and 10 tokens;
    # two groups per worker: {20, 4} and {18, 6} = 24 and 24
    lengths = [10, 10, 9, 9, 2, 2, 3, 3]
    out, m = _balance(_batch(lengths, n=2), world=2)
    rows = out["row"].tolist()
    assert sorted(rows) == list(range(8))
    pairs = [tuple(sorted(rows[i:i + 2])) for i in range(0, 8, 2)]
    assert all(b == a + 1 and a % 2 == 0 for a, b in pairs)  # groups stay whole and adjacent
    tokens = out["attention_mask"].sum(-1)
    assert (int(tokens[:4].sum()), int(tokens[4:].sum())) == (24, 24)
    assert m["global_seqlen/minmax_diff"] == 28 and m["global_seqlen/balanced_max"] == m["global_seqlen/balanced_min"] == 24
    assert m["global_seqlen/mean"] == 24


def test_rows_move_when_groups_do_not_split_evenly():
    lengths = [9, 1, 8, 2, 7, 3]  # 3 groups of 2 over 2 workers: by rows, 3 rows each
    out, m = _balance(_batch(lengths, n=2), world=2)
    tokens = out["attention_mask"].sum(-1)
    assert abs(int(tokens[:3].sum()) - int(tokens[3:].sum())) <= 2
    assert len(out) == 6
