"""tiller vs TRL's GRPOTrainer: seconds per GRPO step at equal settings, in one invocation.

Both trainers get the same ~30M-parameter Qwen2 (tiny-model kit, random init, saved to a temp dir and
loaded with `from_pretrained`), the same prompts (chat template; `--task arithmetic`: two-digit sums,
~14 tokens; `--task gsm8k`: GSM8K questions with verl's instruction, ~100-300 tokens with the kit's
512-token vocabulary, none cut), the same reward (tiller's scorer for the data source), `n` samples per
prompt, max completion length, temperature 1.0, beta (KL coefficient; 0 = no reference model), one PPO
epoch (`num_iterations`), token-mean loss ("dapo" in TRL), group-std-scaled advantages, AdamW at the same
lr, fp32 training, the same torch threads. Engines and process settings are each trainer's defaults on
CPU: tiller's `native` rollout, shared-prompt forward and malloc tuning; TRL's `model.generate`. Each
trainer runs in its own subprocess (so threads, allocator settings and caches do not carry over);
steps 1..warmup are not timed.

    python bench/grpo_vs_trl.py --quick             # 2M model, 4 prompts x 4, 8 tokens, 2 steps: does it run?
    python bench/grpo_vs_trl.py [--task arithmetic|gsm8k] [--steps 4] [--prompts 8] [--n 8] [--max-new 32]
                                [--params 30e6 | --shape 0.5B] [--threads 2] [--tiller-opt KEY=VALUE ...]
    python bench/grpo_vs_trl.py --device cuda --shape 0.5B --dtype bfloat16 --prompts 16 --n 8 --max-new 256

On `--device cuda` both trainers run on the GPU (TRL: `use_cpu=False`); tiller with its GPU settings
(`rollout.enforce_eager=false`: CUDA graphs of the compiled decode step; `model.use_remove_padding=true`: the
packed update; `actor.use_torch_compile=true`: its decoder layers compiled), which `--tiller-opt` can override,
and the update's `perf/mfu/actor` (verl's formula) is reported as `tiller_mfu`. `--shape 0.5B` is Qwen2.5-0.5B's
body with the kit's 512-token vocabulary (`bench/rollout.py`'s SIZES, shared/GPU.md's shape).

Prints one JSON line: {"tiller_s_per_step", "trl_s_per_step", "speedup" (= trl / tiller), the same three
over process CPU seconds ("*_cpu_s_per_step", "cpu_speedup"), tiller's phases ("tiller_gen_s",
"tiller_update_actor_s"), settings..., "host": `tiller.hostinfo.compact_host_facts()`}. On a shared machine
the two halves can see different load; with --threads 1 the CPU-second ratio is the robust one. Needs
`pip install trl` (check it keeps your torch).

Measured (2026-11, shared 2-core AMD EPYC without AVX-512, so everything runs in fp32; TRL 1.16, --threads 1,
--steps 3, 2 timed steps):

    task        prompts x n  new tokens  tiller s/step (gen + update)  TRL s/step  speedup
    arithmetic  8 x 8        32          9.67 (2.88 + 6.79)            13.58       1.40
    gsm8k       4 x 8        64          17.32 (5.74 + 11.57)          63.05       3.64

Where the gap comes from: both updates are fp32 GEMM-bound (~65 GFLOP/s on one core), so what counts is
the work. tiller runs each group's prompt once in the update (its KV cache expanded to the n samples;
`actor.share_prompt_forward`, exact) and in the rollout (one prefill per prompt), computes the LM head on
response positions only, and keeps freed pages mapped between steps (`trainer.tune_cpu_malloc`, ~15% of an
update here). With 14-token prompts that saves ~30% of the update; with GSM8K-length prompts, where the
prompt is most of every sequence, most of it. Before these (same machine, arithmetic): 0.81-0.88.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout import SIZES, build_sized  # noqa: E402  (bench/rollout.py: the model shapes)

GPU_OPTS = ["actor_rollout_ref.rollout.enforce_eager=false", "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.actor.use_torch_compile=true"]
"""tiller's settings on `--device cuda`: graphed + compiled decode, the packed update with compiled decoder layers
(before --tiller-opt)."""


def build_inputs(root: Path, args) -> tuple[Path, Path]:
    from tiller.models.tiny import make_tiny_model

    model_dir = root / "model"
    if args.shape:
        build_sized(model_dir, SIZES[args.shape])
    elif not model_dir.exists():
        make_tiny_model(model_dir, arch="qwen2", n_params=int(args.params), seed=0)
    if not (root / "data" / "train.parquet").exists():
        n_rows = args.prompts * (args.steps + 2)
        if args.task == "gsm8k":
            from tiller.data.preprocess import gsm8k

            gsm8k.convert(args.gsm8k_src, root / "data", max_rows=n_rows)
        else:
            from tiller.tasks import arithmetic

            arithmetic.write_task(root / "data", n_train=n_rows, n_test=8, seed=0)
    return model_dir, root / "data"


def count_params(model_dir: Path) -> int:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def run_tiller(model_dir: Path, data_dir: Path, root: Path, args, phases: dict) -> tuple[list[float], list[float]]:
    from tiller.config import load_config
    from tiller.trainer.rl import RLTrainer

    cfg = load_config([
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{data_dir / 'train.parquet'}]",
        f"data.train_batch_size={args.prompts}", f"data.max_prompt_length={args.max_prompt}",
        f"data.max_response_length={args.max_new}", "data.shuffle=false",
        "algorithm.adv_estimator=grpo", f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.temperature=1.0", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.prompts * args.n}",
        "actor_rollout_ref.actor.ppo_epochs=1", f"actor_rollout_ref.actor.optim.lr={args.lr}",
        f"actor_rollout_ref.actor.use_kl_loss={'true' if args.beta > 0 else 'false'}",
        f"actor_rollout_ref.actor.kl_loss_coef={args.beta}", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean", f"actor_rollout_ref.actor.dtype={args.dtype}",
        f"trainer.total_training_steps={args.steps}", "trainer.logger=[jsonl]", "trainer.resume_mode=disable",
        "trainer.val_before_train=false", f"trainer.default_local_dir={root / 'tiller_run'}",
        f"trainer.device={args.device}", *(GPU_OPTS if args.device == "cuda" else []), *args.tiller_opt,
    ])
    trainer = RLTrainer(cfg)
    params = count_params(model_dir)
    times, cpu = [], []
    try:
        for step in range(1, args.steps + 1):
            trainer.global_step = step
            t0, c0 = time.perf_counter(), time.process_time()
            if args.profile and step == args.steps:  # the last step under torch.profiler (counted: `profiled`)
                m = profiled_step(trainer, Path(args.profile), args.device)
            else:
                m = trainer.train_step()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            if step > args.warmup:
                for phase in ("gen", "update_actor"):
                    phases.setdefault(phase, []).append(m[f"timing_s/{phase}"])
                # the update's work: forward + backward = 6 x params x tokens, each group's prompt run once
                # (share_prompt_forward) plus every response token
                tokens = args.prompts * m["prompt_length/mean"] + args.prompts * args.n * m["response_length/mean"]
                phases.setdefault("update_gflops", []).append(6 * params * tokens / m["timing_s/update_actor"] / 1e9)
                if "perf/mfu/actor" in m:  # verl's formula against the device's peak (CUDA only)
                    phases.setdefault("mfu", []).append(m["perf/mfu/actor"])
        compiled = getattr(getattr(trainer.actor, "worker", None), "compiled", None)
        if compiled is not None:  # actor.use_torch_compile: a compile that failed ran the layers eagerly
            phases["compile_error"] = compiled.error
    finally:
        trainer.shutdown()
    return times, cpu


def profiled_step(trainer, out: Path, device: str) -> dict:
    """One `train_step` under torch.profiler: torch's tables by device time and by host time in `out`, and a
    summary (`update_profile.json`: device busy seconds, kernels, host syncs) beside them."""
    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        m = trainer.train_step()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    if device == "cuda":
        (out / "step_by_device_time.txt").write_text(events.table(sort_by="self_cuda_time_total", row_limit=50,
                                                                  max_name_column_width=90))
    (out / "step_by_host_time.txt").write_text(events.table(sort_by="self_cpu_time_total", row_limit=50,
                                                            max_name_column_width=90))
    dev = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    by_name = {e.key: e for e in events}
    summary = {"timing_s": {k[len("timing_s/"):]: round(v, 4) for k, v in m.items() if k.startswith("timing_s/")},
               "device_busy_s": round(sum(e.self_device_time_total for e in dev) / 1e6, 4),
               "kernels": sum(e.count for e in dev),
               "host_syncs": sum(by_name[n].count for n in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                            "cudaEventSynchronize") if n in by_name)}
    (out / "update_profile.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({"profile": summary}), file=sys.stderr)
    return m


def run_trl(model_dir: Path, data_dir: Path, root: Path, args, phases: dict) -> tuple[list[float], list[float]]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tiller.data.rl_dataset import read_rows
    from tiller.rewards import default_compute_score

    rows = read_rows(data_dir / "train.parquet")
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
                                 for r in rows])

    source = rows[0]["data_source"]

    def reward(prompts, completions, ground_truth, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(default_compute_score(source, t, g)) for t, g in zip(texts, ground_truth)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.cpu, self._t, self._c = [], [], 0.0, 0.0

        def on_step_begin(self, *a, **k):
            self._t, self._c = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self._t)
            self.cpu.append(time.process_time() - self._c)

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(root / "trl_run"), per_device_train_batch_size=args.prompts * args.n,
        num_generations=args.n, max_completion_length=args.max_new, beta=args.beta, num_iterations=1,
        learning_rate=args.lr, max_steps=args.steps, temperature=1.0, loss_type="dapo", scale_rewards="group",
        use_cpu=args.device == "cpu", bf16=args.dtype == "bfloat16", report_to=[], save_strategy="no", logging_steps=1, shuffle_dataset=False,
        gradient_accumulation_steps=1, dataloader_num_workers=0, seed=0, disable_tqdm=True,
        lr_scheduler_type="constant", gradient_checkpointing=False,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    return timer.times, timer.cpu


def measure(name: str, root: Path, args) -> dict[str, float]:
    """Time one trainer in this process: {name_s_per_step, name_cpu_s_per_step, name_<phase>_s}."""
    torch.set_num_threads(args.threads)
    model_dir, data_dir = build_inputs(root, args)
    phases: dict[str, list[float]] = {}
    t, cpu = {"tiller": run_tiller, "trl": run_trl}[name](model_dir, data_dir, root, args, phases)
    out = {f"{name}_s_per_step": statistics.mean(t[args.warmup:]),
           f"{name}_cpu_s_per_step": statistics.mean(cpu[args.warmup:])}
    error = phases.pop("compile_error", False)
    out.update({f"{name}_{k}_s": statistics.mean(v) for k, v in phases.items()})
    if error is not False:  # actor.use_torch_compile ran: null, or why the layers ran eagerly
        out[f"{name}_compile_error"] = error
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--task", choices=["arithmetic", "gsm8k"], default="arithmetic",
                   help="arithmetic (~14-token prompts) or GSM8K questions (~100-300 tokens with the kit's 512-token vocabulary)")
    p.add_argument("--gsm8k-src", default=None, help="dir with GSM8K train/test.jsonl (default: openai/gsm8k through `datasets`, as tiller data gsm8k)")
    p.add_argument("--max-prompt", type=int, default=None, help="max prompt tokens (default 32; gsm8k 512: no GSM8K prompt is cut)")
    p.add_argument("--params", type=float, default=30e6)
    p.add_argument("--shape", choices=sorted(SIZES), default=None,
                   help="a bench/rollout.py model shape instead of --params (0.5B: shared/GPU.md's GPU shape)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: both trainers on the GPU, tiller with its GPU settings (graphs, packed update)")
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="training compute dtype: tiller's actor.dtype, TRL's bf16 (both autocast, fp32 master weights)")
    p.add_argument("--only", choices=["tiller", "trl"], default=None,
                   help="time one trainer in this process (default: each in its own subprocess)")
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)  # shared model/data of the subprocesses
    p.add_argument("--tiller-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="extra tiller config override (repeatable), e.g. actor_rollout_ref.actor.share_prompt_forward=false")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile tiller's last step (torch.profiler tables and a summary in DIR; with --only tiller)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 2M model, 4 prompts x n=4, 8 new tokens, 2 steps (1 timed); not a measurement")
    args = p.parse_args(argv)
    if args.quick:
        args.params, args.prompts, args.n, args.max_new, args.steps, args.warmup = 2e6, 4, 4, 8, 2, 1
    import importlib.util

    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None] if args.only != "tiller" else []
    if missing:  # one line naming the extra, not a traceback halfway through
        print(f"bench/grpo_vs_trl.py needs {' and '.join(missing)}: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    if args.max_prompt is None:
        args.max_prompt = 512 if args.task == "gsm8k" else 32
    result = {"quick": args.quick, "task": args.task, "model_params": args.params, "prompts": args.prompts, "n": args.n,
              "max_new_tokens": args.max_new, "beta": args.beta, "steps_timed": args.steps - args.warmup,
              "threads": args.threads, "dtype": args.dtype, "device": args.device, "shape": args.shape}
    if args.profile:  # the last timed step ran under the profiler: its overhead is in the times, not a measurement
        result["profiled"] = True
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("bench/grpo_vs_trl.py --device cuda: torch sees no CUDA device", file=sys.stderr)
            return 2
        result["gpu"] = torch.cuda.get_device_name()
        result["torch"] = torch.__version__
        result["tiller_gpu_opts"] = GPU_OPTS
    with tempfile.TemporaryDirectory(prefix="tiller-bench-") as tmp:
        root = Path(args.workdir or tmp)
        if args.only:
            result.update(measure(args.only, root, args))
        else:  # separate processes: threads, allocator settings and caches do not carry from one to the other
            result["model_params"] = count_params(build_inputs(root, args)[0])
            own = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--quick"]
            own += ["--params", str(args.params), "--prompts", str(args.prompts), "--n", str(args.n),
                    "--max-new", str(args.max_new), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            for name in ("tiller", "trl"):
                proc = subprocess.run([sys.executable, __file__, *own, "--only", name, "--workdir", str(root)],
                                      check=True, stdout=subprocess.PIPE, text=True)
                result.update({k: v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()
                               if k.startswith(name)})
            result["speedup"] = result["trl_s_per_step"] / result["tiller_s_per_step"]
            result["cpu_speedup"] = result["trl_cpu_s_per_step"] / result["tiller_cpu_s_per_step"]
    torch.set_num_threads(args.threads)  # the host facts at the threads both trainers ran with
    from tiller.hostinfo import compact_host_facts

    result["host"] = compact_host_facts()
    if "tiller_mfu_s" in result:  # (a mean over the timed steps, not seconds)
        result["tiller_mfu"] = round(result.pop("tiller_mfu_s"), 4)
    if "tiller_update_gflops_s" in result:  # the update's achieved rate against the same-dtype GEMM peak
        result["tiller_update_gflops"] = result.pop("tiller_update_gflops_s")
        peak = result["host"].get("gemm_bf16_gflops" if args.dtype == "bfloat16" else "gemm_fp32_gflops")
        if peak and args.device == "cpu":
            result["tiller_update_pct_of_peak"] = round(100 * result["tiller_update_gflops"] / peak, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
