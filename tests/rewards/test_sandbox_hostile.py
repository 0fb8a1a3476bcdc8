"""The sandbox's hostility suite, against both backends: each attack is contained, scores 0, and
leaves nothing on the host.

Every attack is a program that prints `LEAK <what>` the moment something succeeds that must not (it
catches its own failures, so a contained attack usually exits 0). Each runs through the code scorer
with a wrong answer (it must score 0); a spy on `run_program` keeps its RunResult, which must show no
LEAK line and the attack's own expected status. Then the host is checked (autouse fixture): no new
entry named with this module's token, or owned by a sandbox uid, in any world-writable directory or
in $HOME, /etc, site-packages, the repo; no surviving process of this process's sandbox uids (as root);
mountinfo and System V IPC objects unchanged; no connection or datagram reached the bait listeners.

The bait, set up once: Unix sockets of mode 0666 in the host's world-writable dirs and an abstract
one, TCP and UDP listeners on all interfaces, a process whose command line holds a marker, a secret
file outside the system dirs, a secret in our environment. The red-team cases are among the attacks:
a 180 MiB write to /run/lock, a 0666 Unix socket in a world-writable dir, filling the work area,
reading other processes' command lines; scored through `default_compute_score` with a code data
source, the path `tiller serve-rm` takes for a rules scorer.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import socket
import subprocess
import sys
import sysconfig
import textwrap
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tiller.errors import ConfigError
from tiller.rewards import default_compute_score, sandbox
from tiller.rewards.sandbox import _UID_BASE, RunResult, SandboxLimits

TOKEN = f"tiller-hostile-{os.getpid()}-{secrets.token_hex(4)}"
SECRET = f"hunter2-{secrets.token_hex(8)}"
REPO = Path(__file__).resolve().parents[2]
LIMITS = dict(cpu_time_s=1, wall_time_s=3.0, memory_mb=256, max_processes=8, max_file_mb=4, work_mb=8,
              max_output_bytes=64 * 1024)
EXPECTED = "the-one-right-answer"
OWN_UIDS = range(_UID_BASE + (os.getpid() % 40_000) * 10_000, _UID_BASE + (os.getpid() % 40_000 + 1) * 10_000)


def _backend_skip_reason(backend: str) -> str | None:
    """Why `backend` cannot be tested here (None: it can). Not root and no namespaces: best effort only."""
    try:
        sandbox.sandbox_backend(SandboxLimits(backend=backend))
    except ConfigError as exc:  # bwrap missing, or refused here
        return f"{backend} unavailable: {exc}"
    if backend == "builtin" and sandbox._namespaces_problem() is not None and os.geteuid() != 0:
        return f"builtin has no namespaces here (not root): {sandbox._namespaces_problem()}"
    return None


@pytest.fixture(params=sandbox.BACKENDS)
def backend(request) -> str:
    reason = _backend_skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


# ---- the host: bait and snapshots -----------------------------------------------------------------


def _world_writable_dirs(max_depth: int = 3) -> list[str]:
    """World-writable directories of the host, down to `max_depth` levels (no /proc, /sys)."""
    found: list[str] = []

    def walk(path: str, depth: int) -> None:
        try:
            entries = list(os.scandir(path))
        except OSError:
            return
        for entry in entries:
            try:
                if entry.path in ("/proc", "/sys") or not entry.is_dir(follow_symlinks=False):
                    continue
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError:
                continue
            if mode & 0o002:
                found.append(entry.path)
            if depth < max_depth:
                walk(entry.path, depth + 1)

    walk("/", 1)
    return found


def _host_ip() -> str | None:
    """This host's address on its default route (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


@dataclass
class Bait:
    info: dict
    events: list = field(default_factory=list)
    watched_dirs: list = field(default_factory=list)


@pytest.fixture(scope="module")
def bait(tmp_path_factory):
    ww_dirs = _world_writable_dirs()
    listeners, paths = [], []
    for directory in dict.fromkeys(os.path.realpath(d) for d in ("/tmp", "/var/tmp", "/run/lock", "/var/lock",
                                                                  "/dev/shm", "/dev/mqueue")):
        if not os.path.isdir(directory):
            continue
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            unix.bind(f"{directory}/{TOKEN}.sock")
        except OSError:
            unix.close()
            continue
        os.chmod(f"{directory}/{TOKEN}.sock", 0o666)
        unix.listen(4)
        listeners.append(unix)
        paths.append(f"{directory}/{TOKEN}.sock")
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind("\0" + TOKEN)
    abstract.listen(4)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("0.0.0.0", 0))
    tcp.listen(4)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", 0))
    secret_dir = tmp_path_factory.mktemp("secret")
    secret_dir.chmod(0o755)
    (secret_dir / "secret.txt").write_text(SECRET)
    (secret_dir / "secret.txt").chmod(0o644)
    marker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", f"{TOKEN}-marker"])
    info = {"token": TOKEN, "ww_dirs": ww_dirs, "unix_sockets": paths, "abstract": TOKEN,
            "tcp_port": tcp.getsockname()[1], "udp_port": udp.getsockname()[1],
            "host_ips": [ip for ip in ("127.0.0.1", _host_ip()) if ip], "marker": f"{TOKEN}-marker",
            "secret_file": str(secret_dir / "secret.txt"), "host_home": os.path.expanduser("~"),
            "host_site_packages": sysconfig.get_paths()["purelib"], "repo": str(REPO), "host_pid": os.getpid(),
            "bound": [target for _, _, target in sandbox._root_layout(sandbox.sandbox_python())]}
    result = Bait(info, watched_dirs=list(dict.fromkeys(
        [*ww_dirs, info["host_home"], "/etc", info["host_site_packages"], str(REPO), os.getcwd(), "/"])))
    stop_read, stop_write = socket.socketpair()
    selector = selectors.DefaultSelector()
    for sock in (*listeners, abstract, tcp, udp, stop_read):
        selector.register(sock, selectors.EVENT_READ)

    def watch() -> None:
        while True:
            for key, _ in selector.select():
                sock = key.fileobj
                if sock is stop_read:
                    return
                if sock is udp:
                    result.events.append(("udp", udp.recvfrom(65536)))
                else:
                    conn, _ = sock.accept()
                    result.events.append(("connect", sock.getsockname()))
                    conn.close()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    yield result
    stop_write.send(b"x")
    thread.join(timeout=5)
    marker.kill()
    marker.wait()
    for sock in (*listeners, abstract, tcp, udp, stop_read, stop_write):
        sock.close()
    for path in paths:
        os.unlink(path)


def _snapshot(watched_dirs: list[str]) -> dict:
    listing = {}
    for directory in watched_dirs:
        try:
            listing[directory] = set(os.listdir(directory))
        except OSError:
            listing[directory] = set()
    ipc = {}
    for kind in ("shm", "sem", "msg"):
        try:
            ipc[kind] = set(Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:])
        except OSError:
            ipc[kind] = set()
    return {"listing": listing, "mounts": set(Path("/proc/self/mountinfo").read_text().splitlines()),
            "ipc": ipc, "hostname": socket.gethostname()}


def _own_sandbox_processes() -> list[str]:
    """Live processes whose uid is one of this process's sandbox uids (as root, every run has one)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{entry}/status").read_text().splitlines()
                          if ":" in line)
            uid, state = int(status["Uid"].split()[0]), status["State"].split()[0]
        except (OSError, KeyError, ValueError):
            continue
        if uid in OWN_UIDS and state not in ("Z", "X"):
            found.append(f"{entry} {status.get('Name', '').strip()}")
    return found


def _leftovers(before: dict, after: dict) -> list[str]:
    """New entries named with our token or owned by one of our sandbox uids."""
    found = []
    for directory, names in after["listing"].items():
        for name in names - before["listing"].get(directory, set()):
            path = os.path.join(directory, name)
            try:
                owner = os.lstat(path).st_uid
            except OSError:
                continue
            if TOKEN in name or owner in OWN_UIDS:
                found.append(path)
    return found


@pytest.fixture(autouse=True)
def nothing_left_on_the_host(bait):
    events_before = len(bait.events)
    before = _snapshot(bait.watched_dirs)
    yield
    after = _snapshot(bait.watched_dirs)
    assert _leftovers(before, after) == []
    assert _own_sandbox_processes() == []
    assert after["mounts"] == before["mounts"]
    assert after["ipc"] == before["ipc"]  # System V objects of the run die with its IPC namespace
    assert after["hostname"] == before["hostname"]
    assert bait.events[events_before:] == []


# ---- the attacks ------------------------------------------------------------------------------------

PRELUDE = """
import ctypes, errno, json, os, signal, socket, stat, sys, time
BAIT = json.loads({bait!r})
TOKEN = BAIT["token"]
libc = ctypes.CDLL(None, use_errno=True)

def leak(what):
    print("LEAK", what, flush=True)

def must_fail(what, fn):
    try:
        fn()
    except Exception:
        return
    leak(what)

def write(path, data=b"x"):
    with open(path, "wb") as fh:
        fh.write(data)
"""


@dataclass(frozen=True)
class Attack:
    code: str
    statuses: tuple = ("ok",)
    """Statuses the run may end with; `ok` ones must print DONE as their last step."""
    limits: dict = field(default_factory=dict)
    must_print: str = ""
    """Text the program must print besides DONE (its measurement)."""


def A(code: str, **kwargs) -> Attack:  # noqa: N802 - reads as a table below
    return Attack(textwrap.dedent(code).strip("\n") + "\n", **kwargs)


ATTACKS = {
    # -- the host's world-writable places, and writes anywhere else --------------------------------
    "write_run_lock_180mb": A("""
        must_fail('created a file in /run/lock', lambda: write('/run/lock/' + TOKEN, b''))
        must_fail('wrote 180 MiB to /run/lock', lambda: write('/run/lock/' + TOKEN, b'x' * (180 << 20)))
        must_fail('made /run/lock', lambda: os.makedirs('/run/lock/' + TOKEN))
        print('DONE')"""),
    "write_var_lock_and_var_run": A("""
        for d in ('/var/lock', '/var/run', '/run/user', '/run/systemd'):
            must_fail('wrote ' + d, lambda: write(d + '/' + TOKEN))
        print('DONE')"""),
    "write_dev_mqueue_and_posix_mq": A("""
        must_fail('wrote /dev/mqueue', lambda: write('/dev/mqueue/' + TOKEN))
        rt = ctypes.CDLL('librt.so.1', use_errno=True)  # a queue of the run's own IPC namespace
        print('mq_open', rt.mq_open(('/' + TOKEN).encode(), os.O_CREAT | os.O_RDWR, 0o666, None))
        print('DONE')"""),
    "write_dev_shm_is_private": A("""
        write('/dev/shm/' + TOKEN)
        if os.listdir('/dev/shm') != [TOKEN]:
            leak('host /dev/shm visible')
        print('DONE')"""),
    "write_tmp_is_private": A("""
        write('/tmp/' + TOKEN)
        write('/tmp/.' + TOKEN)
        if set(os.listdir('/tmp')) - {'main.py', TOKEN, '.' + TOKEN}:
            leak('host /tmp visible')
        print('DONE')"""),
    "write_var_tmp": A("""
        must_fail('wrote /var/tmp', lambda: write('/var/tmp/' + TOKEN))
        print('DONE')"""),
    "write_host_home": A("""
        must_fail('wrote host home', lambda: write(BAIT['host_home'] + '/' + TOKEN))
        must_fail('wrote /root', lambda: write('/root/' + TOKEN))
        write(os.path.expanduser('~/') + TOKEN)  # its own HOME: the private /tmp
        print('DONE')"""),
    "write_every_world_writable_dir": A("""
        for d in BAIT['ww_dirs']:
            if d not in ('/tmp', '/dev/shm'):  # these two are the run's own tmpfs
                must_fail('wrote ' + d, lambda: write(d + '/' + TOKEN))
        print('DONE')"""),
    "write_etc": A("""
        must_fail('wrote /etc', lambda: write('/etc/' + TOKEN))
        must_fail('appended /etc/passwd', lambda: open('/etc/passwd', 'a').write('x'))
        must_fail('renamed /etc/hostname', lambda: os.rename('/etc/hostname', '/etc/' + TOKEN))
        print('DONE')"""),
    "write_site_packages_and_repo": A("""
        import sysconfig
        for d in {sysconfig.get_paths()['purelib'], BAIT['host_site_packages'], BAIT['repo'], sys.prefix,
                  '/usr/lib/python3/dist-packages', '/usr/local/lib'}:
            must_fail('wrote ' + d, lambda: write(d + '/' + TOKEN + '.py'))
        print('DONE')"""),
    "write_system_dirs": A("""
        for d in ('/', '/usr', '/usr/bin', '/bin', '/lib', '/run', '/proc', '/dev', '/sys', '/var'):
            must_fail('wrote ' + d, lambda: write(d + '/' + TOKEN))
        print('DONE')"""),
    "symlink_and_proc_root_tricks": A("""
        os.symlink('/run/lock', '/tmp/l')
        must_fail('wrote through a symlink', lambda: write('/tmp/l/' + TOKEN))
        must_fail('wrote via ..', lambda: write('/tmp/../../run/lock/' + TOKEN))
        must_fail('wrote via /proc/self/root', lambda: write('/proc/self/root/etc/' + TOKEN))
        must_fail('wrote via /proc/1/root', lambda: write('/proc/1/root/run/lock/' + TOKEN))
        must_fail('hard-linked /etc/passwd', lambda: os.link('/etc/passwd', '/tmp/pw'))
        must_fail('read the host via /proc/1/root', lambda: open('/proc/1/root' + BAIT['secret_file']).read())
        print('DONE')"""),
    "fill_the_work_area": A("""
        total = 0
        try:
            for i in range(1000):
                write(f'/tmp/fill-{i}', b'x' * (2 << 20))
                total += 2
        except OSError as exc:
            print('FILLED', total, exc.errno)
        if total > 8:
            leak(f'{total} MiB in an 8 MiB work area')
        print('DONE')""", must_print="FILLED"),
    "fill_dev_shm": A("""
        total = 0
        try:
            for i in range(1000):
                write(f'/dev/shm/fill-{i}', b'x' * (2 << 20))
                total += 2
        except OSError as exc:
            print('FILLED', total, exc.errno)
        if total > 8:
            leak(f'{total} MiB in an 8 MiB /dev/shm')
        print('DONE')""", must_print="FILLED"),
    "many_empty_files": A("""
        n = 0
        try:
            for n in range(20000):
                open(f'/tmp/e{n}', 'w').close()
        except OSError as exc:
            print('STOPPED', n, exc.errno)
        print('DONE')"""),
    "big_single_file": A("""
        must_fail('wrote past RLIMIT_FSIZE', lambda: write('/tmp/big', b'x' * (6 << 20)))
        print('DONE')"""),
    "mknod_devices": A("""
        must_fail('mknod char', lambda: os.mknod('/tmp/c' + TOKEN, stat.S_IFCHR | 0o666, os.makedev(1, 3)))
        must_fail('mknod block', lambda: os.mknod('/tmp/b' + TOKEN, stat.S_IFBLK | 0o666, os.makedev(254, 0)))
        print('DONE')"""),
    "mount_chroot_unshare": A("""
        if libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, None) == 0:
            leak('mounted a tmpfs')
        if libc.mount(None, b'/', None, 32 | 4096, None) == 0:  # MS_REMOUNT | MS_BIND: read-write again
            leak('remounted / read-write')
        if libc.umount2(b'/proc', 2) == 0:
            leak('unmounted /proc')
        if libc.unshare(0x10000000 | 0x00020000) == 0:
            leak('made a user + mount namespace')
        if libc.unshare(0x00020000) == 0:
            leak('made a mount namespace')
        must_fail('chroot', lambda: os.chroot('/tmp'))
        print('DONE')"""),
    "privileges": A("""
        must_fail('setuid 0', lambda: os.setuid(0))
        status = dict(line.split(':', 1) for line in open('/proc/self/status') if ':' in line)
        if int(status['CapEff'], 16) or int(status['CapPrm'], 16):
            leak('has capabilities')
        if status['NoNewPrivs'].strip() != '1':
            leak('no_new_privs unset')
        for line in open('/proc/self/mountinfo'):
            if line.split()[4] in ('/usr', '/etc') and 'nosuid' not in line.split()[5]:
                leak('set-uid binaries work: ' + line)
        print('DONE')"""),
    "hostname": A("""
        must_fail('set the hostname', lambda: socket.sethostname('pwned'))
        must_fail('wrote /proc/sys/kernel/hostname', lambda: write('/proc/sys/kernel/hostname', b'pwned'))
        print('DONE')"""),
    "proc_and_sys_writes": A("""
        for p in ('/proc/sysrq-trigger', '/proc/sys/vm/drop_caches', '/proc/sys/kernel/core_pattern',
                  '/sys/kernel/uevent_helper', '/proc/sys/user/max_user_namespaces'):
            must_fail('wrote ' + p, lambda: write(p, b'1'))
        print('DONE')"""),
    "host_devices": A("""
        for d in ('/dev/mem', '/dev/kmsg', '/dev/vda', '/dev/sda', '/dev/port', '/dev/kvm', '/dev/fuse'):
            must_fail('opened ' + d, lambda: open(d, 'rb').close())
        print('DONE')"""),
    # -- sockets ----------------------------------------------------------------------------------
    "host_unix_sockets": A("""
        for path in BAIT['unix_sockets'] + ['\\0' + BAIT['abstract']]:
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(1)
            must_fail('connected ' + repr(path), lambda: s.connect(path))
            s.close()
        print('DONE')"""),
    "tcp_to_the_host": A("""
        for ip in BAIT['host_ips']:
            must_fail('tcp ' + ip, lambda: socket.create_connection((ip, BAIT['tcp_port']), timeout=1))
        print('DONE')"""),
    "udp_to_the_host": A("""
        for ip in BAIT['host_ips']:  # a datagram cannot fail visibly: the bait listener must see none
            try:
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(TOKEN.encode(), (ip, BAIT['udp_port']))
            except OSError:
                pass
        time.sleep(0.2)
        print('DONE')"""),
    "internet_and_dns": A("""
        must_fail('reached 1.1.1.1', lambda: socket.create_connection(('1.1.1.1', 80), timeout=1))
        must_fail('resolved a name', lambda: socket.getaddrinfo('example.com', 80))
        print('DONE')"""),
    # -- other processes --------------------------------------------------------------------------
    "proc_other_processes": A("""
        pids = [p for p in os.listdir('/proc') if p.isdigit()]
        if len(pids) > 4:
            leak(f'sees {len(pids)} processes')
        for pid in pids:
            try:
                cmdline = open(f'/proc/{pid}/cmdline', 'rb').read()
            except OSError:
                continue
            if BAIT['marker'].encode() in cmdline or b'pytest' in cmdline:
                leak('sees a host process: ' + repr(cmdline[:80]))
        print('DONE')"""),
    "proc_host_pid": A("""
        pid = BAIT['host_pid']
        must_fail('read the host pid', lambda: open(f'/proc/{pid}/cmdline').read().index('pytest'))
        print('DONE')"""),
    "environment_secrets": A("""
        print(dict(os.environ))
        for p in ('self', '1', str(os.getppid())):
            try:
                print(open(f'/proc/{p}/environ').read())
            except OSError as exc:
                print('denied', exc)
        print('DONE')"""),
    "host_files_outside_system_dirs": A("""
        must_fail('read the secret file', lambda: open(BAIT['secret_file']).read())
        must_fail('read the repo', lambda: open(BAIT['repo'] + '/README.md').read())
        for d in ('/home', '/root', '/var/log', '/mnt', '/srv', '/opt', '/work'):
            if not any(b == d or b.startswith(d + '/') for b in BAIT['bound']):  # e.g. a venv's parents
                must_fail('listed ' + d, lambda: os.listdir(d))
        print('DONE')"""),
    "ptrace_and_process_vm": A("""
        if libc.ptrace(16, 1, None, None) == 0:  # PTRACE_ATTACH
            leak('ptrace-attached pid 1')
        if libc.ptrace(16, os.getppid(), None, None) == 0:
            leak('ptrace-attached the parent')
        if libc.ptrace(0, 0, None, None) == 0:  # PTRACE_TRACEME
            leak('PTRACE_TRACEME')
        print('DONE')"""),
    "kill_everything": A("""
        for target in (-1, 1):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.2)
        print('DONE')"""),
    "fork_bomb": A("""
        while True:
            try:
                os.fork()
            except OSError:
                pass""", statuses=("timeout", "cpu_limit", "error"), limits={"wall_time_s": 1.5}),
    "fork_count": A("""
        n = 0
        try:
            for n in range(200):
                if os.fork() == 0:
                    time.sleep(10)
                    os._exit(0)
        except OSError as exc:
            print('forked', n, exc.errno)
        if n > 9:
            leak(f'{n} processes under a limit of 8')
        print('DONE')""", must_print="forked"),
    "thread_bomb": A("""
        import threading
        n = 0
        try:
            for n in range(1000):
                threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
        except RuntimeError:
            pass
        print('threads', n)
        if n > 16:
            leak(f'{n} threads')
        print('DONE', flush=True)
        os._exit(0)"""),
    "setsid_daemon_escape": A("""
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:  # a daemon, detached twice, that writes once the run is over
                time.sleep(2)
                write('/tmp/late-' + TOKEN)
                os._exit(0)
            os._exit(0)
        time.sleep(0.1)
        print('DONE')"""),
    "sysv_ipc_objects": A("""
        print('shm', libc.shmget(0x7117, 1 << 20, 0o1000 | 0o666))  # IPC_CREAT
        print('sem', libc.semget(0x7117, 4, 0o1000 | 0o666))
        print('msg', libc.msgget(0x7117, 0o1000 | 0o666))
        print('DONE')"""),
    "open_files": A("""
        fds = []
        try:
            while True:
                fds.append(os.open('/dev/null', os.O_RDONLY))
        except OSError:
            pass
        if len(fds) > 64:
            leak(f'{len(fds)} files open')
        print('DONE')"""),
    "core_dump": A("os.abort()", statuses=("error",)),
    "huge_output": A("""
        while True:
            sys.stdout.write('y' * 65536)""", statuses=("output_limit",)),
    # (its own CPU budget: zero-filling 256 MB plus the interpreter's start took over the shared 1 s once on a loaded
    # 2-core host, ending in cpu_limit before the memory limit was reached; the memory limit is what is tested here)
    "huge_memory": A("""
        chunks = []
        while True:
            chunks.append(bytearray(50 << 20))""", statuses=("error",), limits={"cpu_time_s": 10, "wall_time_s": 20.0}),
    "cpu_loop": A("""
        while True:
            pass""", statuses=("cpu_limit", "timeout")),
    "sleep_forever": A("time.sleep(60)", statuses=("timeout",), limits={"wall_time_s": 1.0}),
}


def _run_attack(name: str, backend: str, monkeypatch, bait: Bait) -> RunResult:
    attack = ATTACKS[name]
    code = PRELUDE.format(bait=json.dumps(bait.info)) + attack.code
    results: list[RunResult] = []
    real_run_program = sandbox.run_program

    def spy(*args, **kwargs):
        results.append(real_run_program(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(sandbox, "run_program", spy)
    monkeypatch.setenv("TILLER_TEST_SECRET", SECRET)
    truth = {"inputs": [""], "outputs": [EXPECTED]}
    score = default_compute_score("codecontests", f"```python\n{code}\n```", truth,
                                  **{**LIMITS, **attack.limits, "backend": backend})
    assert score["score"] == 0.0
    (result,) = results
    assert result.backend == backend and result.filesystem_isolated and result.network_isolated
    return result


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_is_contained(name, backend, monkeypatch, bait):
    attack = ATTACKS[name]
    result = _run_attack(name, backend, monkeypatch, bait)
    output = result.stdout + result.stderr
    assert "LEAK" not in output, output[-2000:]
    assert result.status in attack.statuses, (result.status, output[-2000:])
    if result.status == "ok":  # it ran to its end: a crash half-way is no proof of containment
        assert "DONE" in result.stdout, output[-2000:]
    if attack.must_print:
        assert attack.must_print in result.stdout, output[-2000:]
    assert SECRET not in output
    assert result.wall_s < LIMITS["wall_time_s"] + 2.0


def test_the_suite_is_broad_enough():
    assert len(ATTACKS) >= 25


def test_work_area_cap_is_the_limit(backend, monkeypatch, bait):
    result = _run_attack("fill_the_work_area", backend, monkeypatch, bait)
    line = next(line for line in result.stdout.splitlines() if line.startswith("FILLED"))
    _, total_mb, err = line.split()
    assert int(total_mb) <= LIMITS["work_mb"] and int(err) == 28  # ENOSPC: the tmpfs is full


WRAPPER = """
import json, sys
from tiller.rewards.sandbox import SandboxLimits, run_program
code = '''
import os, signal, time
for target in (os.getppid(), 1):
    try:
        os.kill(target, signal.SIGKILL)
    except OSError as exc:
        print('denied', target, exc)
group = os.getpgid(os.getppid())  # 0 inside a PID namespace: the group's leader is outside
if group not in (0, os.getpgrp()):  # killpg(0) would be the program's own group: its own business
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError as exc:
        print('denied pg', exc)
try:
    os.kill(-1, signal.SIGKILL)  # everything it may signal, which is not itself
except OSError as exc:  # ESRCH: there is nothing else
    print('kill -1', exc)
time.sleep(0.2)
print('still here')
'''
result = run_program(code, limits=SandboxLimits(cpu_time_s=1, wall_time_s=3.0, backend=sys.argv[1]))
print(json.dumps({"status": result.status, "stdout": result.stdout}))
"""


def test_killing_its_parent_fails(backend):
    # The program's parent on the host is a sacrificial wrapper: if containment failed, the wrapper would
    # die by SIGKILL instead of printing the result. Inside, its parent is the sandbox's pid 1, which
    # must survive too (the run ends normally, with the program's last line).
    proc = subprocess.run([sys.executable, "-c", WRAPPER, backend], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["status"] == "ok" and "still here" in report["stdout"], report


def test_prelude_reports_a_leak_when_something_succeeds(backend):
    # the suite's own check: a program whose forbidden step succeeds does print LEAK
    code = PRELUDE.format(bait=json.dumps({"token": TOKEN})) + "must_fail('wrote its own /tmp', lambda: write('/tmp/x'))\n"
    result = sandbox.run_program(code, limits=SandboxLimits(**{**LIMITS, "backend": backend}))
    assert "LEAK wrote its own /tmp" in result.stdout


def test_the_bait_is_set(bait):
    assert "/tmp" in bait.info["ww_dirs"] and "/tmp/" + TOKEN + ".sock" in bait.info["unix_sockets"]
