"""Hugging Face TRL's trainers on tiller: `from tiller.trl import GRPOConfig, GRPOTrainer` in place of
`from trl import ...` runs a TRL script on tiller's trainers, with TRL's argument names and defaults (docs/trl.md).

tiller does not import `trl`. Names load on first use (each trainer's module imports torch / transformers only
when its trainer is used)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "GRPOConfig": "tiller.trl.grpo", "GRPOTrainer": "tiller.trl.grpo",
    "RLOOConfig": "tiller.trl.rloo", "RLOOTrainer": "tiller.trl.rloo",
    "SFTConfig": "tiller.trl.sft", "SFTTrainer": "tiller.trl.sft",
    "DPOConfig": "tiller.trl.dpo", "DPOTrainer": "tiller.trl.dpo",
    "KTOConfig": "tiller.trl.kto", "KTOTrainer": "tiller.trl.kto",
    "RewardConfig": "tiller.trl.reward", "RewardTrainer": "tiller.trl.reward",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tiller.trl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
