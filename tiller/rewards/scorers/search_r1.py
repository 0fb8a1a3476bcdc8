"""Scorer of Search-R1's question answering (`searchR1_nq`, `searchR1_hotpotqa`, ...): verl's
`reward_score/search_r1_like_qa_em.py` (from Search-R1's `qa_em.py`), without its random debug printing.

The answer is the last `<answer>...</answer>` of the response; it scores `score` (1.0) when its normalised form
(lower case, punctuation and the articles a / an / the removed, whitespace collapsed) equals a normalised golden
answer, `score / 4` when the response holds more than 10 `<answer>` or `</answer>` tags (verl's guard against tag
spam), `format_score` (0.0) for a wrong answer and 0 without one. `compute_score_subem`: a golden answer inside the
answer counts.

Ground truth: verl's `{"target": [golden answers]}` (a single string works too).
"""

from __future__ import annotations

import re
import string
from typing import Any, Sequence

SOURCES = ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa", "searchR1_2wikimultihopqa",
           "searchR1_musique", "searchR1_bamboogle")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation, as Search-R1's.

    >>> normalize_answer("The  Eiffel Tower!")
    'eiffel tower'
    """
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def targets(ground_truth: Any) -> list[str]:
    """The golden answers of a ground truth (`{"target": [...]}`, a list or a string)."""
    value = ground_truth.get("target") if isinstance(ground_truth, dict) else ground_truth
    if isinstance(value, str):
        return [value]
    if isinstance(value, Sequence) or hasattr(value, "tolist"):
        return [str(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]
    raise TypeError(f"Search-R1 ground truth must be {{'target': [answers]}}, a list or a string, got {ground_truth!r}")


def extract_solution(solution_str: str) -> str | None:
    """The last `<answer>` block's text, stripped (None without one).

    >>> extract_solution("<answer> a </answer> then <answer> Paris </answer>")
    'Paris'
    """
    matches = _ANSWER.findall(solution_str)
    return matches[-1].strip() if matches else None


def em_check(prediction: str, golden: Sequence[str]) -> bool:
    return normalize_answer(prediction) in {normalize_answer(g) for g in golden}


def subem_check(prediction: str, golden: Sequence[str]) -> bool:
    normalized = normalize_answer(prediction)
    return any(normalize_answer(g) in normalized for g in golden)


def compute_score(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """Exact match (see the module docstring; `method` is accepted and unused, as in verl).

    >>> compute_score("<think>hm</think><answer>the Paris</answer>", {"target": ["Paris", "Paris, France"]})
    1.0
    >>> compute_score("<answer>Lyon</answer>", {"target": ["Paris"]}), compute_score("Paris", {"target": ["Paris"]})
    (0.0, 0)
    """
    answer = extract_solution(solution_str)
    if answer is None:
        return 0
    if not em_check(answer, targets(ground_truth)):
        return format_score
    if solution_str.count("<answer>") > 10 or solution_str.count("</answer>") > 10:
        return score / 4
    return score


def compute_score_subem(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                        score: float = 1.0) -> float:
    """Substring exact match: a golden answer inside the extracted answer.

    >>> compute_score_subem("<answer>it is Paris, France</answer>", {"target": ["Paris"]})
    1.0
    """
    answer = extract_solution(solution_str)
    if answer is None:
        return 0
    return score if subem_check(answer, targets(ground_truth)) else format_score
