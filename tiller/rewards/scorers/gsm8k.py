"""GSM8K answer checking, verl's rule (`verl/utils/reward_score/gsm8k.py`) plus a flexible mode.

strict:   look at the last 300 characters of the response, take the last `#### <number>` match
          (regex `#### (\\-?[0-9\\.\\,]+)`), strip `,` and `$`, and compare the string with the ground
          truth exactly. Correct -> `score`, a number that does not match -> `format_score`, no
          `####` at all -> 0.
flexible: the last number anywhere in the response (commas and `$` removed), compared numerically
          with the ground truth (so `18.0` and `18.00` equal `18`).

Deviation from verl: none in strict mode (verl's `flexible` takes the last non-empty number too;
we compare numerically rather than as strings).
"""

from __future__ import annotations

import math
import re

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]*[0-9]+[0-9\.\,]*)")
_CLIP_CHARS = 300


def _clean(num: str) -> str:
    return num.replace(",", "").replace("$", "")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer string of a GSM8K response, or None.

    >>> extract_solution("so 3 + 4 = 7\\n#### 7")
    '7'
    >>> extract_solution("the answer is $1,234.", method="flexible")
    '1234'
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    if method == "strict":
        # Matching only the tail keeps the regex cheap on very long responses (verl does the same).
        tail = solution_str[-_CLIP_CHARS:] if len(solution_str) > _CLIP_CHARS else solution_str
        matches = _STRICT.findall(tail)
        return _clean(matches[-1]) if matches else None
    for candidate in reversed(_NUMBER.findall(solution_str)):
        cleaned = _clean(candidate).rstrip(".")
        if cleaned not in ("", ".", "-"):
            return cleaned
    return None


def _to_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` when the extracted answer matches `ground_truth`, else `format_score` (0 if none found).

    >>> compute_score("#### 1,000", "1000")
    1.0
    >>> compute_score("answer: 18.0", "18", method="flexible")
    1.0
    """
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    truth = _clean(str(ground_truth).strip())
    if method == "strict":
        return score if answer == truth else format_score
    a, t = _to_float(answer), _to_float(truth)
    if a is None or t is None:
        return score if answer == truth else format_score
    return score if math.isclose(a, t, rel_tol=1e-9, abs_tol=1e-9) else format_score
