"""The sandbox's hostility suite: every attack is contained, reported, and scores 0.

Limits are small so each case takes at most a couple of seconds. The parent-killing case runs
inside a sacrificial wrapper process, so a failure could never take pytest down with it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tiller.rewards import default_compute_score
from tiller.rewards.sandbox import _UID_BASE, SandboxLimits, SandboxPool, run_program

SMALL = SandboxLimits(cpu_time_s=1, wall_time_s=3.0, memory_mb=256, max_processes=8, max_file_mb=1,
                      max_output_bytes=64 * 1024)


def _sandbox_processes() -> list[int]:
    """pids of live processes owned by sandbox uids."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as fh:
                    fields = dict(line.split(":", 1) for line in fh if line[:4] in ("Stat", "Uid:"))
                uid, state = int(fields["Uid"].split()[0]), fields["State"].split()[0]
            except (OSError, KeyError, ValueError):
                continue
            if uid >= _UID_BASE and state not in ("Z", "X"):  # zombies are dead, only not yet reaped
                found.append(int(entry))
    return found


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    yield
    assert _sandbox_processes() == []


def test_normal_program_runs_with_stdin():
    result = run_program("import sys\nprint(sum(map(int, sys.stdin.read().split())))", "1 2 3\n", SMALL)
    assert result.ok and result.stdout == "6\n"


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    result = run_program("while True:\n    pass\n", limits=SMALL)
    assert result.status in ("cpu_limit", "timeout")
    assert result.wall_s < SMALL.wall_time_s + 1.0


def test_sleeping_program_is_stopped_by_the_wall_clock():
    result = run_program("import time\ntime.sleep(60)\n", limits=SandboxLimits(wall_time_s=1.0))
    assert result.status == "timeout"
    assert result.wall_s < 3.0


def test_fork_bomb_is_bounded_and_cleaned_up():
    if os.geteuid() == 0:
        pass  # the run drops to its own uid, where RLIMIT_NPROC binds
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_program(code, limits=SandboxLimits(cpu_time_s=1, wall_time_s=1.5, max_processes=8))
    assert result.status == "timeout"
    assert result.wall_s < 4.0  # and the autouse fixture checks every forked child is gone


def test_children_that_escape_the_process_group_are_killed():
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')\n")
    result = run_program(code, limits=SMALL)
    assert result.ok and "parent done" in result.stdout


def test_memory_bomb_hits_the_address_space_limit():
    result = run_program("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))\n", limits=SMALL)
    assert result.status == "error" and "MemoryError" in result.stderr


def test_writing_outside_its_directory_fails(tmp_path):
    target = tmp_path / "escaped.txt"
    shared_tmp = f"/tmp/tiller-sandbox-escape-{os.getpid()}.txt"
    code = (
        "import os\n"
        f"for path in [{str(target)!r}, '../escaped.txt', {os.path.abspath('escaped_by_sandbox.txt')!r}]:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('WROTE', path)\n"
        "    except OSError as exc:\n"
        "        print('denied', path, type(exc).__name__)\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print('inside ok')\n"
        f"open({shared_tmp!r}, 'w').write('x')\n"  # as root: lands in the run's private tmpfs
    )
    result = run_program(code, limits=SMALL)
    assert "WROTE" not in result.stdout, result.stdout
    assert "inside ok" in result.stdout
    assert not target.exists() and not os.path.exists("escaped_by_sandbox.txt")
    if os.geteuid() == 0:
        assert not os.path.exists(shared_tmp)


def test_big_file_is_stopped_by_the_file_size_limit():
    result = run_program("open('big', 'wb').write(b'x' * (8 * 2**20))\n", limits=SMALL)  # 8 MiB > 1 MiB
    assert not result.ok


def test_socket_cannot_reach_a_local_server():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    code = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', %d), timeout=1)\n    print('CONNECTED')\n"
            "except OSError as exc:\n    print('blocked', exc)\n") % port
    result = run_program(code, limits=SMALL)
    thread.join()
    server.close()
    assert result.network_isolated
    assert "CONNECTED" not in result.stdout and "blocked" in result.stdout
    assert accepted == []


def test_environment_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("TILLER_TEST_SECRET", "hunter2-secret-value")
    code = (
        "import os\nprint(dict(os.environ))\n"
        "for pid in (os.getppid(), 1):\n"
        "    try:\n        print(open(f'/proc/{pid}/environ').read())\n"
        "    except OSError as exc:\n        print('denied', exc)\n"
    )
    result = run_program(code, limits=SMALL)
    assert result.ok
    assert "hunter2-secret-value" not in result.stdout + result.stderr


def test_gigabytes_of_output_are_capped():
    result = run_program("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", limits=SMALL)
    assert result.status == "output_limit"
    assert len(result.stdout) <= SMALL.max_output_bytes
    assert result.wall_s < 3.0


WRAPPER = """
import json, sys
from tiller.rewards.sandbox import SandboxLimits, run_program
code = "import os, signal\\nfor target in (os.getppid(),):\\n    try:\\n        os.kill(target, signal.SIGKILL)\\n        print('KILLED', target)\\n    except OSError as exc:\\n        print('denied', exc)\\ntry:\\n    os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)\\nexcept OSError as exc:\\n    print('denied pg', exc)\\n"
result = run_program(code, limits=SandboxLimits(cpu_time_s=1, wall_time_s=3.0))
print(json.dumps({"status": result.status, "stdout": result.stdout}))
"""


def test_killing_its_parent_fails():
    # The sandboxed program's parent is the wrapper process; if containment failed the wrapper would
    # die with SIGKILL instead of printing the result.
    proc = subprocess.run([sys.executable, "-c", WRAPPER], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "KILLED" not in report["stdout"]


def test_pool_runs_jobs_concurrently_in_order():
    pool = SandboxPool(max_workers=2, limits=SMALL)
    try:
        start = time.monotonic()
        results = pool.map([("import time\ntime.sleep(0.5)\nprint(%d)" % i, "") for i in range(4)])
        assert [r.stdout.strip() for r in results] == ["0", "1", "2", "3"]
        assert time.monotonic() - start < 4 * 0.5 + 2.0
    finally:
        pool.close()


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
