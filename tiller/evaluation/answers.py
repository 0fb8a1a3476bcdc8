"""Final-answer extraction for majority voting (maj@k), by data_source.

A scorer that returns a dict with `pred` (e.g. `math_dapo`) gives the answer itself; otherwise the answer
is extracted here with the rule the data source's scorer uses, so two responses vote together exactly when
the scorer would read the same answer from both:

| data_source | answer |
|---|---|
| `openai/gsm8k`, `gsm8k` | `#### <number>` (strict), else the last number (flexible), as a canonical number |
| MATH sources, `numina_*` | the last `\\boxed{...}`, normalised (`scorers.math.normalize`) |
| `math_dapo`, `aime*` | the last `Answer:` line (minerva normalisation) |
| `tiller/arithmetic` | the last integer |
| anything else | the response after any `</think>`, whitespace-collapsed |

An empty answer is None (it does not vote).
"""

from __future__ import annotations

import re

from tiller.rewards.registry import MATH_SOURCES
from tiller.rewards.scorers.gsm8k import extract_solution
from tiller.rewards.scorers.math import ANSWER_LINE, last_boxed_only_string, normalize, normalize_final_answer

_INT = re.compile(r"-?\d+")


def _number(text: str | None) -> str | None:
    """'18.00' -> '18', '1,234' -> '1234'; None or non-numbers pass through (stripped)."""
    if text is None:
        return None
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return text or None
    return str(int(value)) if value.is_integer() else repr(value)


def _gsm8k(response: str) -> str | None:
    found = extract_solution(response, "strict")
    return _number(found if found is not None else extract_solution(response, "flexible"))


def _math(response: str) -> str | None:
    boxed = last_boxed_only_string(response)
    return normalize(boxed) or None if boxed is not None else None


def _math_dapo(response: str) -> str | None:
    tail = response[-300:]
    matches = ANSWER_LINE.findall(tail)
    if matches:
        return normalize_final_answer(matches[-1]) or None
    boxed = last_boxed_only_string(tail)
    return normalize_final_answer(boxed) or None if boxed is not None else None


def _arithmetic(response: str) -> str | None:
    found = _INT.findall(response)
    return str(int(found[-1])) if found else None


def _text(response: str) -> str | None:
    idx = response.rfind("</think>")
    answer = " ".join((response if idx < 0 else response[idx + len("</think>"):]).split())
    return answer or None


def extract_answer(data_source: str, response: str) -> str | None:
    """The answer `response` gives, in the form the data source's scorer compares (None = no answer).

    >>> extract_answer("openai/gsm8k", "3 + 4 = 7\\n#### 7.00")
    '7'
    >>> extract_answer("tiller/arithmetic", "12+30=42")
    '42'
    >>> extract_answer("lighteval/MATH", "so \\\\boxed{\\\\dfrac{1}{2}}")
    '\\\\frac{1}{2}'
    """
    if data_source in ("openai/gsm8k", "gsm8k"):
        return _gsm8k(response)
    if data_source in MATH_SOURCES or data_source.startswith("numina_"):
        return _math(response)
    if data_source == "math_dapo" or data_source.startswith("aime"):
        return _math_dapo(response)
    if data_source == "tiller/arithmetic":
        return _arithmetic(response)
    return _text(response)
