"""Run records: one `Tracker` fans each step's metrics out to the console, JSONL, TensorBoard, W&B, MLflow.

Backends (verl's `trainer.logger` names):
- console: one compact line per step (rich), with the step and a few key metrics;
- jsonl: `RUN_DIR/metrics.jsonl`, one JSON object per step with "step"; non-finite values are written
  as null so every line is valid JSON; flushed and fsynced each step, so a killed run keeps its metrics;
- tensorboard: `RUN_DIR/tensorboard/` event files (torch.utils.tensorboard), flushed each step;
- file: verl's file logger: `$VERL_FILE_LOGGER_PATH`, else `${VERL_FILE_LOGGER_ROOT:-.}/<project>/<experiment>.jsonl`,
  one `{"step": N, "data": {...}}` line per step (verl's format; non-finite values as null); a new run starts the
  file afresh (as verl), a resumed one keeps its lines up to the resumed step;
- wandb / mlflow: imported only when selected; a clear error names the extra to install.

The run directory also holds `config.yaml` (written atomically at start), `checkpoints/` and `plots/`
(`tiller report RUN_DIR`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tiller.errors import UserError

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "file")

# Metrics shown on the console line, in this order, with short labels (others go to files only).
CONSOLE_KEYS = {
    "critic/score/mean": "score",
    "critic/rewards/mean": "reward",
    "actor/pg_loss": "pg_loss",
    "actor/entropy": "entropy",
    "actor/kl_loss": "kl",
    "actor/grad_norm": "grad",
    "critic/vf_loss": "vf_loss",
    "response_length/mean": "len",
    "train/loss": "loss",
    "val/loss": "val_loss",
    "timing_s/step": "s/step",
}


def _to_number(value: Any) -> float | int | str | None:
    """Python scalar for a tensor / numpy scalar / number; strings pass; anything else -> None (skipped)."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float | str):
        return value
    return None


def _jsonable(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _fmt(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _config_yaml(config) -> str:
    import yaml

    if isinstance(config, str):
        return config
    if dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)
    return yaml.safe_dump(json.loads(json.dumps(config, default=str)), sort_keys=False)


class _Console:
    def __init__(self, total_steps: int | None, keys: Mapping[str, str] | None):
        from rich.console import Console

        self.console = Console(highlight=False)
        self.total = total_steps
        self.keys = dict(keys) if keys is not None else CONSOLE_KEYS

    def log(self, metrics: dict, step: int) -> None:
        head = f"step {step}" + (f"/{self.total}" if self.total else "")
        parts = [f"[bold]{head}[/bold]"]
        parts += [f"{label} [cyan]{_fmt(metrics[k])}[/cyan]" for k, label in self.keys.items() if k in metrics]
        # validation accuracies, e.g. val-core/gsm8k/acc/mean@1 -> val/gsm8k
        for k, v in metrics.items():
            m = re.match(r"val-core/([^/]+)/[^/]+/mean@\d+$", k)
            if m:
                parts.append(f"val/{m.group(1)} [green]{_fmt(v)}[/green]")
        self.console.print(" | ".join(parts), soft_wrap=True)

    def close(self) -> None:
        pass


class _Jsonl:
    def __init__(self, run_dir: Path, resume_from_step: int | None):
        self.path = run_dir / "metrics.jsonl"
        if resume_from_step is not None and self.path.exists():
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and _step_of_line(line) is not None and _step_of_line(line) <= resume_from_step]
            _write_atomic(self.path, "".join(line + "\n" for line in keep))
        self.file = open(self.path, "a")

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row, allow_nan=False) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


class _File:
    """verl's `file` logger (see the module docstring)."""

    def __init__(self, project: str, experiment: str, resume_from_step: int | None):
        where = os.environ.get("VERL_FILE_LOGGER_PATH")
        if where is None:
            root = os.path.expanduser(os.environ.get("VERL_FILE_LOGGER_ROOT", "."))
            where = os.path.join(root, project, f"{experiment}.jsonl")
        self.path = Path(where)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            keep = []
            if resume_from_step is not None and self.path.exists():
                keep = [line for line in self.path.read_text().splitlines()
                        if line.strip() and _step_of_line(line) is not None and _step_of_line(line) <= resume_from_step]
            _write_atomic(self.path, "".join(line + "\n" for line in keep))
            self.file = open(self.path, "a")
        except OSError as err:
            raise UserError(f"trainer.logger=file: cannot write {self.path} ({err.strerror}); set "
                            "VERL_FILE_LOGGER_PATH or VERL_FILE_LOGGER_ROOT to a writable place") from None

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": step, "data": {k: _jsonable(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row, allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _step_of_line(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class _TensorBoard:
    def __init__(self, run_dir: Path, config_text: str | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if config_text:
            self.writer.add_text("config", "```yaml\n" + config_text + "\n```", 0)

    def log(self, metrics: dict, step: int) -> None:
        for k, v in metrics.items():
            if not isinstance(v, str):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _import_extra(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise UserError(f"trainer.logger includes {name!r} but {name} is not installed: "
                        f"pip install 'tiller[{name}]'") from err


class _Wandb:
    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict | None):
        self.wandb = _import_extra("wandb")
        self.run = self.wandb.init(project=project, name=experiment, config=config, dir=str(run_dir))

    def log(self, metrics: dict, step: int) -> None:
        self.run.log({k: v for k, v in metrics.items() if not isinstance(v, str)}, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict | None):
        self.mlflow = _import_extra("mlflow")
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            self.mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        self.mlflow.set_experiment(project)
        self.mlflow.start_run(run_name=experiment)
        if config:
            flat = _flatten(config)
            self.mlflow.log_params({k[:250]: str(v)[:500] for k, v in flat.items()})

    def log(self, metrics: dict, step: int) -> None:
        # MLflow names allow [A-Za-z0-9_-. /:]; verl's names use "@" (acc/mean@4)
        clean = {re.sub(r"[^\w\-. /:]", "_", k): v for k, v in metrics.items() if not isinstance(v, str)}
        self.mlflow.log_metrics(clean, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def parse_loggers(loggers: str | Iterable[str]) -> list[str]:
    """`"console,jsonl"` / `["console", "jsonl"]` -> validated list; unknown names raise UserError."""
    names = [s.strip() for s in loggers.split(",")] if isinstance(loggers, str) else [str(s).strip() for s in loggers]
    names = [n for n in names if n]
    bad = [n for n in names if n not in LOGGERS]
    if bad:
        raise UserError(f"trainer.logger: unknown logger(s) {bad}; valid: {', '.join(LOGGERS)}")
    return list(dict.fromkeys(names))


class Tracker:
    """Fan-out of per-step metrics to the selected loggers; see the module docstring.

    run_dir: the run directory (created); `config.yaml` is written there when `config` is given
        (a dict, a dataclass, or YAML text).
    resume_from_step: on resume, drop metrics.jsonl rows after this step (they were logged by the
        killed run after its last checkpoint and will be logged again).
    console_keys: metric -> short label for the console line (default `CONSOLE_KEYS`).
    """

    def __init__(self, run_dir: str | os.PathLike, loggers: str | Iterable[str] = ("console", "jsonl", "tensorboard"),
                 project: str = "tiller", experiment: str = "run", config: Any = None,
                 total_steps: int | None = None, resume_from_step: int | None = None,
                 console_keys: Mapping[str, str] | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        names = parse_loggers(loggers)
        config_text = _config_yaml(config) if config is not None else None
        if config_text is not None:
            _write_atomic(self.run_dir / "config.yaml", config_text)
        config_dict = None
        if config is not None and not isinstance(config, str):
            import yaml

            config_dict = yaml.safe_load(config_text)
        self.backends: dict[str, Any] = {}
        for name in names:
            if name == "console":
                self.backends[name] = _Console(total_steps, console_keys)
            elif name == "jsonl":
                self.backends[name] = _Jsonl(self.run_dir, resume_from_step)
            elif name == "tensorboard":
                self.backends[name] = _TensorBoard(self.run_dir, config_text)
            elif name == "wandb":
                self.backends[name] = _Wandb(self.run_dir, project, experiment, config_dict)
            elif name == "mlflow":
                self.backends[name] = _Mlflow(self.run_dir, project, experiment, config_dict)
            elif name == "file":
                self.backends[name] = _File(project, experiment, resume_from_step)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record one step. Tensors / numpy scalars become floats; other non-numbers are dropped."""
        clean = {}
        for k, v in metrics.items():
            num = _to_number(v)
            if num is not None:
                clean[str(k)] = num
        for backend in self.backends.values():
            backend.log(clean, int(step))

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
        self.backends = {}

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextmanager
def timer(name: str, metrics: dict[str, float]):
    """Time the block and add the seconds to `metrics["timing_s/<name>"]` (accumulates within one dict)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing_s/{name}"
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start
