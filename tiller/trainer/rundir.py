"""A run dir holds one run: one process at a time, one model, and a record of the sampling it ran with.

`RUN_DIR/tiller.lock` holds the holder's pid, host, start time and command line.

`acquire_run_dir(run_dir)` takes the lock or raises a `ConfigError` naming the process that holds it, so a second
`tiller rl` on the same `trainer.default_local_dir` refuses at once instead of interleaving its steps, metrics and
checkpoints with the first. The lock is an exclusive `fcntl.flock` on the file, which the kernel drops when the
holding process ends however it ends (kill -9 included): a lock file left by a dead process is stale, detected by
the next run (which says so in one line) and taken over. `release_run_dir` (and interpreter exit) removes the file.
`release_run_dir(run_dir, discard=True)` (a run that refused to start) also removes the directories `acquire_run_dir`
created, deepest first, each only while it is empty: a refused run leaves no trace, and a dir that existed before is
never touched.

Within one process the lock is shared (a count): a test or a notebook that builds a second trainer on the same dir
is one process, not two. POSIX only (`fcntl`); elsewhere the lock is a no-op.

`claim_run_dir` decides what a new run may do with the records an earlier one left (checkpoints, metrics.jsonl,
TensorBoard events): continue them from a checkpoint of the same model, or replace them with trainer.overwrite=true;
a checkpoint of another model (architecture or size) is a mismatch, refused with both models named, never taken for
damage. `sampling_settings` is kept in each checkpoint; `sampling_changes` says what a resume changed.
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
_HELD: dict[Path, list] = {}  # lock path -> [fd, count, the directories its acquire created] of this process's locks


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
    run_dir = Path(run_dir).expanduser().absolute()
    created = [d for d in (run_dir, *run_dir.parents) if not d.exists()]  # deepest first
    run_dir.mkdir(parents=True, exist_ok=True)
    path = (run_dir / LOCK_NAME).resolve()
    if path in _HELD:
        _HELD[path][1] += 1
        return path
    for _ in range(5):  # the file may be removed and made again by a holder between our open and our flock
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # a refused run removed the dir it had made (release_run_dir's discard)
            run_dir.mkdir(parents=True, exist_ok=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)  # the holder made the dir: ours to leave as it is
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
    _HELD[path] = [fd, 1, created]
    return path


def release_run_dir(run_dir: str | os.PathLike, discard: bool = False) -> None:
    """Drop this process's hold on `run_dir`; the last release removes the lock file (a no-op if not held).
    `discard` (a run that refused to start): the last release also removes the directories its acquire created
    that are empty, deepest first (`rmdir`: a file anyone put there keeps its dir)."""
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
        if discard:
            _remove_empty(held[2])
    finally:
        os.close(held[0])


def _remove_empty(dirs: list[Path]) -> None:
    """rmdir each of `dirs` (deepest first) while it is empty; stop at the first that is not."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:  # not empty (or gone): it and the dirs above it stay
            return


@atexit.register
def _release_all() -> None:
    for path in list(_HELD):
        _HELD[path][1] = 1
        release_run_dir(path.parent)


# ------------------------------------------------------------------------------------- records of a run
def run_records(run_dir: Path, ckpt_root: Path) -> list[Path]:
    """The records an earlier run left in `run_dir`: checkpoints, metrics, TensorBoard events."""
    return [p for p in (ckpt_root, run_dir / "metrics.jsonl", run_dir / "tensorboard")
            if p.exists() and (p.is_file() or any(p.iterdir()))]


def clear_records(run_dir: Path, records: list[Path]) -> None:
    """trainer.overwrite=true: remove an earlier run's records (one line says which)."""
    import shutil

    for path in records:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    print(f"trainer.overwrite=true: removed the earlier run's {', '.join(p.name for p in records)} from {run_dir}")


def refuse_other_model(ckpt: Path, model_path: str, where: str) -> None:
    """A ConfigError naming both models when checkpoint `ckpt` holds another model than `model_path`."""
    from tiller.models.checkpoint import model_mismatch  # import cost: torch, which the lock alone does not need

    other = model_mismatch(ckpt, model_path)
    if other is None:
        return
    raise ConfigError(f"{where}: checkpoint {ckpt.name} holds another model, {other[0]}, than "
                      f"actor_rollout_ref.model.path={model_path}, {other[1]}; resume it with its own model, or start "
                      "over: trainer.overwrite=true replaces this run's records, trainer.resume_mode=disable with "
                      "another trainer.default_local_dir keeps them")


def claim_run_dir(run_dir: Path, ckpt_root: Path, tr, model_path: str) -> list[Path]:
    """Refuse an earlier run's records this run would not continue, so checkpoints and metrics of two runs never mix
    in one dir; with trainer.overwrite=true return them: the records to replace, which the caller clears
    (`clear_records`) once its start-up has passed, so a run that refuses to start leaves them as they were.
    `tr`: the trainer config section."""
    # import cost: torch, which the lock alone does not need
    from tiller.models.checkpoint import latest_checkpoint, model_mismatch, resolve_checkpoint

    if tr.resume_mode == "resume_path":
        refuse_other_model(resolve_checkpoint(tr.resume_from_path), model_path, "trainer.resume_from_path")
        return []
    records = run_records(run_dir, ckpt_root)
    if not records:
        return []
    latest = latest_checkpoint(ckpt_root) if tr.resume_mode == "auto" else None
    if latest is not None and not tr.overwrite:
        refuse_other_model(latest, model_path, f"trainer.default_local_dir={run_dir}")
        return []  # the run continues from a checkpoint: its records are this run's
    if latest is not None and model_mismatch(latest, model_path) is None:
        return []  # trainer.overwrite=true resumes a checkpoint that fits (verl: overwrite is about the records)
    if not tr.overwrite:
        why = "trainer.resume_mode=disable" if tr.resume_mode == "disable" else "it has no checkpoint to resume from"
        raise ConfigError(f"trainer.default_local_dir={run_dir} holds an earlier run "
                          f"({', '.join(p.name for p in records)}) and {why}: pass trainer.overwrite=true to "
                          "replace it, or choose another trainer.default_local_dir")
    return records


# --------------------------------------------------------------------------------------------- sampling
def sampling_settings(cfg) -> dict:
    """The settings of an RL config that decide what the rollout samples, by key (plain JSON values)."""
    r, data = cfg.actor_rollout_ref.rollout, cfg.data
    out = {f"actor_rollout_ref.rollout.{k}": getattr(r, k) for k in (
        "n", "temperature", "top_p", "top_k", "min_p", "do_sample", "ignore_eos", "response_length", "stop",
        "response_length_schedule", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "structured_outputs_regex")}
    out.update({f"actor_rollout_ref.rollout.val_kwargs.{k}": v for k, v in vars(r.val_kwargs).items()})
    out.update({"data.max_response_length": data.max_response_length, "data.train_batch_size": data.train_batch_size,
                "data.gen_batch_size": data.gen_batch_size})
    return json.loads(json.dumps(out, default=str))  # lists, not tuples: equal to what a checkpoint gives back


def sampling_changes(saved: dict | None, now: dict) -> str:
    """`rollout.n 2 -> 4; rollout.temperature 1.0 -> 0.7` for the settings that differ ("" for none, or for a
    checkpoint written before the settings were kept).

    >>> sampling_changes({"actor_rollout_ref.rollout.n": 2, "data.max_response_length": 8},
    ...                  {"actor_rollout_ref.rollout.n": 4, "data.max_response_length": 8})
    'rollout.n 2 -> 4'
    """
    changed = [f"{k.removeprefix('actor_rollout_ref.')} {saved[k]!r} -> {now[k]!r}"
               for k in now if saved and k in saved and saved[k] != now[k]]
    return "; ".join(changed)
