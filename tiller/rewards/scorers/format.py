"""Format rewards: a response that thinks inside `<think>...</think>` and then answers.

`think_format_ok(text)` is true for exactly one `<think>` block at the start (leading whitespace
allowed), closed once, followed by a non-empty answer. `split_think(text)` returns the answer part
(the text after `</think>`), which the task scorer then checks (as DeepSeek-R1 style recipes do).
"""

from __future__ import annotations

import re

_THINK = re.compile(r"\A\s*<think>(?P<thought>.*?)</think>(?P<answer>.*)\Z", re.DOTALL)


def think_format_ok(text: str) -> bool:
    """True for `<think>thought</think>answer` with one think block and a non-empty answer.

    >>> think_format_ok("<think>2+2 is 4</think> 4")
    True
    >>> think_format_ok("4")
    False
    >>> think_format_ok("<think>a</think><think>b</think>4")
    False
    """
    match = _THINK.match(text)
    if match is None:
        return False
    if "<think>" in match["thought"] or "<think>" in match["answer"] or "</think>" in match["answer"]:
        return False
    return bool(match["answer"].strip())


def split_think(text: str) -> str:
    """The answer after the last `</think>` (the whole text when there is none)."""
    idx = text.rfind("</think>")
    return text if idx < 0 else text[idx + len("</think>"):]


def format_score(solution_str: str, ground_truth=None) -> float:
    """1.0 when `think_format_ok`, else 0.0 (usable as a task-free format reward)."""
    return 1.0 if think_format_ok(solution_str) else 0.0
