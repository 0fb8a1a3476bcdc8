"""The value checks every config validator uses: one line naming the key, the bad value and what is allowed."""

from __future__ import annotations

import difflib

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
