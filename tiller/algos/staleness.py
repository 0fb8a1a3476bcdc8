"""Asynchronous RL's schedule (verl's fully-async rule, counted in step batches): how many batches the producer may
generate per weight sync, how old a sample may be, which version the trainer holds and which one a batch must wait
for. The producer (`tiller.trainer.async_rollout`) runs it; `tiller config explain` reports it."""

from __future__ import annotations

import math


def batches_per_sync(staleness_threshold: float, trigger: int) -> int:
    """F: step batches the producer may generate per weight sync (verl: (1 + s) x trigger x required samples)."""
    return max(trigger, math.floor((1.0 + staleness_threshold) * trigger + 1e-9))


def max_age(staleness_threshold: float, trigger: int) -> int:
    """The most versions a used sample may lag the trainer: floor((F - 1) / trigger)."""
    return (batches_per_sync(staleness_threshold, trigger) - 1) // trigger


def trainer_version(step: int, trigger: int) -> int:
    """c(s): the version the trainer holds while it trains step `s` (1-based)."""
    return (step - 1) // trigger


def earliest_version(step: int, staleness_threshold: float, trigger: int) -> int:
    """w(s): the version that must be published before the batch for step `s` may start."""
    f = batches_per_sync(staleness_threshold, trigger)
    return max(0, -((f - step) // trigger))  # ceil((s - F) / trigger), at least 0


__all__ = ["batches_per_sync", "earliest_version", "max_age", "trainer_version"]
