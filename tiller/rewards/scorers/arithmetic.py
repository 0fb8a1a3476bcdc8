"""Scorer of the built-in demo task `tiller/arithmetic`.

The ground truth is an integer written as a string; a response is correct (1.0) when the last
integer in it equals the ground truth, else 0.0.
"""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last integer in `solution_str` equals `ground_truth`.

    >>> compute_score("12+30=42", "42")
    1.0
    >>> compute_score("42 or 41", "42")
    0.0
    """
    found = _INT.findall(solution_str)
    if not found:
        return 0.0
    try:
        return 1.0 if int(found[-1]) == int(str(ground_truth).strip()) else 0.0
    except ValueError:
        return 0.0
