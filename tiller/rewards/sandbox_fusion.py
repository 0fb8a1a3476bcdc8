"""Code rewards from a SandboxFusion server (bytedance/SandboxFusion), as verl scores them.

verl (`verl/utils/reward_score/sandbox_fusion`) sends the code of a completion to a SandboxFusion `/run_code`
endpoint once per test case and compares stdout. tiller does the same, with the same facts:

- routed data sources: `codecontests`, `apps`, `codeforces`, `taco` (verl's `default_compute_score` table), only
  when `reward.sandbox_fusion.url` is set; every other data source keeps its own scorer.
- the code: the text after the last "```python" up to the next fence; else the first fenced block (its first line
  dropped when it is a bare word such as `cpp`); no fence at all scores 0.
- one POST per test case: `{"compile_timeout": 10, "run_timeout": 10, "code", "stdin", "memory_limit_MB",
  "language": "python", "files": {}, "fetch_files": []}`; the HTTP time limit is compile + run + 10 s; a 504 answer
  is retried (3 attempts, 1 s then 2 s apart), any other failure is not.
- a case passes when the server answers `status: Success` with `run_result.status: Finished` and stdout equals the
  expected output after stripping trailing newlines (an expected `null`, as for `assert_case` tests, passes on
  any output). Outcomes (verl's numbers): True pass, False wrong answer, -1 API / sandbox error, -2 runtime error
  (non-zero exit), -3 time limit, -4 compile error (and every later case after the first compile error).
- call-based tests (`fn_name`): the code runs inside a harness that reads one JSON value per stdin line as the
  positional arguments, calls `fn_name` (a global, else a method of `Solution()`), and prints the result (JSON for
  dict / list / tuple / None / bool, else `str`); errors go to stderr with exit code 0, as in verl.
- score (verl's `continuous=True`): the fraction of the first min(N, 10) cases that pass.
- at most `max_concurrent` requests in flight across all reward workers (verl: a `multiprocessing.Manager`
  semaphore; here `SlotSemaphore`, file locks that a killed worker releases).

A request that fails (server down mid-run, bad answer) makes its case -1, scoring 0 as in verl; tiller also
counts such cases in the per-sample extra `sandbox_errors` and says so once per process on stderr, and
`check_server` refuses, before training, a url that does not run a test program.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from tiller.errors import UserError

SANDBOX_FUSION_SOURCES = ("codecontests", "apps", "codeforces", "taco")
DEFAULT_TIMEOUT_S = 10
DEFAULT_MAX_CONCURRENT = 64
DEFAULT_MEMORY_LIMIT_MB = 1024
MAX_ATTEMPTS = 3
RETRY_DELAY_S = 1.0
API_SLACK_S = 10
CONTINUOUS_CASES = 10
URL_KEY = "reward.sandbox_fusion.url"
# the languages SandboxFusion's /run_code accepts (its `Language` literal)
LANGUAGES = ("python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql", "rust",
             "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit", "kotlin_script", "jest",
             "verilog", "python_gpu", "lean", "swift", "racket")

API_ERROR, RUNTIME_ERROR, TIMEOUT, COMPILE_ERROR = -1, -2, -3, -4


@dataclass
class CaseResult:
    """One test case: `outcome` is True / False / API_ERROR / RUNTIME_ERROR / TIMEOUT / COMPILE_ERROR, `status`
    names it (success, wrong_answer, api_error, sandbox_error, runtime_error, timeout, compile_error, ...)."""

    outcome: bool | int
    status: str
    stdout: str | None = None
    stderr: str | None = None
    exit_code: int | None = None
    error: str | None = None


class SlotSemaphore:
    """A counting semaphore shared by processes: a holder keeps an exclusive `flock` on one of `slots` files in
    `directory`. It pickles as (directory, slots), so reward worker processes share it, and the kernel drops the
    lock of a process that dies holding it (a worker killed at its deadline frees its slot)."""

    def __init__(self, directory: str, slots: int, poll_s: float = 0.02):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.directory, self.slots, self.poll_s = directory, slots, poll_s
        self._held = threading.local()
        self._local = threading.BoundedSemaphore(slots)  # this process's threads queue here, not on the files

    def __getstate__(self) -> tuple:
        return self.directory, self.slots, self.poll_s

    def __setstate__(self, state: tuple) -> None:
        self.__init__(*state)

    def acquire(self, timeout: float | None = None) -> bool:
        """Take a free slot (waiting at most `timeout` seconds; None: until one frees); False when none did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._local.acquire(timeout=timeout):
            return False
        first, pause = random.randrange(self.slots), 0.001
        while True:
            for k in range(self.slots):
                fd = os.open(os.path.join(self.directory, f"slot-{(first + k) % self.slots}"), os.O_RDWR | os.O_CREAT)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._held.__dict__.setdefault("fds", []).append(fd)
                return True
            if deadline is not None and time.monotonic() >= deadline:
                self._local.release()
                return False
            time.sleep(pause)  # another process holds every slot: look again, less often the longer it lasts
            pause = min(2 * pause, self.poll_s)

    def release(self) -> None:
        fd = self._held.fds.pop()
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        self._local.release()

    def __enter__(self) -> "SlotSemaphore":
        if not self.acquire():
            raise RuntimeError(f"no slot of {self.directory} could be taken")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


_CLIENT = None
_CLIENT_LOCK = threading.Lock()
_WARNED = False


def _client():
    global _CLIENT
    with _CLIENT_LOCK:
        if _CLIENT is None:
            import httpx

            _CLIENT = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return _CLIENT


def set_client(client: Any) -> None:
    """Send the requests of this process through `client` (an `httpx.Client`: a recording or test transport)."""
    global _CLIENT
    with _CLIENT_LOCK:
        _CLIENT = client


def run_code(url: str, code: str, stdin: str | None, *, compile_timeout: float = DEFAULT_TIMEOUT_S,
             run_timeout: float = DEFAULT_TIMEOUT_S, memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
             language: str = "python") -> tuple[dict | None, str | None]:
    """(the server's JSON answer, None) or (None, what failed) for one POST to a SandboxFusion `/run_code` url."""
    import httpx

    if language not in LANGUAGES:
        return None, f"unsupported language {language!r}"
    payload = {"compile_timeout": compile_timeout, "run_timeout": run_timeout, "code": code, "stdin": stdin,
               "memory_limit_MB": memory_limit_mb, "language": language, "files": {}, "fetch_files": []}
    limit = compile_timeout + run_timeout + API_SLACK_S
    error = "no attempt made"
    for attempt in range(MAX_ATTEMPTS):
        try:
            reply = _client().post(url, json=payload, timeout=limit, headers={"Accept": "application/json"})
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        if reply.status_code == 504:  # the only answer verl retries, 1 s, 2 s, ... apart
            error = f"Gateway Timeout (504) on attempt {attempt + 1}/{MAX_ATTEMPTS}"
            if attempt < MAX_ATTEMPTS - 1:
                time.sleep(RETRY_DELAY_S * (attempt + 1))
            continue
        if reply.status_code >= 400:
            return None, f"HTTP {reply.status_code}: {reply.text[:200]}"
        try:
            answer = reply.json()
        except ValueError as exc:
            return None, f"the answer is not JSON ({exc}): {reply.text[:200]}"
        return (answer, None) if isinstance(answer, dict) else (None, f"the answer is not a JSON object: "
                                                                      f"{reply.text[:200]}")
    return None, error


def classify(response: dict, expected: Any) -> CaseResult:
    """A `/run_code` answer judged against the expected stdout (None: any output passes)."""
    compiled, ran = response.get("compile_result") or {}, response.get("run_result") or {}
    result = CaseResult(API_ERROR, "unknown", ran.get("stdout"), ran.get("stderr"), ran.get("return_code"))
    status = response.get("status")
    if status == "SandboxError":
        result.status = "sandbox_error"
    elif status == "Failed":
        if compiled and (compiled.get("status") in ("Error", "TimeLimitExceeded")
                         or (compiled.get("status") == "Finished" and compiled.get("return_code") != 0)):
            result.outcome = COMPILE_ERROR
            result.status = "compile_timeout" if compiled.get("status") == "TimeLimitExceeded" else "compile_error"
            result.stderr = compiled.get("stderr")
        elif ran.get("status") == "TimeLimitExceeded":
            result.outcome, result.status = TIMEOUT, "timeout"
        elif ran.get("status") == "Error" or (ran.get("status") == "Finished" and ran.get("return_code") != 0):
            result.outcome, result.status = RUNTIME_ERROR, "runtime_error"
        else:
            result.status = "unknown_failure"
    elif status == "Success":
        if ran.get("status") == "Finished":
            got = ran.get("stdout") or ""
            ok = expected is None or str(got).rstrip("\n") == str(expected).rstrip("\n")
            result.outcome, result.status = ok, ("success" if ok else "wrong_answer")
        else:
            result.status = "unexpected_success_state"
    else:
        result.status = f"unknown_api_status_{status}"
    return result


# names verl's call harness brings into scope before the user's code (the user's code may rely on them)
_HARNESS_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                    "statistics", "itertools", "functools", "operator", "io", "sys", "json", "builtins", "typing")
_HARNESS_TAIL = '''
import json as _h_json, sys as _h_sys, traceback as _h_tb
_h_name = {name!r}


def _h_call():
    raw = _h_sys.stdin.read()
    args = []
    if raw.strip():
        try:
            args = [_h_json.loads(line) for line in raw.split("\\n")]
        except _h_json.JSONDecodeError as err:
            _h_sys.stderr.write(f"WrapperError: Invalid JSON input for {{_h_name!r}}: {{err}}\\n")
            return None, True
    try:
        target = None
        if _h_name in globals():
            target = globals()[_h_name]
        elif "Solution" in globals():
            target = getattr(globals()["Solution"](), _h_name)
        if not target:
            _h_sys.stderr.write(f"WrapperError: Function or method {{_h_name!r}} not found.\\n")
            return None, True
        return target(*args), False
    except Exception:
        _h_sys.stderr.write(_h_tb.format_exc())
        return None, True


_h_result, _h_failed = _h_call()
if not _h_failed:
    if isinstance(_h_result, (dict, list, tuple, bool)) or _h_result is None:
        print(_h_json.dumps(_h_result))
    else:
        print(str(_h_result))
'''


def call_harness(code: str, fn_name: str) -> str:
    """`code` wrapped to run as a call-based test of `fn_name` (arguments: one JSON value per stdin line)."""
    head = "".join(f"from {m} import *\n" for m in _HARNESS_MODULES)
    head += "".join(f"import {m}\n" for m in _HARNESS_MODULES if m not in ("builtins", "typing"))
    return f"{head}\n{code}\n{_HARNESS_TAIL.format(name=fn_name)}"


def _run_case(url: str, code: str, stdin: Any, expected: Any, timeout: float, memory_limit_mb: int, language: str,
              semaphore: Any) -> CaseResult:
    stdin = None if stdin is None else str(stdin)
    with semaphore if semaphore is not None else contextlib.nullcontext():
        response, error = run_code(url, code, stdin, compile_timeout=timeout, run_timeout=timeout,
                                   memory_limit_mb=memory_limit_mb, language=language)
    if error is not None or not response:
        _warn_once(url, error or "empty answer")
        return CaseResult(API_ERROR, "api_error", error=error or "empty answer")
    return classify(response, expected)


def _warn_once(url: str, error: str) -> None:
    global _WARNED
    if not _WARNED:
        _WARNED = True
        print(f"warning: SandboxFusion at {url} failed a request ({error}); such test cases score 0 (as in verl), "
              "counted in reward_extra/sandbox_errors", file=sys.stderr)


def run_cases(url: str, code: str, tests: dict, *, timeout: float = DEFAULT_TIMEOUT_S,
              memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB, language: str = "python",
              semaphore: Any = None) -> list[CaseResult]:
    """Run `code` on each case of `tests` ({"inputs", "outputs"}, optional "fn_name", "assert_case"), cases in
    parallel threads (in flight at once: as many as `semaphore` lets through). Malformed tests: all cases -1."""
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        return [CaseResult(API_ERROR, "invalid_tests", error="tests need 'inputs' and 'outputs' lists")]
    asserts = tests.get("assert_case", [""] * len(inputs))
    if len(outputs) != len(inputs) or not isinstance(asserts, list) or len(asserts) != len(inputs):
        return [CaseResult(API_ERROR, "invalid_tests", error="inputs / outputs / assert_case counts differ")
                for _ in inputs]
    if not inputs:
        return []
    fn_name = tests.get("fn_name")

    def program(i: int) -> str:
        source = f"{code}\n\n{asserts[i]}"
        return call_harness(source, fn_name) if fn_name and language == "python" else source

    workers = min(len(inputs), max(32, 5 * (os.cpu_count() or 1)))  # verl's pool size; the semaphore bounds requests
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tiller-sandbox-fusion")
    try:
        results = list(pool.map(lambda i: _run_case(url, program(i), inputs[i], outputs[i], timeout, memory_limit_mb,
                                                    language, semaphore), range(len(inputs))))
    finally:  # interrupted (reward_model.timeout): drop the queued cases, leave the running requests to end alone
        pool.shutdown(wait=False, cancel_futures=True)
    first_compile_error = next((i for i, r in enumerate(results) if r.outcome == COMPILE_ERROR), None)
    if first_compile_error is not None:  # verl: every later case counts as a compile error too
        for r in results[first_compile_error + 1:]:
            if r.outcome != COMPILE_ERROR:
                r.outcome, r.status = COMPILE_ERROR, "compile_error_skipped"
    return results


def extract_solution(completion: str) -> str | None:
    """The code verl's SandboxFusion scorer takes from a completion, None when it has no fence.

    >>> extract_solution("x\\n```python\\nprint(1)\\n```")
    '\\nprint(1)\\n'
    >>> extract_solution("```cpp\\nint main(){}\\n```")
    'int main(){}\\n'
    >>> extract_solution("print(1)") is None
    True
    """
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    if "```" not in completion:
        return None
    solution = completion.split("```")[1]
    if "\n" in solution:
        first, rest = solution.split("\n", 1)
        if first.strip().isalpha():
            solution = rest
    return solution


def compute_score(sandbox_fusion_url: str, concurrent_semaphore: Any, memory_limit_mb: int | None, completion: str,
                  test_cases: Any, continuous: bool = False, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """verl's SandboxFusion score of one completion: the pass fraction of all cases, or with `continuous` of the
    first 10. Returns {score, pass_rate (all cases), num_tests, sandbox_errors (cases the server did not judge)}."""
    empty = {"score": 0.0, "pass_rate": 0.0, "num_tests": 0.0, "sandbox_errors": 0.0}
    code = extract_solution(completion)
    if code is None:
        return empty
    if not isinstance(test_cases, dict):
        try:
            test_cases = json.loads(test_cases)
        except (TypeError, ValueError):
            return empty
    if not isinstance(test_cases, dict):
        return empty
    if isinstance(test_cases.get("assert_case"), list):
        test_cases = dict(test_cases)
        test_cases.setdefault("inputs", [""] * len(test_cases["assert_case"]))
        test_cases.setdefault("outputs", [None] * len(test_cases["assert_case"]))
    elif "inputs" not in test_cases or "outputs" not in test_cases:
        return empty
    memory = DEFAULT_MEMORY_LIMIT_MB if memory_limit_mb is None else int(memory_limit_mb)
    results = run_cases(sandbox_fusion_url, code, test_cases, timeout=timeout, memory_limit_mb=memory,
                        semaphore=concurrent_semaphore)
    if not results:
        return empty
    passed = [r.outcome is True for r in results]
    counted = passed[:CONTINUOUS_CASES] if continuous else passed
    return {"score": sum(counted) / len(counted), "pass_rate": sum(passed) / len(passed),
            "num_tests": float(len(results)), "sandbox_errors": float(sum(r.outcome == API_ERROR and r.status != "invalid_tests" for r in results))}


def check_server(url: str, memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB, key: str = URL_KEY) -> None:
    """Run one tiny program on the server; a `UserError` naming `key` when the url does not run it."""
    response, error = run_code(url, "print('tiller')", "", memory_limit_mb=memory_limit_mb)
    if error is None and response is not None:
        result = classify(response, "tiller")
        if result.outcome is True:
            return
        error = f"the test program gave {result.status} ({json.dumps(response)[:300]})"
    raise UserError(f"{key}={url}: SandboxFusion did not run a test program: {error}. Start the server (docs/rewards.md"
                    ", SandboxFusion) or fix the url (SandboxFusion's endpoint is http://HOST:PORT/run_code)")
