"""Rollout: turn prompts into sampled completions with per-token logprobs.

`build_rollout_engine(name, model, tokenizer, **options)` picks an engine by the config's
`actor_rollout_ref.rollout.name`; engines are imported only when chosen (vLLM is an optional extra).
"""

from __future__ import annotations

import difflib
import importlib

from tiller.errors import ConfigError
from tiller.rollout.base import RolloutEngine, RolloutOutput, SamplingParams

ENGINES: dict[str, str] = {
    "native": "tiller.rollout.native:NativeRolloutEngine",
    "hf": "tiller.rollout.hf:HFRolloutEngine",
    "vllm": "tiller.rollout.vllm_engine:VLLMRolloutEngine",
}


def build_rollout_engine(name: str, model, tokenizer=None, **options) -> RolloutEngine:
    """Build the engine called `name` around `model` (an HF causal LM module, or a model dir for vllm).

    Options common to the built-in engines: `dtype` ("bfloat16" | "float32" | None = the model's),
    `seed` (the generator used when a call's `SamplingParams.seed` is None). See each engine for more.
    """
    if name not in ENGINES:
        close = difflib.get_close_matches(name, ENGINES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"actor_rollout_ref.rollout.name: unknown engine {name!r}{hint}; choose one of {sorted(ENGINES)}"
        )
    module_name, cls_name = ENGINES[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(model, tokenizer, **options)


__all__ = ["ENGINES", "RolloutEngine", "RolloutOutput", "SamplingParams", "build_rollout_engine"]
