"""A sandbox for model-written programs: each run is a resource-limited process tree that sees a
minimal, read-only system and a small private scratch area, and leaves nothing behind on the host.

Two backends build the same sandbox (`SandboxLimits.backend`, or env `TILLER_SANDBOX=bwrap|builtin`;
by default bwrap where it is on PATH and works, else builtin; `sandbox_backend()` says which one a run
gets, `RunResult.backend` records it, and asking for bwrap where it cannot run is a `ConfigError`):
- `bwrap`: bubblewrap 0.8 or newer (Debian / Ubuntu package `bubblewrap`; what Flatpak uses); an older
  one lacks options we use, fails the probe, and `auto` then picks builtin;
- `builtin`: unshare / mount / pivot_root from a small init process (the `_init_*` functions below, run
  as an interpreter of their own: `python -I -S -c <their source>`).

What the program gets (both backends):
- a new root (pivot_root; the host's root is detached): /usr, /etc, /bin, /sbin, /lib* and the
  interpreter's prefixes bind-mounted read-only, nosuid, nodev, and nothing else of the host: no /home,
  /root, /var, /mnt, the repo, the host's /tmp, /run, /dev/shm or /dev/mqueue, so no host Unix socket;
- /tmp (its working directory and HOME, holding main.py) and /dev/shm: private tmpfs of `work_mb` MiB
  each, the only writable places; an empty read-only /run; a minimal read-only /dev (null, zero, full,
  random, urandom, tty);
- a fresh /proc of its own PID namespace: it sees only its own processes. Its pid 1 is the sandbox's
  init, which exits when the program does, and the kernel then kills whatever is left;
- a network namespace holding only its own loopback (TCP, UDP and abstract Unix sockets reach nothing
  outside the run), and IPC (System V objects die with it) and UTS namespaces of its own;
- no capabilities, no_new_privs, no way to create a user namespace (so no mount of its own), and a
  seccomp filter: ptrace, process_vm_readv/writev, the keyring calls, bpf, perf_event_open and
  userfaultfd fail with EPERM;
- rlimits: CPU time, address space, processes, file size, open files, no core dumps;
- a minimal environment (PATH, LANG, HOME=TMPDIR=/tmp): nothing of ours leaks (no tokens).
The run is its own session and process group, killed as a group on timeout, on output past
`max_output_bytes`, or when its parent dies; a wall-clock deadline sits on top of RLIMIT_CPU.

Guarantees by setting:
- As root (containers, CI), each run also gets a uid of its own (one per concurrent run, no passwd
  entry); root ignores RLIMIT_NPROC, this uid does not. bwrap runs as that uid; builtin mounts as root
  and then drops to it. After the run every process of that uid is killed.
- Not root, both backends give the same sandbox through unprivileged user namespaces: the program runs
  as our uid inside a user namespace of its own, and the process limit counts the run's processes only.
- Best effort: where namespaces are refused (not root and unprivileged user namespaces disabled, or a
  container whose seccomp forbids unshare), builtin falls back to a plain run: rlimits, its own session,
  the uid switch when root, a private work dir (0o700 under a 0o711 parent) on the host's disk; the rest
  of the filesystem is guarded by permissions only, the network stays reachable and /proc shows other
  processes (`filesystem_isolated` and `network_isolated` are False in the result, and a note says why).
- With bwrap, bwrap's own pid 1 runs as the program's uid, without capabilities: the program can reach
  it through /proc/1 (its memory, its OOM score), which lets it end or stall its own run and nothing
  more (the wall deadline holds). bwrap cannot cap a tmpfs's inode count (builtin does: 256 per MiB), so
  many empty files cost kernel memory until the run ends. Its rlimits are set by the program's
  interpreter before the program runs (bwrap makes its namespaces after it starts; see `_bwrap_argv`).
- Exit status: with either backend the sandbox's init reports a program killed by signal N as exit code
  128 + N, read back as returncode -N (as a shell does); a program that itself exits above 128 therefore
  reads as killed by a signal. Neither is ok.

`SandboxPool.map` runs many programs concurrently (threads waiting on subprocesses).
"""
from __future__ import annotations

import ctypes
import functools
import inspect
import itertools
import json
import os
import platform
import resource
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tiller.errors import ConfigError

BACKENDS = ("bwrap", "builtin")
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 4096, 8192, 16384, 1 << 18
MOUNT_OPTION_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024,
                      "nodiratime": 2048, "relatime": 1 << 21, "strictatime": 1 << 24}
SIGKILL, SIGINT = int(signal.SIGKILL), int(signal.SIGINT)
MNT_DETACH, PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 2, 1, 4, 38, 22
SETUP_FAILED, SETUP_EXIT = "tiller-sandbox: setup failed", 125
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
_PIVOT_ROOT_SYSCALL = {"x86_64": 155, "aarch64": 41, "riscv64": 41}
# Syscalls the program gets EPERM for (seccomp): ptrace and process_vm_readv/writev (reading or steering
# another process: bwrap's pid 1 runs as the program's uid), add_key/request_key/keyctl (kernel keyrings
# are not namespaced), bpf, perf_event_open, userfaultfd. Per machine: (AUDIT_ARCH, numbers).
_SECCOMP_DENY = {
    "x86_64": (0xC000003E, (101, 310, 311, 248, 249, 250, 321, 298, 323)),
    "aarch64": (0xC00000B7, (117, 270, 271, 217, 218, 219, 280, 241, 282)),
}
_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
_UID_BASE = 1_600_000_000
_uid_counter = itertools.count()
_uid_lock = threading.Lock()
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one run, and which backend builds its sandbox."""

    cpu_time_s: int = 5
    """RLIMIT_CPU (seconds of CPU); SIGXCPU / SIGKILL past it."""
    wall_time_s: float = 10.0
    """Wall-clock deadline; the whole group is killed past it."""
    memory_mb: int = 1024
    """RLIMIT_AS (virtual address space) in MiB."""
    max_processes: int = 16
    """RLIMIT_NPROC (processes and threads of the run; the sandbox's own init is not counted)."""
    max_file_mb: int = 16
    """RLIMIT_FSIZE: largest file the program may write, MiB."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    max_output_bytes: int = 1 << 20
    """Cap on captured stdout + stderr; past it the run is killed (status output_limit)."""
    network: bool = False
    """Allow network access (default: a new, empty network namespace)."""
    work_mb: int = 64
    """Size of the private tmpfs at /tmp (work dir, HOME) and of the one at /dev/shm, MiB each."""
    backend: str = "auto"
    """`bwrap`, `builtin`, or `auto`: env TILLER_SANDBOX if set, else bwrap where it works, else builtin."""

    def __post_init__(self) -> None:
        if self.work_mb < 1:  # a tmpfs of size 0 would have no cap at all
            raise ConfigError(f"SandboxLimits.work_mb must be at least 1 (MiB), got {self.work_mb}")
        _check_backend_name(self.backend, "SandboxLimits.backend")


def _check_backend_name(name: str, source: str) -> None:
    if name not in ("auto", *BACKENDS):
        raise ConfigError(f"{source}={name!r} is not a sandbox backend; valid: auto, {', '.join(BACKENDS)}")


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
    backend: str = ""
    """`bwrap` or `builtin`: what built the sandbox."""
    filesystem_isolated: bool = False
    """The program saw the minimal root, private /tmp and /proc (False only in the plain fallback)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ---- the sandbox's init: its own interpreter (`python -I -S -c`); syscalls, and imports that start fast --
# The parent appends `_init_main(<config>)`, the config (`_init_config`) as a Python literal. Modes:
# "namespaces" (the builtin sandbox) and "plain" (its fallback without namespaces); bwrap needs no init.


def _init_main(config: dict) -> None:
    try:
        if config["mode"] == "plain":
            os.chdir(config["cwd"])
            _init_exec_program(config)
        _init_unshare(config)
        _libc.prctl(PR_SET_PDEATHSIG, SIGKILL)
        pid1 = os.fork()
        if pid1:
            _init_exit_like(os.waitpid(pid1, 0)[1])
        _init_pid1(config)
    except Exception as exc:  # one line for the parent, which reports start_failed
        os.write(2, f"{SETUP_FAILED}: {type(exc).__name__}: {exc}\n".encode())
        os._exit(SETUP_EXIT)


def _init_exit_like(status: int) -> None:
    """Exit with a child's wait status; a death by signal N becomes exit code 128 + N."""
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


def _init_check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _init_mount(source, target, fstype, flags: int, data=None) -> None:
    def enc(text):
        return None if text is None else os.fsencode(text)

    _init_check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _init_write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _init_map_ids(inner_uid: int, inner_gid: int, outer_uid: int, outer_gid: int) -> None:
    """Map ids of the user namespace just created onto our ids outside it (read before unshare)."""
    _init_write("/proc/self/uid_map", f"{inner_uid} {outer_uid} 1\n")
    _init_write("/proc/self/setgroups", "deny")
    _init_write("/proc/self/gid_map", f"{inner_gid} {outer_gid} 1\n")


def _init_unshare(config: dict) -> None:
    """New mount, PID, IPC, UTS (and network) namespaces; not root: inside a new user namespace."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if not config["network"]:
        flags |= CLONE_NEWNET
    uid, gid = os.geteuid(), os.getegid()
    _init_check(_libc.unshare(flags | (CLONE_NEWUSER if uid != 0 else 0)), "unshare")
    if uid != 0:
        _init_map_ids(0, 0, uid, gid)
    _init_check(_libc.sethostname(b"sandbox", 7), "sethostname")
    if not config["network"]:
        _init_loopback_up()


def _init_loopback_up() -> None:
    """ifconfig lo up in the new network namespace (as bwrap does): programs may talk to themselves."""
    sock = _libc.socket(2, 2, 0)  # AF_INET, SOCK_DGRAM
    _init_check(0 if sock >= 0 else -1, "socket")
    flags = (0x1 | 0x8 | 0x40).to_bytes(2, sys.byteorder)  # IFF_UP | IFF_LOOPBACK | IFF_RUNNING
    ifreq = ctypes.create_string_buffer(b"lo".ljust(16, b"\0") + flags, 40)  # struct ifreq
    result = _libc.ioctl(sock, 0x8914, ifreq)  # SIOCSIFFLAGS
    os.close(sock)
    _init_check(result, "loopback up")


def _init_pid1(config: dict) -> None:
    """pid 1 of the new PID namespace: build the root, start the program, exit with its status."""
    _libc.prctl(PR_SET_PDEATHSIG, SIGKILL)  # the relay outside dies -> so do we, and the namespace
    _libc.prctl(PR_SET_DUMPABLE, 0)  # the program cannot ptrace or read us
    _libc.signal(SIGINT, None)  # SIG_DFL: pid 1 ignores default-action signals sent from inside
    _init_build_root(config)
    program = os.fork()
    if program == 0:
        os.chdir(config["cwd"])
        os.setsid()
        _init_exec_program(config)
    while True:  # reap orphans until the program exits; our exit kills the rest
        pid, status = os.waitpid(-1, 0)
        if pid == program:
            _init_exit_like(status)


def _init_build_root(config: dict) -> None:
    """A tmpfs root holding read-only binds of the system dirs, /proc, /dev, /tmp; pivot into it."""
    root = "/tmp"  # any host dir will do: it is covered in this mount namespace only, then detached
    _init_mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    _init_mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for kind, source, target in config["layout"]:
        path = root + target
        if kind == "symlink":
            os.symlink(source, path)
            continue
        os.makedirs(path, exist_ok=True)
        _init_mount(source, path, None, MS_BIND | MS_REC)
        _init_readonly(path)
    os.mkdir(root + "/proc")
    _init_mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _init_dev(root + "/dev", config)
    os.mkdir(root + "/tmp")
    _init_mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, config["tmpfs"])
    _init_write_program(root + "/tmp/main.py", config)
    os.mkdir(root + "/run")
    os.chdir(root)
    if config["pivot_root"] and _libc.syscall(config["pivot_root"], b".", b".") == 0:
        _init_check(_libc.umount2(b".", MNT_DETACH), "umount old root")  # the host root is gone
    else:  # no pivot_root number for this machine: move the new root over the old one
        _init_mount(root, "/", None, MS_MOVE)
        _init_check(_libc.chroot(b"."), "chroot")
    os.chdir("/")
    _init_mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _init_readonly(path: str) -> None:
    """Remount every mount at or below `path` read-only, nosuid, nodev, keeping its other flags (they
    are locked in a user namespace)."""
    with open("/proc/self/mountinfo") as fh:
        mounts = [line.split() for line in fh]
    for fields in mounts:
        point = fields[4]
        for escaped, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
            point = point.replace(escaped, char)
        if point == path or point.startswith(path + "/"):
            flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
            for option in fields[5].split(","):
                flags |= MOUNT_OPTION_FLAGS.get(option, 0)
            _init_mount(None, point, None, flags)


def _init_dev(dev: str, config: dict) -> None:
    """A read-only tmpfs /dev with the harmless host nodes bound in and a private /dev/shm."""
    os.mkdir(dev)
    _init_mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name in DEV_NODES:
        if os.path.exists("/dev/" + name):
            open(f"{dev}/{name}", "w").close()
            _init_mount("/dev/" + name, f"{dev}/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(dev + "/shm")
    _init_mount("tmpfs", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV, config["tmpfs"])
    _init_mount(None, dev, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)


def _init_write_program(path: str, config: dict) -> None:
    chunks = []
    while chunk := os.read(config["code_fd"], 1 << 16):
        chunks.append(chunk)
    os.close(config["code_fd"])
    with open(path, "wb") as fh:
        fh.write(b"".join(chunks))
    os.chmod(path, 0o444)
    if config["uid"] is not None:
        os.chown(path, config["uid"], config["uid"])


def _init_become(config: dict) -> None:
    """As root: drop to the run's own uid (no groups, no capabilities once it execs)."""
    if config["uid"] is not None:
        os.setgroups([])
        os.setgid(config["uid"])
        os.setuid(config["uid"])


def _init_limits(config: dict) -> None:
    for name, soft, hard in config["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _init_exec_program(config: dict) -> None:
    _init_limits(config)
    _init_become(config)
    if config["mode"] == "namespaces":
        _init_lock_user_namespaces(config)
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no set-uid binary or file capability ever applies
    _libc.prctl(PR_SET_PDEATHSIG, SIGKILL)
    if config["seccomp"]:
        _init_seccomp(bytes.fromhex(config["seccomp"]))
    os.execve(config["python"], config["program_argv"], config["env"])


def _init_seccomp(program: bytes) -> None:
    """Install a classic-BPF seccomp filter (`_seccomp_filter`): struct sock_fprog {len, filter *}."""

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    fprog = SockFprog(len(program) // 8, program)
    _init_check(_libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(fprog), 0, 0), "seccomp")


def _init_lock_user_namespaces(config: dict) -> None:
    """Enter a user namespace of our own in which no further one can be made (so no mounts, ever).

    Not root, this is also what takes away the capabilities of the outer user namespace: the program
    execs as a non-zero uid in it. As root the program is an unprivileged uid already, so where the
    kernel refuses, we go on without."""
    uid, gid = os.geteuid(), os.getegid()
    if _libc.unshare(CLONE_NEWUSER) != 0:
        if config["uid"] is None:
            _init_check(-1, "unshare(CLONE_NEWUSER) for the program")
        return
    _libc.prctl(PR_SET_DUMPABLE, 1)  # a setuid made us undumpable: /proc/self would be root's
    if config["uid"] is not None:
        _init_map_ids(uid, gid, uid, gid)
    else:  # the program sees its uid on the host
        _init_map_ids(config["host_uid"], config["host_gid"], uid, gid)
    _init_write("/proc/sys/user/max_user_namespaces", "0")


_INIT_FUNCTIONS = (_init_main, _init_exit_like, _init_check, _init_mount, _init_write, _init_map_ids,
                   _init_unshare, _init_loopback_up, _init_pid1, _init_build_root, _init_readonly, _init_dev,
                   _init_write_program, _init_become, _init_limits, _init_exec_program, _init_seccomp,
                   _init_lock_user_namespaces)
_INIT_CONSTANTS = {name: value for name, value in globals().items() if name.isupper() and not name.startswith("_")}


@functools.lru_cache(maxsize=1)
def _init_source() -> str:
    """The init's program text, bar the call: the constants and `_init_*` functions above."""
    constants = "".join(f"{name} = {value!r}\n" for name, value in _INIT_CONSTANTS.items())
    functions = "\n\n".join(inspect.getsource(fn) for fn in _INIT_FUNCTIONS)
    return ("import ctypes, os, resource, sys\n_libc = ctypes.CDLL(None, use_errno=True)\n"
            f"{constants}\n{functions}\n")


# ---- the parent side ---------------------------------------------------------------------------------


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


@functools.lru_cache(maxsize=None)
def _python_dirs(python: str) -> tuple[str, ...]:
    """The directories `python` needs: its prefixes and where its executable lives."""
    if python == sys.executable:
        prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    else:
        query = ("import json, sys; "
                 "print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))")
        try:
            prefixes = json.loads(subprocess.run([python, "-I", "-S", "-c", query], capture_output=True,
                                                 text=True, timeout=30, check=True).stdout)
        except (OSError, subprocess.SubprocessError, ValueError):
            prefixes = []
    return tuple(dict.fromkeys([*prefixes, os.path.dirname(python), os.path.dirname(os.path.realpath(python))]))


@functools.lru_cache(maxsize=None)
def _root_layout(python: str) -> tuple[tuple[str, str, str], ...]:
    """(kind, source, target) entries of the sandbox's root: `bind` (read-only) or `symlink`."""
    layout, bound = [], []

    def covered(path: str) -> bool:
        real = os.path.realpath(path)
        return any(real == b or real.startswith(b + "/") for b in bound)

    for name in _SYSTEM_DIRS:
        path = "/" + name
        if os.path.islink(path):
            layout.append(("symlink", os.readlink(path), path))
        elif os.path.isdir(path):
            layout.append(("bind", path, path))
            bound.append(path)
    for directory in _python_dirs(python):
        if not os.path.isdir(directory) or os.path.realpath(directory) == "/":
            continue
        for target in dict.fromkeys((os.path.realpath(directory), os.path.abspath(directory))):
            if not covered(target):
                layout.append(("bind", os.path.realpath(directory), target))
                bound.append(target)
    return tuple(layout)


_ROOT_DIR: str | None = None
# The program is opened relative to the cwd (its work dir), so the same bootstrap serves every mode.
_BOOTSTRAP = ("import sys; sys.argv[0] = 'main.py'; exec(compile(open('main.py', encoding='utf-8').read(), "
              "'main.py', 'exec'), {'__name__': '__main__', '__file__': 'main.py', '__builtins__': __builtins__})")
_INIT_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def _sandbox_root() -> str:
    """Plain fallback only: a private parent for work dirs (0o711: others may traverse, not list or
    write), so a program cannot write next to its own directory (`../x`)."""
    global _ROOT_DIR
    if _ROOT_DIR is None or not os.path.isdir(_ROOT_DIR):
        _ROOT_DIR = tempfile.mkdtemp(prefix="tiller-sandboxes-")
        os.chmod(_ROOT_DIR, 0o711)
    return _ROOT_DIR


def _allocate_uid() -> int:
    with _uid_lock:
        slot = next(_uid_counter) % 10_000
    return _UID_BASE + (os.getpid() % 40_000) * 10_000 + slot


@functools.lru_cache(maxsize=None)
def _seccomp_filter(machine: str) -> bytes:
    """The seccomp program (classic BPF, struct sock_filter[]) denying `_SECCOMP_DENY` with EPERM, and
    every syscall of another ABI (i386 / x32 on x86_64). Empty for machines not in the table."""
    if machine not in _SECCOMP_DENY:
        return b""
    arch, numbers = _SECCOMP_DENY[machine]
    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW; SECCOMP_RET_ERRNO | EPERM
    body = [(jge, 0x40000000)] if machine == "x86_64" else []  # x32 syscall numbers
    body += [(jeq, number) for number in numbers]
    program = [(ld_abs, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny), (ld_abs, 0, 0, 0)]
    for i, (code, k) in enumerate(body):
        program.append((code, len(body) - i, 0, k))  # true: jump over the rest and `allow`, to `deny`
    program += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
    return b"".join(struct.pack("=HBBI", *insn) for insn in program)


def _rlimits(limits: SandboxLimits, extra_processes: int) -> list[tuple[str, int, int]]:
    cpu, mem, size = max(1, int(limits.cpu_time_s)), limits.memory_mb << 20, limits.max_file_mb << 20
    nproc = limits.max_processes + extra_processes
    return [("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", mem, mem), ("RLIMIT_FSIZE", size, size),
            ("RLIMIT_NOFILE", limits.max_open_files, limits.max_open_files), ("RLIMIT_CORE", 0, 0),
            ("RLIMIT_NPROC", nproc, nproc)]


def _program_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home,
            "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _bwrap_argv(limits: SandboxLimits, fds: dict[str, int], args: list[str]) -> list[str]:
    """bwrap's command line. bwrap is the process we start (as the run's uid when we are root): its
    --die-with-parent ties the run to our thread. The rlimits are set by the program's interpreter before
    the program: RLIMIT_NPROC counts a uid's processes in each user namespace up the chain against the
    limit in force when that namespace was made, and bwrap makes its namespaces after it starts, so set
    earlier it would count every process of our uid on the host (not root). Slack of 2: bwrap's own
    processes share the program's uid."""
    python = sandbox_python()
    argv = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--unshare-user", "--disable-userns",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox"]
    if limits.network:
        argv.append("--share-net")
    if "seccomp" in fds:
        argv += ["--seccomp", str(fds["seccomp"])]
    for kind, source, target in _root_layout(python):
        argv += ["--ro-bind", source, target] if kind == "bind" else ["--symlink", source, target]
    size = str(limits.work_mb << 20)
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "0700", "--size", size, "--tmpfs", "/tmp",
             "--perms", "0700", "--size", size, "--tmpfs", "/dev/shm", "--dir", "/run",
             "--perms", "0444", "--file", str(fds["code"]), "/tmp/main.py",
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--clearenv"]
    for name, value in _program_env("/tmp").items():
        argv += ["--setenv", name, value]
    rlimits = "; ".join(f"r.setrlimit(r.{name}, ({soft}, {hard}))" for name, soft, hard in _rlimits(limits, 2))
    return [*argv, "--", python, "-I", "-c", f"import resource as r; {rlimits}; {_BOOTSTRAP}", *args]


def _init_config(mode: str, limits: SandboxLimits, uid: int | None, fds: dict[str, int], workdir: str,
                 args: list[str]) -> dict:
    """What the init needs for one run (mode namespaces or plain). `fds`: memfds it inherits."""
    python = sandbox_python()
    home = workdir if mode == "plain" else "/tmp"
    # not root, our relay and pid 1 share the program's uid in the namespaces it is counted in
    extra = 2 if mode == "namespaces" and uid is None else 0
    config = {"mode": mode, "uid": uid, "rlimits": _rlimits(limits, extra), "python": python,
              "program_argv": [python, "-I", "-c", _BOOTSTRAP, *args], "env": _program_env(home),
              "network": limits.network, "cwd": home, "seccomp": ""}
    if mode == "namespaces":
        owner = f",uid={uid},gid={uid}" if uid is not None else ""
        config.update(layout=_root_layout(python), code_fd=fds["code"], host_uid=os.getuid(), host_gid=os.getgid(),
                      pivot_root=_PIVOT_ROOT_SYSCALL.get(platform.machine()),
                      seccomp=_seccomp_filter(platform.machine()).hex(),
                      tmpfs=f"size={limits.work_mb}m,nr_inodes={256 * limits.work_mb},mode=0700{owner}")
    return config


def _kill_uid(uid: int) -> None:
    """SIGKILL every process whose real uid is `uid` (children that left the process group), and wait (up to
    5 s) until none is left alive: a killed process lingers until the kernel runs it, longer on a loaded host."""
    deadline = time.monotonic() + 5.0
    while True:
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
        if not found or time.monotonic() > deadline:
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


def _launch(argv: list[str], uid: int | None, stdin: bytes, limits: SandboxLimits,
            pass_fds: tuple[int, ...], **popen_kwargs) -> tuple:
    """Start `argv` in a session of its own, collect its output, kill what is left of it.
    Returns (status, returncode, stdout, stderr)."""
    try:
        proc = subprocess.Popen(argv, cwd="/", env=_INIT_ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, close_fds=True, pass_fds=pass_fds,
                                **popen_kwargs)
    except (OSError, subprocess.SubprocessError) as exc:
        return "start_failed", None, b"", str(exc).encode()
    try:
        out, err, status = _collect(proc, stdin, limits)
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
    return status, returncode, out, err


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run(code: str, stdin: str, limits: SandboxLimits, args, mode: str) -> RunResult:
    """One run in `mode` (bwrap | namespaces | plain)."""
    uid = _allocate_uid() if _is_root() else None
    start = time.monotonic()
    workdir, fds = "", {}
    try:
        if mode == "plain":
            workdir = tempfile.mkdtemp(prefix="run-", dir=_sandbox_root())
            program = os.path.join(workdir, "main.py")
            with open(program, "wb") as fh:
                fh.write(code.encode("utf-8", "surrogatepass"))
            os.chmod(program, 0o444)
            if uid is not None:
                os.chown(workdir, uid, uid)
            os.chmod(workdir, 0o700)
        else:  # the program reaches the sandbox through an anonymous file: nothing on the host's disk
            fds["code"] = _memfd("main.py", code.encode("utf-8", "surrogatepass"))
            if mode == "bwrap" and _seccomp_filter(platform.machine()):
                fds["seccomp"] = _memfd("seccomp", _seccomp_filter(platform.machine()))
        data, popen_kwargs = stdin.encode("utf-8", "replace"), {}
        if mode == "bwrap":
            argv = _bwrap_argv(limits, fds, list(args))
            if uid is not None:  # bwrap runs as the run's uid: its namespaces are then that uid's
                popen_kwargs = {"user": uid, "group": uid, "extra_groups": []}
        else:
            config = _init_config(mode, limits, uid, fds, workdir, list(args))
            argv = [sys.executable, "-I", "-S", "-c", f"{_init_source()}_init_main({config!r})\n"]
        status, returncode, out, err = _launch(argv, uid, data, limits, tuple(fds.values()), **popen_kwargs)
    finally:
        for fd in fds.values():
            os.close(fd)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if mode != "plain" and returncode is not None and returncode > 128:
        returncode = 128 - returncode  # the init's convention: 128 + N is death by signal N
    if not status:
        if returncode == SETUP_EXIT and err.startswith(SETUP_FAILED.encode()):
            status = "start_failed"
        else:
            status = "ok" if returncode == 0 else "cpu_limit" if returncode == -signal.SIGXCPU else "error"
    isolated = mode != "plain"
    notes = [] if isolated else [f"no namespaces here ({_namespaces_problem()}): rlimits and permissions only"]
    return RunResult(status, returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                     time.monotonic() - start, isolated and not limits.network, notes,
                     "bwrap" if mode == "bwrap" else "builtin", isolated)


def _probe(mode: str) -> str | None:
    """None when a trivial program runs in `mode` here, else the reason (one line)."""
    try:
        result = _run("print('ok')", "", SandboxLimits(wall_time_s=20.0), (), mode)
    except Exception as exc:  # e.g. no memfd_create / libc call on this system: the mode is unusable
        return f"{type(exc).__name__}: {exc}"
    if result.ok and result.stdout == "ok\n":
        return None
    lines = (result.stderr or f"status {result.status}").strip().splitlines()
    return lines[-1] if lines else f"status {result.status}, exit code {result.returncode}"


@functools.lru_cache(maxsize=None)
def _bwrap_problem(bwrap: str | None, uid: int) -> str | None:
    """Why bwrap cannot be used (None: it can). Probed once per bwrap path and user."""
    if bwrap is None:
        return "bwrap is not on PATH"
    problem = _probe("bwrap")
    return None if problem is None else f"{bwrap} fails here: {problem}"


@functools.lru_cache(maxsize=None)
def _namespaces_problem_for(uid: int) -> str | None:
    return _probe("namespaces")


def _namespaces_problem() -> str | None:
    """Why the builtin backend cannot build its namespaces here (None: it can)."""
    return _namespaces_problem_for(os.geteuid())


def sandbox_backend(limits: SandboxLimits | None = None) -> str:
    """The backend a run with `limits` gets: `bwrap` or `builtin` (see the module docstring).

    Raises ConfigError for an unknown name, or when bwrap is asked for and cannot run here."""
    requested, source = (limits or SandboxLimits()).backend, "SandboxLimits.backend"
    if requested == "auto" and os.environ.get("TILLER_SANDBOX", "").strip():
        requested, source = os.environ["TILLER_SANDBOX"].strip(), "TILLER_SANDBOX"
    _check_backend_name(requested, source)
    if requested == "builtin":
        return "builtin"
    problem = _bwrap_problem(shutil.which("bwrap"), os.geteuid())
    if requested == "bwrap" and problem is not None:
        raise ConfigError(f"{source}=bwrap, but {problem}; install bubblewrap (Debian / Ubuntu: "
                          "apt-get install bubblewrap) or set TILLER_SANDBOX=builtin")
    return "bwrap" if problem is None else "builtin"


def network_isolation_available() -> bool:
    """Whether runs here get their own network namespace (both backends, unless in the plain fallback)."""
    return sandbox_backend() == "bwrap" or _namespaces_problem() is None


def run_program(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(), args: list[str] = ()) -> RunResult:
    """Run Python `code` in the sandbox with `stdin`; never raises for anything the program does.

    Raises ConfigError when the backend asked for cannot run here (see `sandbox_backend`)."""
    if sandbox_backend(limits) == "bwrap":
        mode = "bwrap"
    else:
        mode = "namespaces" if _namespaces_problem() is None else "plain"
    return _run(code, stdin, limits, args, mode)


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
