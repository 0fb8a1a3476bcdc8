"""TRL 1.16's built-in reward functions (`trl.rewards`) on tiller, with TRL's semantics: `from tiller.trl.reward_funcs
import accuracy_reward` in place of `from trl.rewards import accuracy_reward`. `tiller trl grpo|rloo --reward_funcs
NAME` takes the four names TRL's scripts know (`SCRIPT_REWARDS`).

Each is a plain callable taking TRL's keyword arguments (`completions`, `solution`, `completion_ids`, ...; extra
keywords are ignored). Completions are TRL's conversational ones (`[{"role": "assistant", "content": ...}]`, the
first message's content is scored); tiller also takes plain-string completions (standard prompts), which TRL's
functions cannot index (a difference: TRL raises there).

Math answers (`accuracy_reward`, `reasoning_accuracy_reward`, `get_cosine_scaled_reward`) are checked with math-verify
as TRL checks them (the gold solution parsed with math-verify's defaults, the completion with a LaTeX extraction that
tries `\\boxed{}` first, units normalised, first match; an unparseable gold solution scores None: TRL skips the row).
TRL bounds math-verify with `signal.alarm` (main thread only: 10 s a parse, 5 s a verify); tiller runs it in a worker
process it kills at `MATH_TIMEOUT_S` (any thread), as `tiller.rewards.scorers.math` does. A timeout scores 0.0.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

from tiller.rewards._procpool import KillablePool

MATH_TIMEOUT_S = 25.0  # TRL's budget for one row: two parses (10 s each) and a verify (5 s)
_POOL: KillablePool | None = None


def _contents(completions: list) -> list[str]:
    return [c if isinstance(c, str) else c[0]["content"] for c in completions]


def _verify_worker(content: str, solution: str) -> tuple[float | None, str, str]:
    """Runs in the pool worker: TRL's accuracy check of one row -> (reward, gold parsed, answer parsed)."""
    import logging

    from math_verify import LatexExtractionConfig, parse, verify
    from math_verify import LatexNormalizationConfig as NormalizationConfig  # latex2sympy2_extended's, re-exported

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold = parse(solution, parsing_timeout=None)
    if len(gold) == 0:
        return None, "[unparseable]", "[skipped]"
    answer = parse(content, extraction_config=[LatexExtractionConfig(
        normalization_config=NormalizationConfig(units=True), boxed_match_priority=0, try_extract_without_anchor=False,
    )], extraction_mode="first_match", parsing_timeout=None)
    reward = float(verify(gold, answer, timeout_seconds=None))
    return reward, str(gold), str(answer) if answer else "[unparseable]"


def _verify_all(contents: list[str], solution: list[str]) -> list[tuple[float | None, str, str]]:
    global _POOL
    if len(contents) != len(solution):
        raise ValueError(f"{len(contents)} completions but {len(solution)} solutions")
    if _POOL is None:
        _POOL = KillablePool(1, preload=("math_verify",))
    outcomes = _POOL.map(("module", __name__, "_verify_worker"), [(c, str(s)) for c, s in zip(contents, solution)],
                         timeout=MATH_TIMEOUT_S)
    out = []
    for outcome in outcomes:
        if outcome.status == "ok":
            out.append(tuple(outcome.value))
        elif outcome.status == "timeout":
            out.append((0.0, "[timeout]", "[timeout]"))
        else:
            raise RuntimeError(f"math-verify failed ({outcome.status}): {outcome.error}")
    return out


def _log(log_extra: Callable | None, solution: list, checked: list[tuple]) -> None:
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", [c[1] for c in checked])
        log_extra("answer_parsed", [c[2] for c in checked])


def accuracy_reward(completions: list, solution: list[str], log_extra: Callable[[str, list], None] | None = None,
                    **kwargs: Any) -> list[float | None]:
    r"""1.0 when the completion's answer equals the `solution` column as math (math-verify), 0.0 when not, None when
    the solution cannot be parsed (TRL leaves that row out).

    >>> accuracy_reward([[{"content": r"My answer is \boxed{\frac{1}{3}}"}], [{"content": r"\boxed{\frac{1}{2}}"}]],
    ...                 [r"\frac{1}{3}", r"\frac{1}{3}"])
    [1.0, 0.0]
    """
    checked = _verify_all(_contents(completions), solution)
    _log(log_extra, solution, checked)
    return [c[0] for c in checked]


def reasoning_accuracy_reward(completions: list, solution: list[str], reasoning_delimiters: list[str] | None = None,
                              log_extra: Callable[[str, list], None] | None = None,
                              **kwargs: Any) -> list[float | None]:
    r"""`accuracy_reward` of the text after the last reasoning delimiter (default `</think>`); a completion without
    one scores 0.0 (incomplete reasoning).

    >>> reasoning_accuracy_reward([[{"content": r"<think> ok </think> \boxed{\frac{1}{3}}"}],
    ...                            [{"content": r"<think> \boxed{\frac{1}{3}}"}]], [r"\frac{1}{3}", r"\frac{1}{3}"])
    [1.0, 0.0]
    """
    delimiters = ["</think>"] if reasoning_delimiters is None else reasoning_delimiters
    answers: list[str | None] = []
    for content in _contents(completions):
        answer = None
        for delim in delimiters:  # the first delimiter found wins; the answer follows its last occurrence
            if delim in content:
                answer = content.split(delim)[-1]
                break
        answers.append(answer)
    complete = [i for i, a in enumerate(answers) if a is not None]
    verified = _verify_all([answers[i] for i in complete], [solution[i] for i in complete]) if complete else []
    checked: list[tuple] = [(0.0, "[incomplete reasoning]", "[incomplete reasoning]")] * len(answers)
    for i, result in zip(complete, verified):
        checked[i] = result
    if len(solution) != len(answers):
        raise ValueError(f"{len(answers)} completions but {len(solution)} solutions")
    _log(log_extra, solution, checked)
    return [c[0] for c in checked]


_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion starts with `<think>...</think>` (one opening tag), else 0.0.

    >>> think_format_reward([[{"content": "<think>a</think>b"}], [{"content": "<think>a<think>b</think>"}]])
    [1.0, 0.0]
    """
    return [1.0 if _THINK.match(content) else 0.0 for content in _contents(completions)]


class _SoftOverlongPunishment:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) of the completion's token count |y|:
    0 for |y| <= L_max - L_cache; (L_max - L_cache - |y|) / L_cache up to L_max; -1 beyond."""

    __name__ = "soft_overlong_punishment_reward"  # TRL's name (its metric key)

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        self.max_completion_len, self.soft_punish_cache = max_completion_len, soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        free = self.max_completion_len - self.soft_punish_cache
        out = []
        for ids in completion_ids:
            n = len(ids)
            out.append(0.0 if n <= free else (free - n) / self.soft_punish_cache if n <= self.max_completion_len
                       else -1.0)
        return out


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable:
    """The soft overlong punishment reward for L_max = max_completion_len, L_cache = soft_punish_cache.

    >>> get_soft_overlong_punishment(100, 20)(completion_ids=[[1] * 80, [1] * 90, [1] * 110])
    [0.0, -0.5, -1.0]
    """
    return _SoftOverlongPunishment(max_completion_len, soft_punish_cache)


class _CosineScaledReward:
    """Correctness scaled by length on a cosine (Yeo et al. 2025, "Demystifying Long CoT", app. C.1):
    v_min + (v_max - v_min)(1 + cos(pi min(|y| / L_max, 1))) / 2, the bounds swapped for a wrong answer."""

    __name__ = "cosine_scaled_reward"

    def __init__(self, max_len: int, min_value_wrong: float, max_value_wrong: float, min_value_correct: float,
                 max_value_correct: float):
        self.max_len = max_len
        self.wrong = (max_value_wrong, min_value_wrong)  # a shorter wrong completion is penalised more
        self.correct = (min_value_correct, max_value_correct)

    def __call__(self, completions: list, solution: list[str], completion_ids: list[list[int]],
                 **kwargs: Any) -> list[float | None]:
        out: list[float | None] = []
        for correct, ids in zip(accuracy_reward(completions, solution), completion_ids, strict=True):
            if correct is None:
                out.append(None)
                continue
            low, high = self.correct if correct else self.wrong
            cosine = math.cos(min(len(ids) / self.max_len, 1.0) * math.pi)
            out.append(float(low + 0.5 * (high - low) * (1.0 + cosine)))
        return out


def get_cosine_scaled_reward(max_len: int, min_value_wrong: float = -1.0, max_value_wrong: float = -0.5,
                             min_value_correct: float = 0.5, max_value_correct: float = 1.0) -> Callable:
    """TRL's cosine length-scaled accuracy reward (see `_CosineScaledReward`)."""
    return _CosineScaledReward(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)


class _RepetitionPenalty:
    """(1 - unique n-grams / n-grams) x max_penalty over the completion's token ids (app. C.2 of the same paper)."""

    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float):
        self.ngram_size, self.max_penalty = ngram_size, max_penalty

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        out = []
        for ids in completion_ids:
            if len(ids) < self.ngram_size:
                out.append(0.0)
                continue
            ngrams = list(zip(*[ids[i:] for i in range(self.ngram_size)]))
            scaling = 1 - len(set(ngrams)) / len(ngrams)
            out.append(scaling * self.max_penalty if scaling else 0.0)
        return out


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> Callable:
    """TRL's n-gram repetition penalty (see `_RepetitionPenalty`); max_penalty must be <= 0.

    >>> get_repetition_penalty_reward(ngram_size=2)(completion_ids=[[1, 2, 3], [1, 1, 1, 1, 1]])
    [0.0, -0.75]
    """
    if max_penalty > 0:
        raise ValueError(f"max_penalty {max_penalty} should not be positive")
    return _RepetitionPenalty(ngram_size, max_penalty)


# the names TRL 1.16's grpo / rloo scripts take for --reward_funcs (get_soft_overlong_punishment with the scripts'
# max_completion_len=1280, soft_punish_cache=256)
SCRIPT_REWARDS: dict[str, Callable[[], Callable]] = {
    "accuracy_reward": lambda: accuracy_reward,
    "reasoning_accuracy_reward": lambda: reasoning_accuracy_reward,
    "think_format_reward": lambda: think_format_reward,
    "get_soft_overlong_punishment": lambda: get_soft_overlong_punishment(max_completion_len=1280,
                                                                         soft_punish_cache=256),
}
