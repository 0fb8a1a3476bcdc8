"""MATH-style answer checking: the last `\\boxed{}` of the response against the ground truth.

Two answers are equal when their normalised strings match (fast path, in-process) or when
math-verify (Hugging Face, https://github.com/huggingface/Math-Verify) finds them equivalent:
fractions vs decimals, LaTeX forms, sets and intervals, equations with the same right-hand side.

math-verify bounds its own time with `signal.alarm`, which only works in the main thread. We call
it with `parsing_timeout=None, timeout_seconds=None` inside a worker process (`KillablePool`) and
kill that process at our own deadline, so a pathological answer returns 0 within `timeout_s`
from any thread or process. A timeout scores 0 (the answer could not be shown correct).

`compute_score_dapo` is verl's `math_dapo` rule (the last `Answer:` line, minerva normalisation,
+1 / -1), with a math-verify fallback when the normalised strings differ (deviation: verl
compares strings only).
"""

from __future__ import annotations

import logging
import re

from tiller.rewards._procpool import KillablePool

DEFAULT_TIMEOUT_S = 5.0
_POOL: KillablePool | None = None


def last_boxed_only_string(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`, `\\boxed x`), braces balanced.

    >>> last_boxed_only_string("so \\\\boxed{\\\\frac{1}{2}} and")
    '\\\\frac{1}{2}'
    """
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = text[idx:]
    if rest.startswith("\\boxed ") :
        return rest[len("\\boxed "):].split("$")[0].strip() or None
    brace = rest.find("{")
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[brace + 1:i]
    return None


_STRIP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "$", " ", "\\displaystyle")


def normalize(answer: str) -> str:
    """Cheap canonical form for the fast path: drop spacing and sizing commands, `dfrac` -> `frac`."""
    text = answer.strip().rstrip(".")
    for token in _STRIP:
        text = text.replace(token, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\\text\{\s*([^{}]*?)\s*\}", r"\1", text)
    return text


def _verify_worker(gold: str, pred: str) -> bool:
    """Runs inside the pool worker: math-verify without its signal-based timeouts."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold_parsed = parse(f"$\\boxed{{{gold}}}$", parsing_timeout=None)
    pred_parsed = parse(f"$\\boxed{{{pred}}}$", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _pool() -> KillablePool:
    global _POOL
    if _POOL is None:
        _POOL = KillablePool(1, preload=("math_verify", "tiller.rewards.scorers.math"))
    return _POOL


def is_equiv(gold: str, pred: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """True when `pred` equals `gold` as a math answer; False on timeout or parse failure."""
    if normalize(gold) == normalize(pred):
        return True
    outcome = _pool().call(("module", __name__, "_verify_worker"), (gold, pred), timeout=timeout_s)
    return outcome.status == "ok" and bool(outcome.value)


def _strip_boxed(ground_truth: str) -> str:
    gt = str(ground_truth).strip()
    inner = last_boxed_only_string(gt) if "\\boxed" in gt else None
    return (inner if inner is not None else gt).strip("$ ")


def compute_score(solution_str: str, ground_truth: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 when the last boxed answer of the response equals `ground_truth`, else 0.0 (no box: 0.0)."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    return 1.0 if is_equiv(_strip_boxed(ground_truth), boxed, timeout_s) else 0.0


def answer_score(answer: str, ground_truth: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 when `answer` itself (no `\\boxed{}` needed) equals `ground_truth`, else 0.0 (verl's geo3k scorer with
    use_boxed=False: what its Geo3kTool grades)."""
    return 1.0 if answer.strip() and is_equiv(_strip_boxed(ground_truth), answer, timeout_s) else 0.0


# ---- verl math_dapo (minerva normalisation, Lewkowycz et al. 2022, appendix D) ----------------------

_SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
_REMOVED = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
            r",\!", "{,}", '"', "\\dots"]


def normalize_final_answer(final_answer: str) -> str:
    """verl's `math_dapo.normalize_final_answer` (minerva): strip units, text wrappers, `$`, commas in numbers."""
    final_answer = final_answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in _REMOVED:
        final_answer = final_answer.replace(expr, "")
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")  # DAPO's "Answer: ..." line


def compute_score_dapo(solution_str: str, ground_truth: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """verl's `math_dapo`: the last `Answer: ...` of the final 300 characters; score +1 correct, -1 not."""
    tail = solution_str[-300:]
    matches = ANSWER_LINE.findall(tail)
    if matches:
        pred = normalize_final_answer(matches[-1])
    else:
        boxed = last_boxed_only_string(tail)
        pred = normalize_final_answer(boxed) if boxed is not None else "[INVALID]"
    gold = normalize_final_answer(_strip_boxed(ground_truth))
    correct = pred == gold or (pred != "[INVALID]" and is_equiv(gold, pred, timeout_s))
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": pred}
