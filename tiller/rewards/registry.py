"""`default_compute_score`: routes a sample to its rule-based scorer by `data_source` (verl's names).

| data_source | scorer |
|---|---|
| `openai/gsm8k`, `gsm8k` | `scorers.gsm8k` (kwargs: method=strict\\|flexible, format_score, score) |
| `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`, `math`, `numina_*` | `scorers.math` last `\\boxed{}` + math-verify (kwargs: timeout_s) |
| `math_dapo`, `aime*` | `scorers.math.compute_score_dapo` (`Answer:` line, +1 / -1, as verl) |
| `codecontests`, `apps`, `taco`, `livecodebench`, `codeforces`, `humaneval`, `openai/openai_humaneval` | `scorers.code` in the sandbox (kwargs: mode=binary\\|fraction) |
| `reasoning_gym/<task>`, `reasoning_gym` | the task's own reasoning-gym scorer |
| `tiller/arithmetic`, `tiller/shapes` | `scorers.arithmetic` (last integer equals the answer) |
| `hiyouga/geometry3k` | `scorers.geo3k` (0.9 boxed-answer accuracy + 0.1 `<think>` format, as verl) |

Extra keyword `think_format=True` (any task): the response must be `<think>...</think>answer`
(`scorers.format`); otherwise it scores 0, else the answer part is scored; the dict result then
carries `format` (1/0). `register_scorer` adds or overrides a route.
"""

from __future__ import annotations

from typing import Any, Callable

from tiller.errors import UserError
from tiller.rewards.scorers import arithmetic, gsm8k
from tiller.rewards.scorers import code, format as format_scorer, geo3k, math as math_scorer, reasoning_gym

Scorer = Callable[..., "float | dict"]

MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math")
CODE_SOURCES = ("codecontests", "apps", "taco", "livecodebench", "codeforces", "humaneval", "openai/openai_humaneval")


def _gsm8k(data_source, solution_str, ground_truth, extra_info, **kw):
    return gsm8k.compute_score(solution_str, ground_truth, **kw)


def _math(data_source, solution_str, ground_truth, extra_info, **kw):
    return math_scorer.compute_score(solution_str, ground_truth, **kw)


def _math_dapo(data_source, solution_str, ground_truth, extra_info, **kw):
    return math_scorer.compute_score_dapo(solution_str, ground_truth, **kw)


def _code(data_source, solution_str, ground_truth, extra_info, **kw):
    return code.compute_score(solution_str, ground_truth, extra_info, **kw)


def _reasoning_gym(data_source, solution_str, ground_truth, extra_info, **kw):
    return reasoning_gym.compute_score(data_source, solution_str, ground_truth, extra_info, **kw)


def _arithmetic(data_source, solution_str, ground_truth, extra_info, **kw):
    return arithmetic.compute_score(solution_str, ground_truth, **kw)


def _geo3k(data_source, solution_str, ground_truth, extra_info, **kw):
    return geo3k.compute_score(solution_str, ground_truth, **kw)


_EXACT: dict[str, Scorer] = {"openai/gsm8k": _gsm8k, "gsm8k": _gsm8k, "math_dapo": _math_dapo,
                             "tiller/arithmetic": _arithmetic, "tiller/shapes": _arithmetic,
                             "reasoning_gym": _reasoning_gym, "hiyouga/geometry3k": _geo3k}
_EXACT.update({name: _math for name in MATH_SOURCES})
_EXACT.update({name: _code for name in CODE_SOURCES})
_PREFIX: dict[str, Scorer] = {"numina_": _math, "aime": _math_dapo, "reasoning_gym/": _reasoning_gym}


def register_scorer(name: str, scorer: Scorer, prefix: bool = False) -> None:
    """Route `data_source == name` (or starting with `name` when prefix) to
    `scorer(data_source, solution_str, ground_truth, extra_info, **kwargs)`."""
    (_PREFIX if prefix else _EXACT)[name] = scorer


def get_scorer(data_source: str) -> Scorer:
    """The scorer for `data_source`; UserError listing the known names when none matches."""
    if data_source in _EXACT:
        return _EXACT[data_source]
    for prefix in sorted(_PREFIX, key=len, reverse=True):
        if data_source.startswith(prefix):
            return _PREFIX[prefix]
    known = sorted(_EXACT) + [p + "*" for p in sorted(_PREFIX)]
    raise UserError(
        f"no reward scorer for data_source {data_source!r}; known: {', '.join(known)}. "
        "Set custom_reward_function.path to score other data."
    )


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict | None = None, think_format: bool = False, **kwargs) -> float | dict:
    """Score one response with the rule for its `data_source` (float, or dict with `score`).

    >>> default_compute_score("openai/gsm8k", "3 + 4 = 7\\n#### 7", "7")
    1.0
    >>> default_compute_score("tiller/arithmetic", "12+30=42", "42")
    1.0
    """
    scorer = get_scorer(data_source)
    if not think_format:
        return scorer(data_source, solution_str, ground_truth, extra_info, **kwargs)
    if not format_scorer.think_format_ok(solution_str):
        return {"score": 0.0, "format": 0.0}
    inner = scorer(data_source, format_scorer.split_think(solution_str), ground_truth, extra_info, **kwargs)
    result = dict(inner) if isinstance(inner, dict) else {"score": float(inner)}
    result["format"] = 1.0
    return result
