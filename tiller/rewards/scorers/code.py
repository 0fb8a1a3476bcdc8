"""Code rewards: the last fenced Python block of the response, run in the sandbox against tests.

Ground truth (a dict, or its JSON string), as verl's code datasets store it:
- stdin/stdout: `{"inputs": [...], "outputs": [...]}`; each input is fed on stdin and the output
  compared line by line (trailing whitespace ignored; numeric tokens equal within 1e-6).
- call-based (APPS / LeetCode style): the same plus `"fn_name"`; each input is the argument list,
  the function (or `Solution().<fn_name>`) is called and its return value compared (JSON equality,
  tuples as lists; APPS' `[expected]` wrapping accepted).
- HumanEval style: `{"test": "...def check(candidate)...", "entry_point": "name"}`; the program is
  the code (with `extra_info["prompt"]` prepended when the code does not define the entry point),
  then the test, then `check(entry_point)`; it passes when it exits 0.

Score: 1.0 when every test passes, else 0.0 (`mode="binary"`, verl's default), or the fraction of
tests passed (`mode="fraction"`). The dict also carries `pass_rate` and `num_tests`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from tiller.rewards.sandbox import SandboxLimits, SandboxPool, run_program

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_POOL: SandboxPool | None = None
DEFAULT_LIMITS = SandboxLimits(cpu_time_s=4, wall_time_s=8.0, memory_mb=1024)


def extract_code(response: str) -> str:
    """The last fenced python block (```python / ```py / ```), else the whole response.

    >>> extract_code("text\\n```python\\nprint(1)\\n```\\nmore")
    'print(1)\\n'
    """
    blocks = _FENCE.findall(response)
    python_blocks = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3", "")]
    if python_blocks:
        return python_blocks[-1]
    return response


def _pool() -> SandboxPool:
    global _POOL
    if _POOL is None:
        _POOL = SandboxPool(max_workers=4, limits=DEFAULT_LIMITS)
    return _POOL


def _tokens_equal(got: str, want: str) -> bool:
    got_lines = [line.rstrip() for line in got.strip().splitlines()]
    want_lines = [line.rstrip() for line in want.strip().splitlines()]
    if got_lines == want_lines:
        return True
    got_tokens, want_tokens = got.split(), want.split()
    if len(got_tokens) != len(want_tokens):
        return False
    for a, b in zip(got_tokens, want_tokens):
        if a == b:
            continue
        try:
            if abs(float(a) - float(b)) > 1e-6 * max(1.0, abs(float(b))):
                return False
        except ValueError:
            return False
    return True


_CALL_HARNESS = """

# ---- tiller call-based test harness ----
import json as _tiller_json, sys as _tiller_sys
_tiller_args = _tiller_json.loads(_tiller_sys.stdin.read())
if not isinstance(_tiller_args, list):
    _tiller_args = [_tiller_args]
try:
    _tiller_fn = Solution().{fn}
except NameError:
    _tiller_fn = {fn}
_tiller_out = _tiller_fn(*_tiller_args)
_tiller_sys.stdout.write("\\n@@TILLER_RESULT@@" + _tiller_json.dumps(_tiller_out))
"""


def _normalise_json(value: Any) -> Any:
    return json.loads(json.dumps(value))  # tuples -> lists, int keys -> str keys


def _call_result_ok(stdout: str, expected: Any) -> bool:
    marker = stdout.rfind("@@TILLER_RESULT@@")
    if marker < 0:
        return False
    try:
        got = json.loads(stdout[marker + len("@@TILLER_RESULT@@"):])
    except json.JSONDecodeError:
        return False
    expected = _normalise_json(expected)
    return got == expected or [got] == expected


def _parse_ground_truth(ground_truth: Any) -> dict:
    if isinstance(ground_truth, str):
        ground_truth = json.loads(ground_truth)
    if not isinstance(ground_truth, dict):
        raise ValueError("code ground truth must be a dict (or JSON object string)")
    return ground_truth


def _humaneval_program(code: str, spec: dict, extra_info: dict | None) -> str:
    entry = spec["entry_point"]
    prompt = (extra_info or {}).get("prompt", "")
    if prompt and not re.search(rf"def\s+{re.escape(entry)}\s*\(", code):
        code = prompt + code
    return f"{code}\n\n{spec['test']}\n\ncheck({entry})\n"


def run_tests(code: str, ground_truth: Any, extra_info: dict | None = None,
              limits: SandboxLimits | None = None) -> list[bool]:
    """Run `code` against the tests of `ground_truth`; one bool per test."""
    spec = _parse_ground_truth(ground_truth)
    if limits is None:
        return _run_tests(code, spec, extra_info, _pool())
    pool = SandboxPool(max_workers=4, limits=limits)
    try:
        return _run_tests(code, spec, extra_info, pool)
    finally:
        pool.close()


def _run_tests(code: str, spec: dict, extra_info: dict | None, pool: SandboxPool) -> list[bool]:
    if "test" in spec and "entry_point" in spec:
        return [pool.map([(_humaneval_program(code, spec, extra_info), "")])[0].ok]
    inputs, outputs = spec.get("inputs", []), spec.get("outputs", [])
    if len(inputs) != len(outputs) or not inputs:
        raise ValueError("code ground truth needs equal-length, non-empty 'inputs' and 'outputs'")
    fn_name = spec.get("fn_name")
    if fn_name:
        program = code + _CALL_HARNESS.format(fn=fn_name)
        jobs = [(program, json.dumps(arg)) for arg in inputs]
        results = pool.map(jobs)
        return [r.ok and _call_result_ok(r.stdout, want) for r, want in zip(results, outputs)]
    jobs = [(code, inp if isinstance(inp, str) else "\n".join(map(str, inp))) for inp in inputs]
    results = pool.map(jobs)
    return [r.ok and _tokens_equal(r.stdout, str(want)) for r, want in zip(results, outputs)]


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  mode: str = "binary", **limits: Any) -> dict:
    """Score a code response: all tests pass -> 1.0 (binary) or the fraction passed (fraction).

    `limits` override fields of `DEFAULT_LIMITS` per test run (cpu_time_s, wall_time_s, memory_mb, ...).
    """
    if mode not in ("binary", "fraction"):
        raise ValueError(f"code reward mode must be 'binary' or 'fraction', got {mode!r}")
    run_limits = dataclasses.replace(DEFAULT_LIMITS, **limits) if limits else None
    passed = run_tests(extract_code(solution_str), ground_truth, extra_info, run_limits)
    rate = sum(passed) / len(passed)
    score = rate if mode == "fraction" else float(all(passed))
    return {"score": score, "pass_rate": rate, "num_tests": float(len(passed))}


__all__ = ["compute_score", "extract_code", "run_tests", "run_program"]
