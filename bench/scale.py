"""Seconds per GRPO step: one process (backend=local) vs a Ray group of 2 workers, at equal compute.

Equal compute on a 2-core box: the local run gives its in-process worker 2 torch threads; the Ray run
gives each of its 2 workers 1 CPU and 1 thread (the driver itself does only prompt sampling, rewards and
advantages). On a busy box 2 threads can be slower than 1, so the local run is also timed with 1 thread
and `local_s_per_step` is the faster of the two (the stricter baseline for `ray_over_local`). Both run the same real driver (`tiller.trainer.rl.RLTrainer`) on a tiny Qwen2 built with
the tiny-model kit and the built-in arithmetic task; start-up (Ray, actors, model load) is excluded,
the first `--warmup` steps are dropped, and the rest are timed by the driver's own `timing_s/step`.
Runs alternate local / ray `--repeats` times and the best mean of each is kept (neighbours on a shared
box only ever slow a run down).

Prints one JSON line: local_s_per_step, ray_s_per_step, ray_over_local, ray_peak_rss_mb (driver +
workers, peak resident set), ray_system_rss_mb (Ray's own daemons at the end), the setup, and
"host" (`tiller.hostinfo.compact_host_facts()`: CPU kind, threads, GEMM rates, bf16 decision, versions).

    python bench/scale.py                    # ~2-4 minutes on 2 cores
    python bench/scale.py --n-params 4000000 --steps 6
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path


def _config(run_dir: Path, model: Path, data: Path, args, *extra: str):
    from tiller.config import load_config

    return load_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files=[{data / 'train.parquet'}]",
        f"data.train_batch_size={args.prompts}", "data.max_prompt_length=32",
        f"data.max_response_length={args.response_length}", f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
        "actor_rollout_ref.rollout.dtype=float32", "algorithm.adv_estimator=grpo",
        f"trainer.total_training_steps={args.warmup + args.steps}", "trainer.val_before_train=false",
        "trainer.save_freq=-1", "trainer.logger=[jsonl]", "trainer.resume_mode=disable", "trainer.progress=false",
        f"trainer.default_local_dir={run_dir}", *extra,
    ])


def _timed_run(cfg, warmup: int) -> tuple[float, object]:
    """Mean `timing_s/step` after `warmup` steps; returns (s_per_step, trainer) with workers still up."""
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(cfg)
    steps: list[float] = []
    step = trainer.train_step

    def timed():
        m = step()
        steps.append(m["timing_s/step"])
        return m

    trainer.train_step = timed
    trainer.fit()
    return statistics.mean(steps[warmup:]), trainer


def _ray_system_rss_mb() -> float:
    try:
        import psutil
    except ImportError:
        return float("nan")
    names = ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "ray::")
    total = 0
    for proc in psutil.process_iter(["name", "cmdline", "memory_info"]):
        text = " ".join([proc.info["name"] or "", *(proc.info["cmdline"] or [])[:3]])
        if any(n in text for n in names) and "_WorkerHost" not in text and proc.info["memory_info"]:
            total += proc.info["memory_info"].rss
    return total / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-params", type=int, default=2_000_000, help="tiny Qwen2 size")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (data.train_batch_size)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (rollout.n)")
    ap.add_argument("--response-length", type=int, default=24)
    ap.add_argument("--micro", type=int, default=16, help="ppo_micro_batch_size_per_gpu")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps per run")
    ap.add_argument("--repeats", type=int, default=2, help="alternating local/ray runs; best of each kept")
    ap.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"], help="Ray run's parallel strategy")
    args = ap.parse_args()

    import ray
    import torch

    from tiller.hostinfo import compact_host_facts
    from tiller.models.tiny import make_tiny_model
    from tiller.tasks import arithmetic

    host = compact_host_facts()  # before Ray starts: the GEMM rates of a quiet host
    root = Path(tempfile.mkdtemp(prefix="tiller_scale_"))
    model = make_tiny_model(root / "model", arch="qwen2", n_params=args.n_params, seed=0)
    arithmetic.write_task(root / "data", n_train=512, n_test=8, seed=0)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    local_times: dict[int, list[float]] = {2: [], 1: []}
    ray_times, worker_peaks = [], []
    for r in range(args.repeats):
        for threads in (2, 1):
            torch.set_num_threads(threads)
            s, trainer = _timed_run(_config(root / f"local{r}_{threads}", model, root / "data", args,
                                            f"trainer.num_threads={threads}"), args.warmup)
            trainer.shutdown()
            local_times[threads].append(s)
        torch.set_num_threads(1)
        s, trainer = _timed_run(_config(root / f"ray{r}", model, root / "data", args, "trainer.num_threads=1",
                                        "trainer.backend=ray", "trainer.nnodes=1", "trainer.n_gpus_per_node=2",
                                        "trainer.cpus_per_worker=1",
                                        f"actor_rollout_ref.actor.strategy={args.strategy}"), args.warmup)
        worker_peaks.append(sum(trainer.actor.peak_rss_mb()))
        trainer.shutdown()
        ray_times.append(s)
    system_rss = _ray_system_rss_mb()
    ray.shutdown()
    driver_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    local2, local1, ray_s = min(local_times[2]), min(local_times[1]), min(ray_times)
    local_s = min(local2, local1)  # the faster one-process setting: the stricter comparison
    print(json.dumps({
        "local_s_per_step": round(local_s, 4), "ray_s_per_step": round(ray_s, 4),
        "ray_over_local": round(ray_s / local_s, 3),
        "local_2threads_s_per_step": round(local2, 4), "local_1thread_s_per_step": round(local1, 4),
        "ray_over_local_2threads": round(ray_s / local2, 3),
        "ray_peak_rss_mb": round(driver_peak + max(worker_peaks), 1),
        "ray_workers_peak_rss_mb": round(max(worker_peaks), 1), "ray_system_rss_mb": round(system_rss, 1),
        "local_runs_s_per_step": {f"{k}threads": [round(x, 4) for x in v] for k, v in local_times.items()},
        "ray_runs_s_per_step": [round(x, 4) for x in ray_times],
        "setup": {"n_params": args.n_params, "prompts": args.prompts, "n": args.n,
                  "response_length": args.response_length, "steps": args.steps, "strategy": args.strategy,
                  "local": "1 process, best of 2 threads / 1 thread", "ray": "2 workers x 1 CPU x 1 thread"},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": host,
    }))


if __name__ == "__main__":
    main()
