"""`tiller report RUN_DIR`: PNG plots of a run's metrics and a first/last/min/max summary table.

Reads `RUN_DIR/metrics.jsonl` (written by `Tracker`; lines that do not read, such as a line cut by a kill or bytes
that are not UTF-8, are skipped and counted in one warning; a step logged twice keeps its last row; null means
"not finite"). Writes to `RUN_DIR/plots/`:
- `main.png`: the curves most people look at first (reward, validation accuracy, response length,
  entropy, policy loss, KL, grad norm; SFT / RM / DPO losses), whichever are present;
- `<family>.png` for every metric family (the part of the name before the first "/", e.g. `actor`,
  `critic`, `val-core`, `timing_s`), one panel per metric.
Each PNG is written to a temp file and renamed, so a plot is never half-written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

from tiller.errors import UserError

Series = dict[str, tuple[list[int], list[float]]]

# Panels of main.png: (title, regex over metric names); every matching metric is drawn in the panel.
MAIN_PANELS = [
    ("reward", r"^critic/score/mean$|^critic/rewards/mean$"),
    ("validation accuracy", r"^val-core/.+/mean@\d+$"),
    ("response length", r"^response_length/mean$"),
    ("entropy", r"^actor/entropy$"),
    ("policy loss", r"^actor/pg_loss$"),
    # KL to the reference model, in the loss or the reward: a run without KL has no such metric and no panel
    # (actor/ppo_kl, how far one update moved the policy, is in actor.png)
    ("KL", r"^actor/kl_loss$|^critic/kl$"),
    ("grad norm", r"^actor/grad_norm$"),
    ("loss", r"^(train|val)/loss$"),
    ("accuracy", r"^(train|val)/(acc|accuracy|reward_accuracy)$"),
]
PANELS_PER_FIGURE = 16


def read_metrics(path: str | os.PathLike) -> Series:
    """metric -> (steps, values) sorted by step; numbers only; null -> nan."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"no metrics file: {path}")
    rows: dict[int, dict] = {}
    bad: list[int] = []  # line numbers: bytes that are not UTF-8, a line cut by a kill, not a metrics row
    for lineno, raw in enumerate(path.read_bytes().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
            step = int(row["step"])
        except (ValueError, KeyError, TypeError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            bad.append(lineno)
            continue
        rows[step] = row
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        print(f"warning: {path}: skipped {len(bad)} unreadable line{'s' if len(bad) > 1 else ''} (not UTF-8, not a "
              f"complete JSON object with a step, e.g. cut by a kill): line {shown}", file=sys.stderr)
    series: Series = {}
    for step in sorted(rows):
        for k, v in rows[step].items():
            if k == "step" or isinstance(v, (str, bool, list, dict)):
                continue
            steps, values = series.setdefault(k, ([], []))
            steps.append(step)
            values.append(float("nan") if v is None else float(v))
    if not series:
        raise UserError(f"no metrics in {path}")
    return series


def _safe_name(name: str) -> str:
    return re.sub(r"[^\w\-.]+", "_", name).strip("_") or "metrics"


def _savefig(fig, path: Path) -> None:
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100, bbox_inches="tight")
    os.replace(tmp, path)


def _draw(ax, series: Series, keys: list[str], title: str) -> None:
    for k in keys:
        steps, values = series[k]
        marker = "o" if len(steps) <= 30 else None
        ax.plot(steps, values, marker=marker, markersize=3, linewidth=1.2, label=k)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if keys != [title]:  # main.png panels: name the metrics drawn
        ax.legend(fontsize=6)


def _figure(series: Series, panels: list[tuple[str, list[str]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.9 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
        _draw(ax, series, keys, title)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    _savefig(fig, path)
    plt.close(fig)
    return path


def main_panels(series: Series) -> list[tuple[str, list[str]]]:
    """main.png's panels: (title, metrics drawn) for each of `MAIN_PANELS` with a metric in `series`."""
    panels = [(title, [k for k in series if re.search(rx, k)]) for title, rx in MAIN_PANELS]
    return [(t, ks) for t, ks in panels if ks]


def write_plots(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                series: Series | None = None, families: bool = True) -> list[Path]:
    """Write main.png and (with `families`) one PNG per metric family; returns the paths written."""
    run_dir = Path(run_dir)
    series = series if series is not None else read_metrics(run_dir / "metrics.jsonl")
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    main = main_panels(series)
    if main:
        written.append(_figure(series, main, out / "main.png"))
    if not families:
        return written
    by_family: dict[str, list[str]] = {}
    for k in series:
        by_family.setdefault(k.split("/", 1)[0] if "/" in k else "other", []).append(k)
    for family, keys in by_family.items():
        for part in range(0, len(keys), PANELS_PER_FIGURE):
            chunk = keys[part:part + PANELS_PER_FIGURE]
            suffix = "" if part == 0 else f"_{part // PANELS_PER_FIGURE + 1}"
            written.append(_figure(series, [(k, [k]) for k in chunk], out / f"{_safe_name(family)}{suffix}.png"))
    return written


def summary_rows(series: Series) -> list[dict]:
    """Per metric: number of finite points, first, last, min, max (over finite values)."""
    rows = []
    for k in sorted(series):
        vals = [v for v in series[k][1] if math.isfinite(v)]
        if vals:
            rows.append(dict(metric=k, n=len(vals), first=vals[0], last=vals[-1], min=min(vals), max=max(vals)))
        else:
            rows.append(dict(metric=k, n=0, first=None, last=None, min=None, max=None))
    return rows


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if v == 0 or 1e-3 <= abs(v) < 1e6 else f"{v:.3e}"


def print_summary(series: Series, title: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or None)
    for col, justify in [("metric", "left"), ("n", "right"), ("first", "right"), ("last", "right"),
                         ("min", "right"), ("max", "right")]:
        table.add_column(col, justify=justify)
    for r in summary_rows(series):
        table.add_row(r["metric"], str(r["n"]), *(_fmt(r[c]) for c in ("first", "last", "min", "max")))
    Console(width=max(100, Console().width)).print(table)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tiller report",
                                     description="Plot a run's metrics to RUN_DIR/plots/*.png and print a summary.")
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="where to write the PNGs (default RUN_DIR/plots)")
    parser.add_argument("--no-plots", action="store_true", help="only print the summary table")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory not found: {run_dir}")
    series = read_metrics(run_dir / "metrics.jsonl")
    print_summary(series, title=str(run_dir))
    if not args.no_plots:
        paths = write_plots(run_dir, args.out, series)
        print(f"wrote {len(paths)} plots to {paths[0].parent}: {', '.join(p.name for p in paths)}")
    return 0
