"""Data types of the reward contract (docs/internals.md, `tiller.rewards`).

`B` = number of samples in the request list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RewardRequest:
    """One sample to score."""

    data_source: str
    """Routes the sample to its scorer (verl's names, e.g. `openai/gsm8k`)."""
    prompt: str
    """The prompt as the policy saw it (decoded)."""
    response: str
    """The decoded response (no padding)."""
    ground_truth: Any
    """The reference answer (`reward_model.ground_truth` in verl's data schema)."""
    extra_info: dict = field(default_factory=dict)
    """Per-sample extra fields from the dataset."""
    response_length: int = 0
    """Response length in tokens (for overlong shaping)."""
    group: str = ""
    """uid of the prompt: samples with the same group are the n answers to one prompt (for diversity)."""
    response_ids: list[int] | None = None
    """The response's token ids (no padding), as the policy sampled them (the RL driver fills them in)."""
    prompt_ids: list[int] | None = None
    """The prompt's token ids (no padding), as the policy saw them (the RL driver fills them in)."""
    messages: list[dict] | None = None
    """A multi-turn sample's completion as chat messages, when its tool loop records them (TRL's)."""
    state: Any = None
    """An in-process tool loop's per-sample object (TRL's: the prompt and environment of the completion)."""


@dataclass
class RewardResult:
    """Scores of a batch of `RewardRequest`s."""

    scores: np.ndarray
    """[B] float32 final scalar reward (after shaping and diversity)."""
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    """[B] per-sample components, logged as reward_extra/<key>."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Batch metrics, e.g. reward/num_errors, diversity/mean."""
