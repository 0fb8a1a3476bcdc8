"""Fixtures of the SFT / RM / DPO / KTO tests: small data files and config builders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# 8 short question -> answer pairs a 1M-parameter model can memorise in a few dozen steps.
MEMO = [(f"What is {a} + {b}?", str(a + b)) for a, b in [(1, 2), (3, 4), (5, 1), (2, 7), (8, 1), (4, 4), (6, 3), (9, 0)]]


@pytest.fixture
def sft_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "sft.jsonl", [{"prompt": p, "response": r} for p, r in MEMO])


def job_overrides(model_dir, train, run_dir, **extra) -> list[str]:
    """key=value overrides of a small, fast job on the tiny model (console logger off)."""
    base = {
        "model.partial_pretrain": str(model_dir),
        "data.train_files": f"[{train}]",
        "trainer.default_local_dir": str(run_dir),
        "trainer.logger": "[jsonl]",
        "optim.lr_scheduler": "constant",
        "optim.weight_decay": 0.0,
    }
    base.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]
