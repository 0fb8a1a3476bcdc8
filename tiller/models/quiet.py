"""Library messages that say nothing to a tiller user, quieted where tiller knows they are expected."""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """peft's warnings while it wraps a model: it reads transformers' deprecated is_gradient_checkpointing (5.24),
    and its transformers-5 MoE conversion (a Mixtral's / Qwen3-MoE's w1 + w3 fused into gate_up_proj at twice the
    rank) warns that its rank / alpha pattern matched no *module*, then applies it to the expert parameters."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*_pattern keys did not match any targeted module.*",
                                category=RuntimeWarning)
        yield


@contextlib.contextmanager
def fresh_head() -> Iterator[None]:
    """transformers' loading report at error level only: loading a causal LM's checkpoint as a value / reward /
    classifier model, the new head is missing from it by design (transformers would print a MISSING table)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
