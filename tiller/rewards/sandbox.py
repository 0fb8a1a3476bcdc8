"""A sandbox for model-written programs: each run is one resource-limited subprocess.

Per run:
- its own session and process group (`start_new_session=True`), killed as a group on timeout;
- an empty temporary working directory (the program file is the only thing in it);
- a minimal environment (PATH, LANG, HOME=TMPDIR=the work dir): nothing of ours leaks (no tokens);
- in the child, before exec (`preexec_fn`): a new network namespace (`unshare(CLONE_NEWNET)`, only
  a downed loopback inside, so no sockets reach anything); as root also a private mount namespace
  with fresh tmpfs over /tmp, /var/tmp and /dev/shm (the world-writable places), so nothing the
  program writes outside its work dir reaches the host; then rlimits: CPU time, address space,
  processes, file size, open files, no core dumps;
- when we run as root (containers, CI), the child also drops to an unprivileged uid of its own
  (one per concurrent run, no passwd entry needed), because root ignores RLIMIT_NPROC: this is what
  bounds a fork bomb, stops the program from killing its parent or other processes, reading
  /proc/<our pid>/environ, or writing into root-owned directories. After the run every process of
  that uid is killed (catches children that escaped the process group with setsid);
- captured stdout/stderr are capped (`max_output_bytes`): past the cap the group is killed;
- a wall-clock deadline on top of RLIMIT_CPU (sleeping programs use no CPU).

Best effort, documented: without root and without unprivileged user namespaces there is no uid
switch (RLIMIT_NPROC then counts all processes of the user, and the program could signal processes
of the same user); if `unshare` is refused the network stays reachable (`network_isolated=False`
in the result). Without root there is no private /tmp: the work dir's parent is private (0o711), but
world-writable directories stay writable (up to RLIMIT_FSIZE per file). `preexec_fn` runs between fork and exec; it only makes syscalls (no locks, no imports).

`SandboxPool.map` runs many programs concurrently (threads waiting on subprocesses).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 16384, 1 << 18
_SCRATCH_DIRS = (b"/tmp", b"/var/tmp", b"/dev/shm")
_UID_BASE = 1_600_000_000
_uid_counter = itertools.count()
_uid_lock = threading.Lock()
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one run."""

    cpu_time_s: int = 5
    """RLIMIT_CPU (seconds of CPU); SIGXCPU / SIGKILL past it."""
    wall_time_s: float = 10.0
    """Wall-clock deadline; the whole group is killed past it."""
    memory_mb: int = 1024
    """RLIMIT_AS (virtual address space) in MiB."""
    max_processes: int = 16
    """RLIMIT_NPROC (processes and threads of the run's uid)."""
    max_file_mb: int = 16
    """RLIMIT_FSIZE: largest file the program may write, MiB."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    max_output_bytes: int = 1 << 20
    """Cap on captured stdout + stderr; past it the run is killed (status output_limit)."""
    network: bool = False
    """Allow network access (default: a new, empty network namespace)."""


@dataclass
class RunResult:
    """Outcome of one run. status: ok | error | timeout | cpu_limit | output_limit | start_failed."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    network_isolated: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _is_root() -> bool:
    return os.geteuid() == 0


def _world_executable(path: str) -> bool:
    """True when an unprivileged uid can execute `path` (every ancestor dir traversable by others)."""
    real = os.path.realpath(path)
    if not os.path.isfile(real) or not os.stat(real).st_mode & stat.S_IXOTH:
        return False
    parent = os.path.dirname(real)
    while True:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        if parent == os.path.dirname(parent):
            return True
        parent = os.path.dirname(parent)


def sandbox_python() -> str:
    """The interpreter for sandboxed programs: ours, or a system one the unprivileged uid can run."""
    if not _is_root():
        return sys.executable
    for candidate in (sys.executable, shutil.which("python3") or "", "/usr/bin/python3"):
        if candidate and _world_executable(candidate):
            return candidate
    return sys.executable


_ROOT_DIR: str | None = None
# The work dir's path may be covered by the private /tmp; the process still holds it as its cwd,
# so the program is opened relative to the cwd.
_BOOTSTRAP = ("import sys; sys.argv[0] = 'main.py'; exec(compile(open('main.py', encoding='utf-8').read(), "
              "'main.py', 'exec'), {'__name__': '__main__', '__file__': 'main.py', '__builtins__': __builtins__})")


def _sandbox_root() -> str:
    """A private parent for work dirs (0o711: others may traverse, not list or write), so a program
    cannot write next to its own directory (`../x`)."""
    global _ROOT_DIR
    if _ROOT_DIR is None or not os.path.isdir(_ROOT_DIR):
        _ROOT_DIR = tempfile.mkdtemp(prefix="tiller-sandboxes-")
        os.chmod(_ROOT_DIR, 0o711)
    return _ROOT_DIR


def _allocate_uid() -> int:
    with _uid_lock:
        slot = next(_uid_counter) % 10_000
    return _UID_BASE + (os.getpid() % 40_000) * 10_000 + slot


def _make_preexec(limits: SandboxLimits, uid: int | None):
    """Build the function run in the child between fork and exec (syscalls only)."""

    def preexec() -> None:
        net = 0 if limits.network else CLONE_NEWNET
        if uid is not None and _libc.unshare(net | CLONE_NEWNS) == 0:
            # Private mounts first, so nothing below propagates to the host; then fresh, small tmpfs
            # scratch dirs. The process keeps its cwd (the work dir) even where /tmp is covered.
            if _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0:
                size = b"size=%dm,mode=1777" % (2 * limits.max_file_mb)
                for scratch in _SCRATCH_DIRS:
                    _libc.mount(b"tmpfs", scratch, b"tmpfs", MS_NOSUID | MS_NODEV, size)
        elif net:
            _libc.unshare(net)  # failure leaves the network as it is (reported by the probe)
        cpu = max(1, int(limits.cpu_time_s))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        mem = limits.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        size = limits.max_file_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return preexec


_NETNS_OK: bool | None = None


def network_isolation_available() -> bool:
    """Probe once whether this kernel lets us `unshare(CLONE_NEWNET)`."""
    global _NETNS_OK
    if _NETNS_OK is None:

        def probe() -> None:
            if _libc.unshare(CLONE_NEWNET) != 0:
                os._exit(3)

        try:
            rc = subprocess.run(["/bin/true"], preexec_fn=probe, timeout=10).returncode
        except (OSError, subprocess.SubprocessError):
            rc = 1
        _NETNS_OK = rc == 0
    return _NETNS_OK


def _kill_uid(uid: int) -> None:
    """SIGKILL every process whose real uid is `uid` (children that left the process group)."""
    for _ in range(3):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as fh:
                    fields = dict(line.split(":", 1) for line in fh if line[:4] in ("Stat", "Uid:"))
                if fields["State"].split()[0] in ("Z", "X"):  # already dead, waiting to be reaped
                    continue
                if int(fields["Uid"].split()[0]) == uid:
                    found = True
                    os.kill(int(entry), signal.SIGKILL)
            except (OSError, KeyError, ValueError):
                continue
        if not found:
            return
        time.sleep(0.01)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(proc: subprocess.Popen, stdin: bytes, limits: SandboxLimits) -> tuple[bytes, bytes, str]:
    """Feed stdin, read capped output until exit or deadline. Returns (stdout, stderr, status)."""
    deadline = time.monotonic() + limits.wall_time_s
    out, err, total = bytearray(), bytearray(), 0
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)  # type: ignore[arg-type]
    sel.register(proc.stderr, selectors.EVENT_READ, err)  # type: ignore[arg-type]
    writer = threading.Thread(target=_feed, args=(proc, stdin), daemon=True)
    writer.start()
    status = ""
    while sel.get_map():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            status = "timeout"
            break
        if proc.poll() is not None and not sel.select(timeout=0):
            break  # exited; a background child may hold the pipes open, do not wait for it
        for key, _ in sel.select(timeout=min(remaining, 0.05)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            total += len(chunk)
            key.data.extend(chunk[: max(0, limits.max_output_bytes - (total - len(chunk)))])
            if total > limits.max_output_bytes:
                status = "output_limit"
                break
        if status:
            break
    sel.close()
    return bytes(out), bytes(err), status


def _feed(proc: subprocess.Popen, data: bytes) -> None:
    try:
        if data:
            proc.stdin.write(data)  # type: ignore[union-attr]
        proc.stdin.close()  # type: ignore[union-attr]
    except (BrokenPipeError, OSError, ValueError):
        pass


def run_program(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(), args: list[str] = ()) -> RunResult:
    """Run Python `code` in the sandbox with `stdin`; never raises for anything the program does."""
    uid = _allocate_uid() if _is_root() else None
    isolated = (not limits.network) and network_isolation_available()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="run-", dir=_sandbox_root()) as workdir:
        program = os.path.join(workdir, "main.py")
        with open(program, "w", encoding="utf-8") as fh:
            fh.write(code)
        os.chmod(program, 0o444)
        if uid is not None:
            os.chown(workdir, uid, uid)
        os.chmod(workdir, 0o700)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir,
               "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        try:
            proc = subprocess.Popen(
                [sandbox_python(), "-I", "-c", _BOOTSTRAP, *args], cwd=workdir, env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, preexec_fn=_make_preexec(limits, uid), close_fds=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return RunResult("start_failed", None, "", str(exc), time.monotonic() - start, isolated)
        try:
            out, err, status = _collect(proc, stdin.encode("utf-8", "replace"), limits)
        finally:
            _kill_group(proc)
            if uid is not None:
                _kill_uid(uid)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    pipe.close()  # type: ignore[union-attr]
                except OSError:
                    pass
            returncode = proc.wait()
    if not status:
        status = "ok" if returncode == 0 else "cpu_limit" if returncode == -signal.SIGXCPU else "error"
    return RunResult(status, returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                     time.monotonic() - start, isolated)


class SandboxPool:
    """Run many programs concurrently: `max_workers` subprocesses at a time."""

    def __init__(self, max_workers: int = 4, limits: SandboxLimits = SandboxLimits()):
        self.limits = limits
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tiller-sandbox")

    def map(self, jobs: list[tuple[str, str]]) -> list[RunResult]:
        """`jobs` = [(code, stdin), ...] -> one RunResult each, in order."""
        return list(self._executor.map(lambda job: run_program(job[0], job[1], self.limits), jobs))

    def close(self) -> None:
        self._executor.shutdown(wait=True)
