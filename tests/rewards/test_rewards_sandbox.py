"""The sandbox's behaviour and API, on both backends: results, statuses, limits, backend choice, the
plain fallback. The attacks live in `test_sandbox_hostile.py`.

Limits are small so each case takes at most a couple of seconds.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from tiller.errors import ConfigError
from tiller.rewards import default_compute_score, sandbox
from tiller.rewards.sandbox import _UID_BASE, SandboxLimits, SandboxPool, run_program, sandbox_backend

SMALL = dict(cpu_time_s=1, wall_time_s=3.0, memory_mb=256, max_processes=8, max_file_mb=1, work_mb=8,
             max_output_bytes=64 * 1024)
OWN_UIDS = range(_UID_BASE + (os.getpid() % 40_000) * 10_000, _UID_BASE + (os.getpid() % 40_000 + 1) * 10_000)


def _own_sandbox_processes() -> list[int]:
    """pids of live processes owned by this process's sandbox uids."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as fh:
                    fields = dict(line.split(":", 1) for line in fh if line[:4] in ("Stat", "Uid:"))
                uid, state = int(fields["Uid"].split()[0]), fields["State"].split()[0]
            except (OSError, KeyError, ValueError):
                continue
            if uid in OWN_UIDS and state not in ("Z", "X"):  # zombies are dead, only not yet reaped
                found.append(int(entry))
    return found


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    yield
    assert _own_sandbox_processes() == []


@pytest.fixture(params=sandbox.BACKENDS)
def limits(request) -> SandboxLimits:
    try:
        sandbox_backend(SandboxLimits(backend=request.param))
    except ConfigError as exc:
        pytest.skip(f"{request.param} unavailable: {exc}")
    return SandboxLimits(**SMALL, backend=request.param)


def test_normal_program_runs_with_stdin(limits):
    result = run_program("import sys\nprint(sum(map(int, sys.stdin.read().split())))", "1 2 3\n", limits)
    assert result.ok and result.stdout == "6\n" and result.returncode == 0
    assert result.backend == limits.backend


def test_args_unicode_and_stderr_come_back(limits):
    code = "import sys\nprint(sys.argv[1:], 'héllo ✓')\nprint('to stderr', file=sys.stderr)\n"
    result = run_program(code, limits=limits, args=["a", "b c"])
    assert result.ok and result.stdout == "['a', 'b c'] héllo ✓\n" and result.stderr == "to stderr\n"


def test_exit_codes_and_exceptions_are_errors(limits):
    exited = run_program("import sys\nsys.exit(3)\n", limits=limits)
    assert exited.status == "error" and exited.returncode == 3
    raised = run_program("raise ValueError('boom')\n", limits=limits)
    assert raised.status == "error" and raised.returncode == 1 and "ValueError: boom" in raised.stderr


def test_exit_code_above_128_reads_as_a_signal(limits):
    # documented: the init reports death by signal N as 128 + N, so exit(130) reads as SIGINT
    result = run_program("import sys\nsys.exit(130)\n", limits=limits)
    assert result.status == "error" and result.returncode == -2


def test_infinite_loop_is_stopped_by_the_cpu_limit(limits):
    result = run_program("while True:\n    pass\n", limits=limits)
    assert result.status in ("cpu_limit", "timeout")
    assert result.wall_s < limits.wall_time_s + 1.0


def test_sleeping_program_is_stopped_by_the_wall_clock(limits):
    result = run_program("import time\ntime.sleep(60)\n", limits=SandboxLimits(wall_time_s=1.0, backend=limits.backend))
    assert result.status == "timeout" and result.wall_s < 3.0


def test_gigabytes_of_output_are_capped(limits):
    result = run_program("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", limits=limits)
    assert result.status == "output_limit"
    assert len(result.stdout) <= limits.max_output_bytes and result.wall_s < 3.0


def test_the_program_sees_its_sandbox(limits):
    code = ("import os\nprint(os.getcwd(), os.environ['HOME'], sorted(os.listdir('.')))\n"
            "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n")
    result = run_program(code, limits=limits)
    assert result.ok and result.filesystem_isolated and result.network_isolated
    cwd_line, pids_line = result.stdout.splitlines()
    assert cwd_line == "/tmp /tmp ['main.py']"
    assert pids_line == "['1', '2']"  # the sandbox's init and the program


def test_the_program_can_talk_to_itself_on_its_loopback(limits):
    code = ("import socket\nserver = socket.socket()\nserver.bind(('127.0.0.1', 0))\nserver.listen(1)\n"
            "socket.create_connection(server.getsockname(), timeout=1)\nprint('connected')\n")
    result = run_program(code, limits=limits)
    assert result.ok and result.stdout == "connected\n"


def test_network_true_keeps_the_network(limits):
    result = run_program("print('ran')", limits=SandboxLimits(**{**SMALL, "network": True, "backend": limits.backend}))
    assert result.ok and not result.network_isolated and result.filesystem_isolated


def test_pool_runs_jobs_concurrently_in_order():
    pool = SandboxPool(max_workers=2, limits=SandboxLimits(**SMALL))
    try:
        start = time.monotonic()
        results = pool.map([("import time\ntime.sleep(0.5)\nprint(%d)" % i, "") for i in range(4)])
        assert [r.stdout.strip() for r in results] == ["0", "1", "2", "3"]
        assert time.monotonic() - start < 4 * 0.5 + 2.0
    finally:
        pool.close()


# ---- choosing the backend ---------------------------------------------------------------------------


def test_default_backend_is_bwrap_where_it_works(monkeypatch):
    monkeypatch.delenv("TILLER_SANDBOX", raising=False)
    expected = "bwrap" if sandbox._bwrap_problem(shutil.which("bwrap"), os.geteuid()) is None else "builtin"
    assert sandbox_backend() == expected
    assert run_program("print(1)", limits=SandboxLimits(**SMALL)).backend == expected


def test_env_selects_the_backend_and_an_explicit_field_wins(monkeypatch):
    monkeypatch.setenv("TILLER_SANDBOX", "builtin")
    assert sandbox_backend() == "builtin"
    assert run_program("print(1)", limits=SandboxLimits(**SMALL)).backend == "builtin"
    monkeypatch.setenv("TILLER_SANDBOX", "nonsense")
    assert sandbox_backend(SandboxLimits(backend="builtin")) == "builtin"


def test_unknown_backend_is_a_config_error_listing_the_valid_ones(monkeypatch):
    monkeypatch.delenv("TILLER_SANDBOX", raising=False)
    with pytest.raises(ConfigError, match=r"SandboxLimits.backend='docker'.*valid: auto, bwrap, builtin"):
        sandbox_backend(SandboxLimits(backend="docker"))
    monkeypatch.setenv("TILLER_SANDBOX", "firejail")
    with pytest.raises(ConfigError, match=r"TILLER_SANDBOX='firejail'"):
        run_program("print(1)")


def test_bwrap_asked_for_but_missing_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    monkeypatch.delenv("TILLER_SANDBOX", raising=False)
    with pytest.raises(ConfigError, match=r"bwrap is not on PATH; install bubblewrap"):
        sandbox_backend(SandboxLimits(backend="bwrap"))
    monkeypatch.setenv("TILLER_SANDBOX", "bwrap")
    with pytest.raises(ConfigError, match=r"TILLER_SANDBOX=bwrap, but bwrap is not on PATH"):
        run_program("print(1)")
    monkeypatch.delenv("TILLER_SANDBOX")
    assert sandbox_backend() == "builtin"  # auto falls back
    assert run_program("print(7)", limits=SandboxLimits(**SMALL)).stdout == "7\n"


def test_work_area_must_have_a_size():
    with pytest.raises(ConfigError, match="work_mb must be at least 1"):
        SandboxLimits(work_mb=0)


def test_plain_fallback_runs_and_says_it_is_not_isolated(monkeypatch, tmp_path):
    # where namespaces are refused, builtin still runs the program, with rlimits (and a uid) only
    monkeypatch.setattr(sandbox, "_namespaces_problem", lambda: "unshare refused (test)")
    code = "import os\nopen('inside.txt', 'w').write('x')\nprint(os.path.basename(os.getcwd()).startswith('run-'))"
    result = run_program(code, limits=SandboxLimits(**SMALL, backend="builtin"))
    assert result.ok and result.stdout == "True\n"
    assert not result.filesystem_isolated and not result.network_isolated
    assert result.notes and "unshare refused (test)" in result.notes[0]
    if os.geteuid() == 0:
        assert os.listdir(sandbox._sandbox_root()) == []  # its work dir is gone


def test_a_sandbox_that_cannot_be_built_is_start_failed(monkeypatch):
    monkeypatch.setattr(sandbox, "_root_layout", lambda python: (("bind", "/nonexistent-tiller-dir", "/usr"),))
    result = sandbox._run("print(1)", "", SandboxLimits(**SMALL), (), "namespaces")
    assert result.status == "start_failed" and "setup failed" in result.stderr and "mount" in result.stderr


# ---- the rest of tiller, unchanged ------------------------------------------------------------------


def test_code_scorer_scores_right_and_wrong_answers():
    truth = {"inputs": ["2 3\n", "10 5\n"], "outputs": ["5\n", "15\n"]}
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
    assert default_compute_score("codecontests", right, truth)["score"] == 1.0
    assert default_compute_score("codecontests", wrong, truth)["score"] == 0.0


def test_python_tool_runs_in_the_sandbox():
    from tiller.rollout.tools import PythonTool

    assert PythonTool({"timeout_s": 2})({"code": "print(2**10)"}) == "1024"


@pytest.mark.parametrize(
    "attack",
    [
        "while True:\n    pass",
        "import os\nwhile True:\n    os.fork()",
        "x = bytearray(2**40)",
        "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)",
        "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)",
    ],
)
def test_hostile_code_answers_score_zero(attack):
    truth = {"inputs": ["1\n"], "outputs": ["1\n"]}
    result = default_compute_score("codecontests", f"```python\n{attack}\n```", truth,
                                   cpu_time_s=1, wall_time_s=2.0, memory_mb=256)
    assert result["score"] == 0.0
