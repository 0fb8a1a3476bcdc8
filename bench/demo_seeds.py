"""Does `tiller demo` learn on every seed? Runs it for seeds 0..N-1 and prints the held-out gains.

Each seed runs `tiller demo --seed S` in its own subprocess, as a user would, with a fresh starter-model
cache by default (so `wall_s` includes the supervised warm-up, i.e. a user's first run; `--reuse-cache`
keeps `~/.cache/tiller/demo`). Seeds run `--parallel` at a time (each with the demo's one torch thread):
on a 2-core machine 2 at a time finishes sooner, but each run's `wall_s` then reflects a shared machine.

Prints one JSON line per seed (`seed`, `val_acc_before`, `val_acc_after`, `gain`, `wall_s`, `warmup_s`,
`rl_s`) and a summary line:
    {"seeds": 5, "min_gain": ..., "median_gain": ..., "max_wall_s": ..., "host": {...}}
The goal (issue 12): every gain >= 0.25, median >= 0.35, each run within 300 s on 2 cores.
`--task shapes` runs the vision-language demo (`tiller demo --task shapes`; issue 39: every gain >= 0.2 on
seeds 0-2). `--min-gain G` makes the exit code 1 when a seed gains less than G (or fails).

    python bench/demo_seeds.py                  # seeds 0-4, two at a time (~10 minutes on 2 cores)
    python bench/demo_seeds.py --seeds 3 --parallel 1 -- actor_rollout_ref.actor.optim.lr=5e-5
    python bench/demo_seeds.py --task shapes --seeds 3 --min-gain 0.2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run_seed(seed: int, root: Path, args, overrides: list[str]) -> dict:
    """One `tiller demo --seed seed` in a subprocess; its summary.json as a dict (+ the exit code)."""
    out = root / f"seed{seed}"
    env = dict(os.environ)
    if not args.reuse_cache:
        env["TILLER_CACHE"] = str(root / f"cache{seed}")
    cmd = [sys.executable, "-m", "tiller.cli", "demo", "--seed", str(seed), "--out", str(out), *args.demo_args,
           *overrides]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (root / f"seed{seed}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        return {"seed": seed, "returncode": proc.returncode, "error": " | ".join(tail)}
    s = json.loads((out / "summary.json").read_text())
    return {"seed": seed, "val_acc_before": s["val_acc_before"], "val_acc_after": s["val_acc_after"],
            "gain": s["val_acc_gain"], "wall_s": round(s["wall_s"], 1), "warmup_s": round(s["warmup_s"], 1),
            "rl_s": round(s["rl_s"], 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 (default 5)")
    parser.add_argument("--parallel", type=int, default=2, help="demo runs at a time (default 2)")
    parser.add_argument("--reuse-cache", action="store_true", help="reuse ~/.cache/tiller/demo starter models")
    parser.add_argument("--out", default=None, help="keep the run dirs and logs here (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per demo (default: the demo's)")
    parser.add_argument("--task", choices=("arithmetic", "shapes"), default="arithmetic", help="the demo's task")
    parser.add_argument("--min-gain", type=float, default=None,
                        help="exit 1 when any seed's held-out gain is below this")
    parser.add_argument("overrides", nargs="*", help="RL config overrides passed to every demo (after --)")
    args = parser.parse_args(argv)
    args.demo_args = ["--task", args.task] + (["--steps", str(args.steps)] if args.steps else [])
    from tiller.hostinfo import compact_host_facts

    host = compact_host_facts()
    with tempfile.TemporaryDirectory(prefix="demo_seeds-") as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
            rows = list(pool.map(lambda s: run_seed(s, root, args, args.overrides), range(args.seeds)))
    for row in rows:
        print(json.dumps(row), flush=True)
    done = [r for r in rows if "gain" in r]
    summary = {"task": args.task, "seeds": len(rows), "failed": len(rows) - len(done),
               "min_gain": round(min(r["gain"] for r in done), 4) if done else None,
               "median_gain": round(statistics.median(r["gain"] for r in done), 4) if done else None,
               "max_wall_s": max(r["wall_s"] for r in done) if done else None,
               "parallel": args.parallel, "fresh_cache": not args.reuse_cache, "host": host}
    print(json.dumps(summary), flush=True)
    if args.min_gain is not None and done and summary["min_gain"] < args.min_gain:
        print(f"FAIL: a seed gained {summary['min_gain']:+.3f} < --min-gain {args.min_gain}", flush=True)
        return 1
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
