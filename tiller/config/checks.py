"""The value checks every config validator uses: one line naming the key, the bad value and what is allowed."""

from __future__ import annotations

import difflib
from typing import Any

from tiller.errors import ConfigError


def check_choice(key: str, value: object, valid: tuple[str, ...]) -> None:
    """`value` must be one of `valid`; the error suggests the closest one."""
    if value not in valid:
        close = difflib.get_close_matches(str(value), valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key} = {value!r} is not one of: {', '.join(valid)}{hint}")


def check_positive(key: str, value: int | float) -> None:
    """`value` must be > 0."""
    if value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value}")


def check_ref_sync(steps: Any, alpha: float, prefix: str, lora: bool, lora_why: str) -> bool:
    """TR-DPO's reference updates (`{prefix}ref_model_sync_steps` / `ref_model_mixup_alpha`): True when on; the
    values checked, LoRA refused (its reference is the policy with the adapters off)."""
    if steps is None:
        return False
    if steps < 1 or not 0 < alpha <= 1:
        raise ConfigError(f"{prefix}ref_model_sync_steps must be >= 1 and {prefix}ref_model_mixup_alpha in (0, 1], "
                          f"got {steps} and {alpha}")
    if lora:
        raise ConfigError(f"{prefix}ref_model_sync_steps: refused with LoRA ({lora_why}; TRL refuses PEFT too)")
    return True
