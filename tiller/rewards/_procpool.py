"""A pool of worker processes whose running tasks can be killed at a deadline.

`concurrent.futures.ProcessPoolExecutor` cannot stop a task that hangs (a sympy simplification that
never ends, a user reward function in an infinite loop), so the reward code uses this instead: each
worker runs one task at a time; a task past its deadline has its worker killed (SIGKILL) and
replaced, and its outcome is `timeout`. Workers are fresh interpreters (`python -m tiller.rewards._procpool`,
never `fork`, which is unsafe in a process running torch threads, and never multiprocessing's
`spawn`, which re-imports the user's `__main__`); they may start their own pools, and they die
with their parent (PR_SET_PDEATHSIG) or when their pipe closes.

Functions travel as references, not pickles: `("module", "pkg.mod", "func")` or
`("file", "/path/to/file.py", "func")`, resolved and cached inside the worker.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

FuncRef = tuple[str, str, str]
_PR_SET_PDEATHSIG = 1


@dataclass
class TaskOutcome:
    """What became of one task: status is ok | error | timeout | crashed."""

    status: str
    value: Any = None
    error: str = ""


def resolve_ref(ref: FuncRef):
    """Import the function a `FuncRef` names."""
    kind, where, name = ref
    if kind == "module":
        module = importlib.import_module(where)
    elif kind == "file":
        spec = importlib.util.spec_from_file_location(f"_tiller_user_{abs(hash(where))}", where)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {where}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        raise ValueError(f"unknown function reference kind {kind!r}")
    return getattr(module, name)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the EOF on the pipe still ends an idle worker
        pass


def _worker_main(conn: Connection, out: Connection, preload: tuple[str, ...]) -> None:
    _die_with_parent()
    for module in preload:
        importlib.import_module(module)
    out.send(("ready",))
    cache: dict[FuncRef, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, ref, args, kwargs = msg
        try:
            if ref not in cache:
                cache[ref] = resolve_ref(ref)
            reply = (task_id, "ok", cache[ref](*args, **kwargs), "")
        except BaseException as exc:  # noqa: BLE001 - any failure of user code is an outcome
            reply = (task_id, "error", None, f"{type(exc).__name__}: {exc}")
        try:
            out.send(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
            out.send((task_id, "error", None, f"result could not be sent back: {exc}"))


class _Worker:
    """One `python -m tiller.rewards._procpool` child talking over two pipes."""

    def __init__(self, preload: tuple[str, ...], start_timeout: float):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        cmd = [sys.executable, "-m", "tiller.rewards._procpool", str(to_child_r), str(from_child_w), *preload]
        try:
            self.process = subprocess.Popen(cmd, pass_fds=(to_child_r, from_child_w), env=env, close_fds=True)
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self._send = Connection(to_child_w, readable=False)
        self.conn = Connection(from_child_r, writable=False)
        if not self.conn.poll(start_timeout):
            self.kill()
            raise RuntimeError(f"reward worker did not start within {start_timeout} s")
        self.conn.recv()

    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, msg) -> None:
        self._send.send(msg)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self._send.close()
        self.conn.close()


class KillablePool:
    """`num_workers` processes; `map` runs tasks with a per-task deadline. Thread-safe (one map at a time)."""

    def __init__(self, num_workers: int = 1, preload: tuple[str, ...] = (), start_timeout: float = 120.0):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self._preload = tuple(preload)
        self._start_timeout = start_timeout
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        _POOLS.add(self)

    def _ensure_workers(self) -> None:
        if self._pid != os.getpid():  # inherited through fork: the workers belong to the parent
            self._workers, self._pid = [], os.getpid()
        for worker in [w for w in self._workers if not w.alive()]:  # e.g. killed with its parent thread
            self._replace(worker)
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._preload, self._start_timeout))

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)

    def map(self, ref: FuncRef, arg_list: list[tuple], timeout: float, kwargs: dict | None = None) -> list[TaskOutcome]:
        """Run `ref(*args, **kwargs)` for each args tuple; each task may run `timeout` seconds."""
        kwargs = kwargs or {}
        with self._lock:
            self._ensure_workers()
            outcomes: list[TaskOutcome | None] = [None] * len(arg_list)
            pending = deque(range(len(arg_list)))
            idle = list(self._workers)
            busy: dict[Connection, tuple[_Worker, int, float]] = {}
            while pending or busy:
                while pending and idle:
                    worker, idx = idle.pop(), pending.popleft()
                    try:
                        worker.send((idx, ref, arg_list[idx], kwargs))
                    except OSError as exc:
                        outcomes[idx] = TaskOutcome("crashed", error=f"worker pipe closed: {exc}")
                        self._replace(worker)
                        continue
                    busy[worker.conn] = (worker, idx, time.monotonic() + timeout)
                if not busy:
                    if pending and not idle:
                        self._ensure_workers()
                        idle = [w for w in self._workers if w.conn not in busy]
                    continue
                next_deadline = min(d for _, _, d in busy.values())
                for conn in wait(list(busy), timeout=max(0.0, next_deadline - time.monotonic())):
                    worker, idx, _ = busy.pop(conn)  # type: ignore[index]
                    try:
                        _, status, value, error = conn.recv()  # type: ignore[union-attr]
                        outcomes[idx] = TaskOutcome(status, value, error)
                        idle.append(worker)
                    except (EOFError, OSError):
                        code = worker.process.exitcode
                        outcomes[idx] = TaskOutcome("crashed", error=f"worker died (exit code {code})")
                        self._replace(worker)
                now = time.monotonic()
                for conn, (worker, idx, deadline) in list(busy.items()):
                    if now >= deadline:
                        busy.pop(conn)
                        outcomes[idx] = TaskOutcome("timeout", error=f"no result within {timeout} s")
                        self._replace(worker)
                if len(self._workers) < self.num_workers and pending:
                    fresh = _Worker(self._preload, self._start_timeout)
                    self._workers.append(fresh)
                    idle.append(fresh)
            return outcomes  # type: ignore[return-value]

    def call(self, ref: FuncRef, args: tuple, timeout: float, kwargs: dict | None = None) -> TaskOutcome:
        return self.map(ref, [args], timeout, kwargs)[0]

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                for worker in self._workers:
                    worker.kill()
            self._workers = []


_POOLS: "weakref.WeakSet[KillablePool]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()


if __name__ == "__main__":
    _worker_main(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False),
                 tuple(sys.argv[3:]))
