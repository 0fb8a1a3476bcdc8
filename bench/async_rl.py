"""Asynchronous RL on the demo task: the synchronous loop vs `async_training.staleness_threshold` 1 and 2.

Each setting runs `tiller demo`'s GRPO (its cached starter model per seed, its config: 32 prompts x n=8,
DAPO filtering, lr 1e-4) for `--steps` steps with the same seeds, in this process, one after the other
(torch threads: `--threads`, the demo's 1 by default; with async each side of the overlap uses that many).
Per setting and seed it records:
- `s_per_step`: training wall time / steps (validation excluded: the held-out check runs at start and end);
- `gen_busy` / `update_busy`: the fraction of that wall time the generation side (gen + reward + filter)
  and the update side (everything else in a step, minus waiting for the producer) were working;
- `threads_borrowed_frac` (async): the share of the trainer's forwards outside the update (old / reference
  logprobs) that ran on the idle producer's threads too; the update itself runs a second micro-batch lane on
  them (`async_training.share_idle_threads`, `actor.update_lanes`);
- `val_acc_before` / `val_acc_after` / `gain`: greedy accuracy on the 256 held-out prompts.
Prints one JSON line per setting (means over seeds, the per-seed values listed) and a summary line
    {"speedup_s1": s/step(s1) / s/step(sync), "speedup_s2": ..., "gain_sync": ..., "gain_s1": ..., "gain_s2": ...,
     "gain_sync_seeds": [...], "host": {...}}
(speedup below 1 = faster; the issue's goal is speedup_s1 <= 0.65 with gain_s1 within the synchronous
seeds' spread). Numbers taken on a shared machine are noisy: the host facts are printed with them.

`--workload gsm8k` times a bigger step instead: a ~30M-parameter Qwen2 (tiny-model kit, random init) on GSM8K
prompts (`--gsm8k-src DIR` with train/test.jsonl, e.g. the repo kit's copy), 4 prompts x n=4, 64 new tokens,
`--steps` steps per setting with the first one untimed; no held-out accuracy (a random model learns nothing
measurable in a few steps), so only the speed fields and the summary's `speedup_*`.

    python bench/async_rl.py                       # seeds 0-2, 150 steps, sync / s1 / s2
    python bench/async_rl.py --seeds 5 --steps 60 --settings 0 1
    python bench/async_rl.py --workload gsm8k --gsm8k-src ../shared/data/gsm8k --seeds 1 --steps 6 --settings 0 1

`--ray N` runs every setting on Ray with the same N CPUs: the synchronous loop on one worker of N threads (it
generates, then updates), asynchronous RL on one trainer worker and a rollout pool (`rollout.n_gpus_per_node`)
of N - 1 workers, one thread each; `s_per_step` compares the two layouts on the same cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def fit(cfg, run_dir: Path):
    """Train `cfg` to the end; returns (the trainer, its metrics.jsonl rows, wall seconds)."""
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(cfg)
    t0 = time.perf_counter()
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return trainer, rows, wall


def run_setting(seed: int, staleness: float, args, root: Path) -> dict:
    """One demo RL run; its speed, busy fractions and held-out accuracy before / after."""
    import torch

    from tiller.config import load_config
    from tiller.tasks import arithmetic
    from tiller.trainer import demo

    torch.set_num_threads(args.threads)
    demo_args = argparse.Namespace(seed=seed, model_params=2_000_000, warmup_target=0.4, train_size=4000,
                                   rebuild=False, steps=args.steps, test_freq=-1, threads=args.threads)
    model_dir = demo.starter_model(demo_args, log=lambda *a: None)
    run_dir = root / f"seed{seed}-s{staleness:g}"
    data_dir = root / f"data{seed}"
    if not data_dir.exists():
        arithmetic.write_task(data_dir, n_train=demo_args.train_size, n_test=256, seed=seed)
    overrides = demo.rl_overrides(model_dir, data_dir, run_dir, demo_args) + [
        "trainer.logger=[jsonl]", "trainer.progress=false", f"async_training.staleness_threshold={staleness}"]
    trainer, rows, wall = fit(load_config(overrides + list(args.overrides)), run_dir)
    steps = [r for r in rows if r.get("step", 0) > 0 and "timing_s/step" in r]
    val_s = sum(r.get("timing_s/testing", 0.0) for r in rows)
    val_s += wall - sum(r["timing_s/step"] + r.get("timing_s/testing", 0.0) + r.get("timing_s/save_checkpoint", 0.0)
                        for r in steps)  # the first validation and start-up: outside the steps
    before, after = trainer.val_history[0][1][demo.VAL_KEY], trainer.val_history[-1][1][demo.VAL_KEY]
    return {"seed": seed, "staleness_threshold": staleness, **step_fractions(rows, staleness),
            "val_acc_before": before, "val_acc_after": after, "gain": after - before, "val_and_setup_s": val_s}


def step_fractions(rows: list[dict], staleness: float, skip: int = 0) -> dict:
    """s/step and the busy fractions of the steps after the first `skip` (see the module docstring)."""
    steps = [r for r in rows if r.get("step", 0) > skip and "timing_s/step" in r]
    train_wall = sum(r["timing_s/step"] for r in steps)
    gen_keys = ("timing_s/gen", "timing_s/gen_max", "timing_s/reward", "timing_s/filter_groups")
    gen = sum(sum(r.get(k, 0.0) for k in gen_keys) for r in steps)
    if staleness > 0:
        update = sum(r["timing_s/step"] - r.get("timing_s/wait_for_rollout", 0.0) for r in steps)
    else:
        update = train_wall - gen
    return {"steps": len(steps), "s_per_step": train_wall / max(len(steps), 1), "gen_busy": gen / train_wall,
            "update_busy": update / train_wall,
            "staleness_max": max((r.get("async/staleness_max", 0.0) for r in steps), default=0.0),
            "dropped_stale": sum(r.get("async/dropped_stale", 0.0) for r in steps),
            "threads_borrowed_frac": statistics.fmean([r.get("async/threads_borrowed_frac", 0.0) for r in steps]
                                                      or [0.0])}


def run_gsm8k_setting(seed: int, staleness: float, args, root: Path) -> dict:
    """One GRPO run of the 30M model on GSM8K prompts; its speed (no accuracy)."""
    import torch

    from tiller.config import load_config
    from tiller.data.preprocess import gsm8k
    from tiller.models.tiny import make_tiny_model

    torch.set_num_threads(args.threads)
    model_dir, data_dir = root / "model-30m", root / "gsm8k"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, arch="qwen2", n_params=30_000_000, seed=0)
    if not (data_dir / "train.parquet").exists():
        gsm8k.convert(args.gsm8k_src, data_dir, max_rows=4 * (args.steps + 4))
    run_dir = root / f"gsm8k-seed{seed}-s{staleness:g}"
    layout = ray_layout(args.ray, staleness) if args.ray else []
    cfg = load_config([
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{data_dir / 'train.parquet'}]",
        "data.train_batch_size=4", "data.max_prompt_length=512", "data.max_response_length=64", f"data.seed={seed}",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.optim.lr=1e-5",
        f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.resume_mode=disable", "trainer.overwrite=true", f"trainer.seed={seed}",
        f"trainer.num_threads={args.threads}", f"trainer.default_local_dir={run_dir}", "trainer.logger=[jsonl]",
        "trainer.progress=false", f"async_training.staleness_threshold={staleness}", *layout, *args.overrides,
    ])
    _, rows, _ = fit(cfg, run_dir)
    return {"seed": seed, "staleness_threshold": staleness, **step_fractions(rows, staleness, skip=1)}


def ray_layout(cpus: int, staleness: float) -> list[str]:
    """`--ray N`: the synchronous loop on one Ray worker of N threads; asynchronous RL on one trainer worker and
    N - 1 rollout workers of one thread each (the same N CPUs)."""
    if staleness == 0:
        return ["trainer.backend=ray", "trainer.n_gpus_per_node=1", f"trainer.cpus_per_worker={cpus}"]
    return ["trainer.backend=ray", "trainer.n_gpus_per_node=1", "trainer.cpus_per_worker=1", "rollout.nnodes=1",
            f"rollout.n_gpus_per_node={cpus - 1}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--steps", type=int, default=150, help="GRPO steps per run (default: the demo's 150)")
    parser.add_argument("--settings", type=float, nargs="+", default=[0, 1, 2],
                        help="staleness_threshold values (0 = synchronous)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: the demo's 1)")
    parser.add_argument("--out", default=None, help="keep run dirs here (default: a temp dir)")
    parser.add_argument("--workload", choices=["demo", "gsm8k"], default="demo",
                        help="demo: the demo task (speed and held-out gain); gsm8k: the 30M model on GSM8K prompts (speed)")
    parser.add_argument("--gsm8k-src", default=None, help="--workload gsm8k: a dir with GSM8K train/test.jsonl")
    parser.add_argument("--ray", type=int, default=0, metavar="N",
                        help="--workload gsm8k on Ray with N CPUs (>= 2): sync on 1 worker x N threads, async on 1 "
                             "trainer + N - 1 rollout workers")
    parser.add_argument("overrides", nargs="*", help="RL config overrides for every run (after --)")
    args = parser.parse_args(argv)
    if args.ray and (args.workload != "gsm8k" or args.ray < 2):
        parser.error("--ray N needs --workload gsm8k and N >= 2")
    if args.workload == "gsm8k" and not args.gsm8k_src:
        parser.error("--workload gsm8k needs --gsm8k-src DIR (GSM8K's train/test.jsonl; nothing is downloaded)")
    run = run_gsm8k_setting if args.workload == "gsm8k" else run_setting
    from tiller.hostinfo import compact_host_facts

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="tiller-async-bench-"))
    results: dict[float, list[dict]] = {s: [] for s in args.settings}
    for seed in range(args.seeds):  # settings interleaved per seed: a busy neighbour hits all of them alike
        for s in args.settings:
            results[s].append(run(seed, s, args, root))
    lines = {}
    for s, runs in results.items():
        line = {"workload": args.workload, "staleness_threshold": s, "seeds": len(runs), "steps": args.steps,
                "threads": args.threads, "ray": " ".join(ray_layout(args.ray, s)) if args.ray else None}
        for key in ("s_per_step", "gen_busy", "update_busy", "threads_borrowed_frac", "val_acc_before", "val_acc_after",
                    "gain"):
            line[key] = round(statistics.fmean(r[key] for r in runs), 4) if key in runs[0] else None
        line["gain_seeds"] = [round(r["gain"], 4) for r in runs] if "gain" in runs[0] else None
        line["s_per_step_seeds"] = [round(r["s_per_step"], 4) for r in runs]
        line["staleness_max"] = max(r["staleness_max"] for r in runs)
        line["dropped_stale"] = sum(r["dropped_stale"] for r in runs)
        lines[s] = line
        print(json.dumps(line), flush=True)
    summary: dict = {}
    sync = lines.get(0.0)
    for s, line in lines.items():
        name = "sync" if s == 0 else f"s{s:g}"
        summary[f"gain_{name}"] = line["gain"]
        if sync is not None and s != 0:
            summary[f"speedup_{name}"] = round(line["s_per_step"] / sync["s_per_step"], 4)
    if sync is not None:
        summary["gain_sync_seeds"] = sync["gain_seeds"]
    summary["workload"] = args.workload
    summary["host"] = compact_host_facts()
    summary["note"] = "taken on a machine shared with other jobs: timings are noisy"
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
