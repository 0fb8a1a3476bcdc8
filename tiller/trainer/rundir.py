"""One process a run dir: `RUN_DIR/tiller.lock` holds the holder's pid, host, start time and command line.

`acquire_run_dir(run_dir)` takes the lock or raises a `ConfigError` naming the process that holds it, so a second
`tiller rl` on the same `trainer.default_local_dir` refuses at once instead of interleaving its steps, metrics and
checkpoints with the first. The lock is an exclusive `fcntl.flock` on the file, which the kernel drops when the
holding process ends however it ends (kill -9 included): a lock file left by a dead process is stale, detected by
the next run (which says so in one line) and taken over. `release_run_dir` (and interpreter exit) removes the file.

Within one process the lock is shared (a count): a test or a notebook that builds a second trainer on the same dir
is one process, not two. POSIX only (`fcntl`); elsewhere the lock is a no-op.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from pathlib import Path

from tiller.errors import ConfigError

LOCK_NAME = "tiller.lock"
_HELD: dict[Path, list] = {}  # lock path -> [fd, count] of the locks this process holds


def _describe(info: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info["since"])) if "since" in info else "?"
    return (f"pid {info.get('pid', '?')} on {info.get('host', '?')}, since {since}: "
            f"{str(info.get('command', '?'))[:120]}")


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, 65536)
    try:
        info = json.loads(data.decode("utf-8")) if data.strip() else {}
    except ValueError:
        info = {}
    return info if isinstance(info, dict) else {}


def acquire_run_dir(run_dir: str | os.PathLike, key: str = "trainer.default_local_dir") -> Path:
    """Hold `run_dir` for this process (created if missing); returns the lock file's path. Raises a ConfigError
    naming the holder when another live process holds it; takes over (with one line) a stale lock of a dead one."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return Path(run_dir) / LOCK_NAME
    run_dir = Path(run_dir).expanduser()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = (run_dir / LOCK_NAME).resolve()
    if path in _HELD:
        _HELD[path][1] += 1
        return path
    for _ in range(5):  # the file may be removed and made again by a holder between our open and our flock
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise ConfigError(f"{key}={run_dir} is in use by another tiller process ({_describe(holder)}); wait for "
                              f"it to end, or choose another {key}") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # we locked a file its holder removed on release: lock the new one
    else:
        raise ConfigError(f"{key}={run_dir}: could not take its lock file {path} (it keeps changing)")
    stale = _read(fd)
    if stale.get("pid") not in (None, os.getpid()):
        print(f"{run_dir}: took over a stale lock ({_describe(stale)}; that process has ended)", file=sys.stderr)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(info).encode("utf-8"))
    _HELD[path] = [fd, 1]
    return path


def release_run_dir(run_dir: str | os.PathLike) -> None:
    """Drop this process's hold on `run_dir`; the last release removes the lock file (a no-op if not held)."""
    path = (Path(run_dir).expanduser() / LOCK_NAME).resolve()
    held = _HELD.get(path)
    if held is None:
        return
    held[1] -= 1
    if held[1] > 0:
        return
    del _HELD[path]
    try:
        path.unlink(missing_ok=True)  # while still locked: no other process can have taken it
    finally:
        os.close(held[0])


@atexit.register
def _release_all() -> None:
    for path in list(_HELD):
        _HELD[path][1] = 1
        release_run_dir(path.parent)
