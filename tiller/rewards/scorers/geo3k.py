"""Scorer of `hiyouga/geometry3k` (verl's `reward_score/geo3k.py`): 0.9 x accuracy + 0.1 x format.

accuracy: the last `\\boxed{}` answer equals the ground truth (`scorers.math.compute_score`: math-verify);
format: the response matches `<think>...</think>...\\boxed{...}...` (verl's regex, DOTALL).
"""

from __future__ import annotations

import re

from tiller.rewards.scorers import math as math_scorer

_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def compute_score(solution_str: str, ground_truth: str, format_score: float = 0.1, **kw) -> dict:
    """{"score", "acc", "format"}.

    >>> compute_score("<think>x</think> so \\\\boxed{3}", "3")["score"]
    1.0
    >>> round(compute_score("<think>x</think> \\\\boxed{4}", "3")["score"], 3)
    0.1
    """
    acc = math_scorer.compute_score(solution_str, str(ground_truth), **kw)
    fmt = 1.0 if _FORMAT.fullmatch(solution_str) else 0.0
    return {"score": (1.0 - format_score) * acc + format_score * fmt, "acc": acc, "format": fmt}
