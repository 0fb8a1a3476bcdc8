"""Check tiller's SandboxFusion client against a running server: each case's score / status against what verl's
scorer gives, as a table; exit 1 on a mismatch, 2 when the server does not run a test program.

    python scripts/check_sandbox_fusion.py --url http://127.0.0.1:8080/run_code
    python scripts/check_sandbox_fusion.py --url ... --record tests/data/sandbox_fusion/replay.json

`--record FILE` saves every request body and the server's answer (the replay the CI tests serve).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiller.errors import UserError  # noqa: E402
from tiller.rewards import default_compute_score, sandbox_fusion  # noqa: E402
from tiller.rollout.tools import SandboxFusionTool  # noqa: E402


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


ADD = "a, b = map(int, input().split())\nprint(a + b)"
ADD_TESTS = {"inputs": ["1 2\n", "3 4\n", "5 5\n"], "outputs": ["3\n", "7\n", "10\n"]}
# (name, completion, tests, expected score, expected statuses); scored by default_compute_score("codecontests", ...)
SCORE_CASES = [
    ("correct", fenced(ADD), ADD_TESTS, 1.0, ["success"] * 3),
    ("wrong", fenced("a, b = map(int, input().split())\nprint(a - b)"), ADD_TESTS, 0.0, ["wrong_answer"] * 3),
    ("partial 2/3", fenced("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)"), ADD_TESTS, 2 / 3,
     ["success", "success", "wrong_answer"]),
    ("runtime error", fenced("raise ValueError('boom')"), ADD_TESTS, 0.0, ["runtime_error"] * 3),
    ("syntax error", fenced("def f(:\n    pass"), ADD_TESTS, 0.0, ["runtime_error"] * 3),
    ("no code fence", ADD, ADD_TESTS, 0.0, []),
    ("first 10 of 12", fenced("n = int(input())\nprint(n if n < 10 else -1)"),
     {"inputs": [f"{i}\n" for i in range(12)], "outputs": [f"{i}\n" for i in range(12)]}, 1.0,
     ["success"] * 10 + ["wrong_answer"] * 2),
    ("call-based fn_name", fenced("class Solution:\n    def plus(self, a, b):\n        return [a + b]"),
     {"fn_name": "plus", "inputs": ["1\n2", "3\n4"], "outputs": ["[3]", "[7]"]}, 1.0, ["success"] * 2),
    # verl's harness looks for a global of that name before Solution: operator.add (star-imported) wins
    ("fn_name 'add' = operator.add", fenced("class Solution:\n    def add(self, a, b):\n        return [a + b]"),
     {"fn_name": "add", "inputs": ["1\n2", "3\n4"], "outputs": ["[3]", "[7]"]}, 0.0, ["wrong_answer"] * 2),
    ("assert_case 1/2", fenced("def double(x):\n    return 2 * x"),
     {"assert_case": ["assert double(2) == 4", "assert double(3) == 7"]}, 0.5, ["success", "runtime_error"]),
]
# (name, code, language, stdin, expected output, timeout s, memory MB, expected status) through run_cases
RUN_CASES = [
    ("time limit", "while True:\n    pass", "python", "", "", 2, 1024, "timeout"),
    ("memory limit 256 MB", "x = bytearray(600 * 1024 * 1024)\nprint(len(x))", "python", "", "629145600\n", 10, 256,
     "runtime_error"),
    ("memory 1024 MB", "x = bytearray(600 * 1024 * 1024)\nprint(len(x))", "python", "", "629145600\n", 10, 1024,
     "success"),
    ("C++ compile error", "int main( { return 0; }", "cpp", "", "", 10, 1024, "compile_error"),
    ("C++ correct", "#include <cstdio>\nint main() { int a; scanf(\"%d\", &a); printf(\"%d\\n\", 2 * a); }", "cpp",
     "21\n", "42\n", 10, 1024, "success"),
]

# (name, arguments, expected answer; "...": the answer contains it) of verl's SandboxFusionTool (code_interpreter)
TOOL_CASES = [
    ("tool: print", {"code": "print(6 * 7)"}, "42\n"),
    ("tool: exit 3 keeps stdout", {"code": "import sys\nprint(1)\nsys.exit(3)"}, "1\n"),
    ("tool: exception -> stderr", {"code": "raise ValueError(5)"}, "ValueError: 5..."),
    ("tool: time limit", {"code": "while True:\n    pass", "timeout": 1}, "no stdout here"),
]


class CountingSemaphore:
    """A threading semaphore that records the most holders it had at once."""

    def __init__(self, slots: int):
        self._sem, self._lock, self.inside, self.most = threading.Semaphore(slots), threading.Lock(), 0, 0

    def __enter__(self):
        self._sem.acquire()
        with self._lock:
            self.inside += 1
            self.most = max(self.most, self.inside)

    def __exit__(self, *exc):
        with self._lock:
            self.inside -= 1
        self._sem.release()


def runs(statuses: list[str]) -> str:
    """`success x10, wrong_answer x2` for a list of statuses."""
    out: list[list] = []
    for status in statuses:
        if out and out[-1][0] == status:
            out[-1][1] += 1
        else:
            out.append([status, 1])
    return ", ".join(s if n == 1 else f"{s} x{n}" for s, n in out) or "-"


def check(url: str) -> list[tuple[str, str, str, bool]]:
    """(case, expected, got, ok) rows."""
    rows = []
    for name, completion, tests, want, statuses in SCORE_CASES:
        got = default_compute_score("codecontests", completion, json.dumps(tests), None, sandbox_fusion_url=url)
        code = sandbox_fusion.extract_solution(completion)
        spec = dict(tests)
        if "assert_case" in spec:
            spec.setdefault("inputs", [""] * len(spec["assert_case"]))
            spec.setdefault("outputs", [None] * len(spec["assert_case"]))
        seen = [r.status for r in sandbox_fusion.run_cases(url, code, spec)] if code is not None else []
        ok = abs(got["score"] - want) < 1e-9 and seen == statuses
        rows.append((name, f"{want:.4f} ({runs(statuses)})", f"{got['score']:.4f} ({runs(seen)})", ok))
    for name, code, language, stdin, output, timeout, memory, status in RUN_CASES:
        (result,) = sandbox_fusion.run_cases(url, code, {"inputs": [stdin], "outputs": [output]}, timeout=timeout,
                                             memory_limit_mb=memory, language=language)
        rows.append((name, status, f"{result.status} (exit {result.exit_code})", result.status == status))
    semaphore = CountingSemaphore(2)
    tests = {"inputs": [f"{i}\n" for i in range(8)], "outputs": [f"{i}\n" for i in range(8)]}
    results = sandbox_fusion.run_cases(url, "import time\ntime.sleep(0.3)\nprint(input())", tests, semaphore=semaphore)
    rows.append(("max_concurrent=2, 8 cases", "<= 2 in flight, 8 pass",
                 f"{semaphore.most} in flight, {sum(r.outcome is True for r in results)} pass",
                 semaphore.most <= 2 and all(r.outcome is True for r in results)))
    tool = SandboxFusionTool({"sandbox_fusion_url": url, "default_timeout": 30})  # verl's retool tool
    for name, arguments, want in TOOL_CASES:
        got = tool(arguments)
        shown = got if len(got) <= 40 else "..." + got[-37:]
        rows.append((name, repr(want), repr(shown), got == want or (want.endswith("...") and want[:-3] in got)))
    try:
        sandbox_fusion.check_server(url.rsplit("/", 1)[0] + "/no_such_endpoint")
        rows.append(("bad endpoint", "UserError naming the key", "accepted", False))
    except UserError as err:
        rows.append(("bad endpoint", "UserError naming the key", str(err)[:60] + "...",
                     sandbox_fusion.URL_KEY in str(err)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="SandboxFusion's run_code endpoint, http://HOST:PORT/run_code")
    parser.add_argument("--record", help="save every request body and answer to this JSON file")
    args = parser.parse_args(argv)
    recorded: list[dict] = []
    if args.record:
        def keep(response: httpx.Response) -> None:
            response.read()
            recorded.append({"path": response.request.url.path, "request": json.loads(response.request.content),
                             "status_code": response.status_code,
                             "response": response.json() if response.status_code == 200 else response.text})

        sandbox_fusion.set_client(httpx.Client(event_hooks={"response": [keep]}))
    try:
        sandbox_fusion.check_server(args.url)
    except UserError as err:
        print(err, file=sys.stderr)
        return 2
    started = time.monotonic()
    rows = check(args.url)
    print("| case | expected | got | ok |\n|---|---|---|---|")
    for name, want, got, ok in rows:
        print(f"| {name} | {want} | {got} | {'yes' if ok else 'NO'} |")
    print(f"{sum(r[3] for r in rows)}/{len(rows)} as expected in {time.monotonic() - started:.1f} s")
    if args.record:
        Path(args.record).write_text(json.dumps(recorded, indent=1) + "\n")
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
