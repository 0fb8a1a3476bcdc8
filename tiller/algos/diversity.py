"""DARLING diversity-aware rewards (Li et al. 2025, "Jointly Reinforcing Diversity and Quality in
Language Model Generations", arXiv 2509.02534).

A partitioner (in `tiller.rewards`) splits the n responses of each prompt into equivalence classes
(same meaning = same class). With d(y_i, y_j) = 1 when i and j are in different classes, the
paper's diversity of response i is the mean distance to the other n - 1 responses:

    Div_i = 1/(n-1) sum_{j != i} d(y_i, y_j) = (n - |class(i)|) / (n - 1)   in [0, 1]

(the 1/(n-1) is the normalisation: 1 = unlike every other response, 0 = all responses alike).
A prompt with a single response (n = 1) has Div = 1 by convention: nothing duplicates it, and with
multiplicative fusion its reward is left unchanged.

Fusion, applied to the scalar reward before the advantage estimator:
- `multiplicative` (the paper): r_i = quality_i * Norm(Div_i);
- `additive` (an option, not in the paper): r_i = quality_i + weight * Norm(Div_i).
The paper writes Norm(Div) and describes it as the normalised count of distinct responses; tiller
reads the 1/(n-1) averaging above as that normalisation, so `normalization="none"` (default) uses
Div as is. `"group_max"` (an option) (divide by the largest Div of the group, so the most novel response keeps its full
quality; a group whose Div are all 0 keeps Norm = 0).
With multiplicative fusion a negative quality becomes *more* negative for novel responses; use
rewards in [0, 1] as the paper does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tiller.algos.utils import group_counts, group_ids
from tiller.errors import ConfigError, DataError

FUSION_MODES = ("multiplicative", "additive")
NORMALIZATIONS = ("none", "group_max")


def diversity_from_partition(class_ids: Any, group_index: Any) -> torch.Tensor:
    """Div_i = (n - |class(i)|) / (n - 1) within each group; 1 for a singleton group.

    Args:
        class_ids: [B] class label of each response (ints or strings); labels are only compared
            within a group, so the same label in two groups means nothing.
        group_index: [B] prompt label of each response.
    Returns:
        diversity [B] float32 in [0, 1].
    """
    if len(class_ids) != len(group_index):
        raise DataError(f"class_ids has {len(class_ids)} labels for {len(group_index)} samples")
    gids, g = group_ids(group_index)
    cids, _ = group_ids(class_ids)
    # a (group, class) pair identifies one equivalence class
    pairs = np.stack([gids.numpy(), cids.numpy()], axis=1).reshape(-1, 2)
    _, pair_inv = np.unique(pairs, axis=0, return_inverse=True)
    pair = torch.as_tensor(pair_inv.reshape(-1), dtype=torch.long)
    num_pairs = int(pair.max()) + 1 if len(pair) else 0
    n = group_counts(gids, g, torch.float32)[gids]
    size = group_counts(pair, num_pairs, torch.float32)[pair]
    return torch.where(n > 1, (n - size) / (n - 1).clamp(min=1), torch.ones_like(n))


def fuse_diversity(
    quality: torch.Tensor,
    diversity: torch.Tensor,
    group_index: Any,
    mode: str = "multiplicative",
    weight: float = 1.0,
    normalization: str = "none",
) -> torch.Tensor:
    """Combine quality [B] and diversity [B] into the reward [B] (see module doc).

    `group_max` normalisation divides each Div by its group's largest Div; a group whose Div are all
    0 (every response alike) keeps Norm = 0 for multiplicative fusion (no reward for a collapsed
    group, as the paper intends) and 0 for additive fusion.
    """
    if mode not in FUSION_MODES:
        raise ConfigError(f"reward_model.diversity.fusion: unknown mode {mode!r}; valid: {', '.join(FUSION_MODES)}")
    if normalization not in NORMALIZATIONS:
        raise ConfigError(f"diversity normalization: unknown {normalization!r}; valid: {', '.join(NORMALIZATIONS)}")
    if quality.shape != diversity.shape or quality.dim() != 1:
        raise DataError(f"quality {tuple(quality.shape)} and diversity {tuple(diversity.shape)} must both be [B]")
    div = diversity.to(quality.dtype)
    if normalization == "group_max":
        ids, g = group_ids(group_index, device=quality.device)
        gmax = torch.zeros(g, dtype=div.dtype, device=div.device).scatter_reduce_(0, ids, div, reduce="amax")[ids]
        div = torch.where(gmax > 0, div / gmax.clamp(min=1e-12), torch.zeros_like(div))
    if mode == "multiplicative":
        return quality * div
    return quality + weight * div
