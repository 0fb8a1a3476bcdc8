"""NEFTune (Jain et al. 2023, arXiv 2310.05914): uniform noise on the input embeddings of a model in training.

Each forward in train mode adds U(-m, m) noise to the embedding output [B, L, d], m = alpha / sqrt(L d) (L: the
padded or packed row length), through transformers' own hook (`transformers.integrations.neftune`, what its
Trainer and TRL's trainers use for `neftune_noise_alpha`); eval mode adds nothing, so validation is noise-free.
`without_neftune` turns it off for one pass of the same module in train mode: a LoRA policy with its adapters
disabled is DPO's / KTO's reference, which must see the clean embeddings.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from tiller.models.lora import is_lora


def _embeddings(model: torch.nn.Module) -> torch.nn.Module:
    base = model.base_model.model if is_lora(model) else model
    return base.get_input_embeddings()


@contextmanager
def neftune(model: torch.nn.Module, alpha: float | None) -> Iterator[None]:
    """NEFTune noise on `model`'s input embeddings inside the block (nothing when alpha is None or 0)."""
    if not alpha:
        yield
        return
    from transformers.integrations.neftune import activate_neftune, deactivate_neftune

    handle = activate_neftune(model, float(alpha))
    try:
        yield
    finally:
        deactivate_neftune(model, handle)


@contextmanager
def without_neftune(model: torch.nn.Module) -> Iterator[None]:
    """The input embeddings in eval mode (so NEFTune's hook adds nothing) inside the block."""
    emb = _embeddings(model)
    was = emb.training
    emb.train(False)
    try:
        yield
    finally:
        emb.train(was)
