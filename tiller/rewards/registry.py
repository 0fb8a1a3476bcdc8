"""`default_compute_score`: routes a sample to its rule-based scorer by `data_source` (verl's names).

| data_source | scorer |
|---|---|
| `openai/gsm8k`, `gsm8k` | `scorers.gsm8k` (kwargs: method=strict\\|flexible, format_score, score) |
| `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`, `math`, `numina_*` | `scorers.math` last `\\boxed{}` + math-verify (kwargs: timeout_s) |
| `math_dapo`, `aime*` | `scorers.math.compute_score_dapo` (`Answer:` line, +1 / -1, as verl) |
| `codecontests`, `apps`, `taco`, `livecodebench`, `codeforces`, `humaneval`, `openai/openai_humaneval` | `scorers.code` in the sandbox (kwargs: mode=binary\\|fraction) |
| `codecontests`, `apps`, `codeforces`, `taco` with `sandbox_fusion_url` | `sandbox_fusion.compute_score(..., continuous=True)`, as verl |
| `reasoning_gym/<task>`, `reasoning_gym` | the task's own reasoning-gym scorer |
| `tiller/arithmetic`, `tiller/shapes` | `scorers.arithmetic` (last integer equals the answer) |
| `hiyouga/geometry3k` | `scorers.geo3k` (0.9 boxed-answer accuracy + 0.1 `<think>` format, as verl) |
| `searchR1_nq`, `searchR1_hotpotqa`, ... (verl's seven) | `scorers.search_r1` (`<answer>` exact match, as verl) |

Extra keyword `think_format=True` (any task): the response must be `<think>...</think>answer`
(`scorers.format`); otherwise it scores 0, else the answer part is scored; the dict result then
carries `format` (1/0). `register_scorer` adds or overrides a route.

verl's SandboxFusion keywords `sandbox_fusion_url`, `concurrent_semaphore`, `memory_limit_mb` (what verl binds when
`reward.sandbox_fusion.url` is set) send verl's four code data sources to that server (`tiller.rewards.sandbox_fusion`)
instead of the local sandbox; other data sources ignore them, as in verl.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from tiller.errors import UserError
from tiller.rewards.scorers import arithmetic, gsm8k
from tiller.rewards import sandbox_fusion
from tiller.rewards.scorers import code, format as format_scorer, geo3k, math as math_scorer, reasoning_gym, search_r1

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


def _search_r1(data_source, solution_str, ground_truth, extra_info, **kw):
    return search_r1.compute_score(solution_str, ground_truth, **kw)


_EXACT: dict[str, Scorer] = {"openai/gsm8k": _gsm8k, "gsm8k": _gsm8k, "math_dapo": _math_dapo,
                             "tiller/arithmetic": _arithmetic, "tiller/shapes": _arithmetic,
                             "reasoning_gym": _reasoning_gym, "hiyouga/geometry3k": _geo3k}
_EXACT.update({name: _math for name in MATH_SOURCES})
_EXACT.update({name: _code for name in CODE_SOURCES})
_EXACT.update({name: _search_r1 for name in search_r1.SOURCES})
_PREFIX: dict[str, Scorer] = {"numina_": _math, "aime": _math_dapo, "reasoning_gym/": _reasoning_gym}


# the ground-truth types each built-in scorer compares (bool is refused where int is named: True is not 1 here);
# a scorer missing here (reasoning-gym, a registered one) takes any value
_NUMBER_OR_TEXT = ((str, int, float), "a string or a number")
GROUND_TRUTH_TYPES: dict[Scorer, tuple[tuple[type, ...], str]] = {
    _gsm8k: _NUMBER_OR_TEXT, _math: _NUMBER_OR_TEXT, _math_dapo: _NUMBER_OR_TEXT, _arithmetic: _NUMBER_OR_TEXT,
    _code: ((str, dict), "a test spec (a mapping, or its JSON text)"),
    _search_r1: ((dict, list, str), "{'target': [golden answers]}"),
}


def ground_truth_problem(data_source: str, ground_truth: Any) -> str | None:
    """Why `ground_truth` cannot be compared by the rule scorer of `data_source` (its type), or None.

    >>> ground_truth_problem("tiller/arithmetic", {"answer": 4})
    "the scorer of data_source 'tiller/arithmetic' compares a string or a number, got a dict ({'answer': 4})"
    >>> ground_truth_problem("tiller/arithmetic", "4") is None
    True
    """
    try:
        scorer = get_scorer(data_source)
    except UserError:
        return None  # no scorer at all: named by its own error where the row is scored
    types, wanted = GROUND_TRUTH_TYPES.get(scorer, ((object,), "anything"))
    if ground_truth is None or (isinstance(ground_truth, types) and not isinstance(ground_truth, bool)):
        return None
    shown = repr(ground_truth)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"the scorer of data_source {data_source!r} compares {wanted}, got a {type(ground_truth).__name__} ({shown})"


def bad_ground_truths(items) -> list[str]:
    """`<file> row <i>: field <key>: <problem>` for each prompt item (`tiller.data.rl_dataset.PromptItem`) whose
    ground truth its data_source's rule scorer cannot compare."""
    out = []
    for item in items:
        problem = ground_truth_problem(item.data_source, item.ground_truth)
        if problem:
            out.append(f"{item.where or item.uid}: field {item.ground_truth_key or 'ground_truth'}: {problem}")
    return out


def check_ground_truths(items, what: str, mode: str = "error") -> int:
    """Refuse (mode "error": a `UserError` naming the first bad row, file and field) or count and warn about (mode
    "count") the rows of `items` whose ground truth has the wrong type for their scorer; returns how many."""
    bad = bad_ground_truths(items)
    if not bad:
        return 0
    more = f" ({len(bad) - 1} more rows of {what} like it)" if len(bad) > 1 else ""
    if mode == "error":
        raise UserError(f"{bad[0]}{more}; fix the data, or set reward_model.bad_ground_truth=count to score such rows "
                        "0 and count them in reward/bad_ground_truth")
    print(f"warning: {len(bad)} rows of {what} have a ground truth their scorer cannot compare; they score 0, "
          f"counted in reward/bad_ground_truth (first: {bad[0]})", file=sys.stderr)
    return len(bad)


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
                          extra_info: dict | None = None, sandbox_fusion_url: str | None = None,
                          concurrent_semaphore: Any = None, memory_limit_mb: int | None = None,
                          think_format: bool = False, **kwargs) -> float | dict:
    """Score one response with the rule for its `data_source` (float, or dict with `score`); verl's signature.

    >>> default_compute_score("openai/gsm8k", "3 + 4 = 7\\n#### 7", "7")
    1.0
    >>> default_compute_score("tiller/arithmetic", "12+30=42", "42")
    1.0
    """
    if sandbox_fusion_url and data_source in sandbox_fusion.SANDBOX_FUSION_SOURCES:
        def scorer(data_source, solution_str, ground_truth, extra_info, **kw):
            return sandbox_fusion.compute_score(sandbox_fusion_url, concurrent_semaphore, memory_limit_mb,
                                                solution_str, ground_truth, continuous=True, **kw)
    else:
        scorer = get_scorer(data_source)
    if not think_format:
        return scorer(data_source, solution_str, ground_truth, extra_info, **kwargs)
    if not format_scorer.think_format_ok(solution_str):
        return {"score": 0.0, "format": 0.0}
    inner = scorer(data_source, format_scorer.split_think(solution_str), ground_truth, extra_info, **kwargs)
    result = dict(inner) if isinstance(inner, dict) else {"score": float(inner)}
    result["format"] = 1.0
    return result
