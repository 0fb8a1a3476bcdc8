"""The tail every `tiller demo` task shares: GRPO from the starter model, held-out accuracy before and after,
`plots/demo_curves.png` and an atomic `summary.json`.

`tiller.trainer.demo` (arithmetic) and `tiller.trainer.demo_shapes` (vision) both import it; it imports
neither, so the lazy `demo -> demo_shapes` import stays free of cycles.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tiller.models.checkpoint import write_text_atomic
from tiller.trainer.rl import RLTrainer


def plot_curves(metrics_path: Path, out_png: Path, val_key: str) -> Path | None:
    """Reward (mean score per step) and held-out accuracy curves as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r.get("metrics", r) | {"step": r.get("step", r.get("metrics", {}).get("step", 0))} for r in rows]
    reward = [(r["step"], r["critic/score/mean"]) for r in rows if "critic/score/mean" in r]
    acc = [(r["step"], r[val_key]) for r in rows if val_key in r]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, series, title in ((axes[0], reward, "train reward (mean score)"),
                              (axes[1], acc, "held-out greedy accuracy")):
        if series:
            ax.plot(*zip(*series), marker="." if len(series) < 40 else None)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def train_and_report(cfg, run_dir: Path, val_key: str, *, t0: float, warmup_s: float, fields: dict) -> dict:
    """Run GRPO with `cfg`, then write `plots/demo_curves.png` and `summary.json` in `run_dir`; returns the
    summary: `val_acc_before` / `val_acc_after` / `val_acc_gain` (the first and last validation's `val_key`),
    `rl_steps`, `wall_s` (since `t0`), `warmup_s`, `rl_s`, `plot`, and the caller's `fields`."""
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    wall = time.time() - t0
    history = trainer.val_history
    before, after = history[0][1][val_key], history[-1][1][val_key]
    png = plot_curves(run_dir / "metrics.jsonl", run_dir / "plots" / "demo_curves.png", val_key)
    summary = {**fields, "val_acc_before": before, "val_acc_after": after, "val_acc_gain": after - before,
               "rl_steps": trainer.global_step, "wall_s": wall, "warmup_s": warmup_s, "rl_s": wall - warmup_s,
               "plot": str(png)}
    write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
