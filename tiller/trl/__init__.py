"""Hugging Face TRL's trainers on tiller: `from tiller.trl import GRPOConfig, GRPOTrainer` in place of
`from trl import ...` runs a TRL script on tiller's trainers, with TRL's argument names and defaults (docs/trl.md).
TRL's command line (`trl grpo --model_name_or_path ...`) is `tiller trl grpo ...` (`tiller.trl.cli`); TRL's built-in
reward functions are `tiller.trl.reward_funcs`.

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
    "DistillationConfig": "tiller.trl.distillation", "DistillationTrainer": "tiller.trl.distillation",
    # trl.experimental's (their TRL import path: tiller.trl.experimental.cpo / .orpo)
    "CPOConfig": "tiller.trl.experimental.cpo", "CPOTrainer": "tiller.trl.experimental.cpo",
    "ORPOConfig": "tiller.trl.experimental.orpo", "ORPOTrainer": "tiller.trl.experimental.orpo",
    # the dataclasses TRL's command-line scripts parse (`tiller trl COMMAND`, tiller.trl.cli)
    "ScriptArguments": "tiller.trl.script_args", "GRPOScriptArguments": "tiller.trl.script_args",
    "RLOOScriptArguments": "tiller.trl.script_args", "ModelConfig": "tiller.trl.script_args",
    "DatasetMixtureConfig": "tiller.trl.script_args",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tiller.trl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
