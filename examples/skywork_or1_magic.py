"""Skywork-OR1's MAGIC recipe end to end at tiny scale, on a CPU: offline difficulty filtering, then the
`skywork_or1` preset in two stages of response length, the second resumed from the first's checkpoint.

    python examples/skywork_or1_magic.py [--out runs/magic] [--seed 0] [--stage1-steps 40] [--stage2-steps 40] \\
        [key=value ...]

1. Starter model: the demo's (`tiller demo`, cached under ~/.cache/tiller/demo or $TILLER_CACHE/demo): a ~2M
   parameter Qwen2 given a supervised warm-up on two-digit addition (`tiller.tasks.arithmetic`) until greedy dev
   accuracy reaches 0.4, so it solves some prompts and not others.
2. Offline difficulty filtering (`tiller data filter-difficulty`, Skywork-OR1's offline filter): k = 8 samples per
   training prompt at temperature 1.0; prompts the starter always or never solves are dropped (band 0.1:0.9).
3. RL with `--preset skywork_or1` (GRPO, no KL, token-mean loss, adaptive entropy control with target 0.2,
   temperature 1.0, online filtering of zero-advantage groups, one on-policy update per batch) and a two-stage
   response-length schedule: stage 1 samples at most 3 tokens (a three-digit sum fits, its end-of-answer token does
   not), stage 2 at most 6. Stage 1 runs `--stage1-steps` steps and stops (a checkpoint); stage 2 is a second
   `RLTrainer` on the same run dir that resumes from it (`trainer.resume_mode=auto`) and samples with the longer
   limit from the boundary on (`response_length/limit` in metrics.jsonl).
   Tiny-scale departures from the preset, all overrides below: 32 prompts x n = 8 per step (paper 256 x 16),
   lr 1e-4 with a 10-step warmup (paper 1e-6: a 2M model needs more), 3 / 6 tokens (paper 8K / 16K / 32K),
   greedy held-out accuracy on 256 unseen prompts (the preset: sampled avg@8 at temperature 0.6).

Prints held-out accuracy before RL, after stage 1 and after stage 2, the stage limits seen in metrics.jsonl,
and one JSON line with all of it.
Measured (shared 2-core AMD EPYC, 1 thread, seed 0, 40 + 40 steps): see the README's Recipes section.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

STAGE1_LEN, STAGE2_LEN = 3, 6


def magic_overrides(model_dir: Path, data_dir: Path, run_dir: Path, args, total_steps: int, resume: str) -> list[str]:
    """The tiny-scale overrides on top of `--preset skywork_or1` (see the module docstring for each departure)."""
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files=[{data_dir / 'train_kept.parquet'}]", f"data.val_files=[{data_dir / 'test.parquet'}]",
        "data.max_prompt_length=16", f"data.max_response_length={STAGE2_LEN}", "data.apply_chat_template=false",
        "data.train_batch_size=32", f"data.seed={args.seed}",
        f"actor_rollout_ref.rollout.response_length_schedule=[[0,{STAGE1_LEN}],[{args.stage1_steps + 1},{STAGE2_LEN}]]",
        "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=false", "actor_rollout_ref.rollout.val_kwargs.n=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128",
        "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"trainer.total_training_steps={total_steps}", "trainer.test_freq=-1", "trainer.save_freq=-1",
        f"trainer.resume_mode={resume}", "trainer.val_before_train=true", f"trainer.seed={args.seed}",
        f"trainer.num_threads={args.threads}", f"trainer.default_local_dir={run_dir}", "trainer.logger=[jsonl]",
        "trainer.project_name=tiller", "trainer.experiment_name=skywork_or1_magic",
    ]


def filter_prompts(model_dir: Path, data_dir: Path, args) -> dict:
    """Step 2: `tiller data filter-difficulty` on the training prompts (in process)."""
    from tiller.config import load_config
    from tiller.evaluation.difficulty import filter_difficulty

    cfg = load_config([f"actor_rollout_ref.model.path={model_dir}", "data.max_prompt_length=16",
                       f"data.max_response_length={STAGE2_LEN}", "data.apply_chat_template=false",
                       "actor_rollout_ref.rollout.dtype=float32", f"trainer.seed={args.seed}"])
    return filter_difficulty(cfg, str(data_dir / "train.parquet"), str(data_dir / "train_kept.parquet"), k=8,
                             band=(0.1, 0.9), progress=False)


def run_stage(model_dir: Path, data_dir: Path, run_dir: Path, args, total_steps: int, resume: str,
              overrides: list[str]):
    from tiller.config import load_config
    from tiller.trainer.rl import RLTrainer

    cfg = load_config(magic_overrides(model_dir, data_dir, run_dir, args, total_steps, resume) + overrides,
                      preset="skywork_or1")
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return trainer.val_history


def main(argv: list[str] | None = None) -> dict:
    import torch

    from tiller.tasks import arithmetic
    from tiller.trainer import demo

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/magic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stage1-steps", type=int, default=40)
    p.add_argument("--stage2-steps", type=int, default=40)
    p.add_argument("--train-size", type=int, default=512, help="training prompts before filtering")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="RL config overrides on top of the preset")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    out = Path(args.out).expanduser().resolve()
    starter = demo.starter_model(SimpleNamespace(seed=args.seed, model_params=2_000_000, warmup_target=0.4,
                                                 train_size=4000, rebuild=False))
    data_dir, run_dir = out / "data", out / "run"
    arithmetic.write_task(data_dir, n_train=args.train_size, n_test=256, seed=args.seed)
    t_filter = time.time()
    kept = filter_prompts(starter, data_dir, args)
    t_filter = time.time() - t_filter
    print(f"offline filter: kept {kept['num_kept']} of {kept['num_prompts']} prompts (never solved "
          f"{kept['num_never_solved']}, always solved {kept['num_all_solved']}, k = 8) in {t_filter:.0f} s", flush=True)

    s1 = args.stage1_steps
    hist1 = run_stage(starter, data_dir, run_dir, args, s1, "disable", ["trainer.overwrite=true", *args.overrides])
    hist2 = run_stage(starter, data_dir, run_dir, args, s1 + args.stage2_steps, "auto", list(args.overrides))
    before, after1, after2 = hist1[0][1][demo.VAL_KEY], hist1[-1][1][demo.VAL_KEY], hist2[-1][1][demo.VAL_KEY]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "response_length/limit" in r]
    limits = {r["step"]: r["response_length/limit"] for r in steps}
    stage1 = [r for r in steps if r["step"] <= s1]
    stage2 = [r for r in steps if r["step"] > s1]
    result = {
        "seed": args.seed, "starter_model": str(starter), "filter": {k: kept[k] for k in (
            "num_prompts", "num_kept", "num_never_solved", "num_all_solved")},
        "val_acc_before": before, "val_acc_after_stage1": after1, "val_acc_after_stage2": after2,
        "stage1_steps": s1, "stage2_steps": args.stage2_steps,
        "stage1_limits": sorted(set(limits[r["step"]] for r in stage1)),
        "stage2_limits": sorted(set(limits[r["step"]] for r in stage2)),
        "stage1_response_length_max": max(r["response_length/max"] for r in stage1),
        "stage2_response_length_max": max(r["response_length/max"] for r in stage2),
        "resumed_at_step": min(r["step"] for r in stage2) - 1 if stage2 else None,
        "wall_s": time.time() - t0,
    }
    print(f"held-out accuracy (256 prompts, greedy): before RL {before:.3f} -> after stage 1 ({STAGE1_LEN} tokens, "
          f"{s1} steps) {after1:.3f} -> after stage 2 ({STAGE2_LEN} tokens, resumed, {args.stage2_steps} steps) "
          f"{after2:.3f} in {result['wall_s']:.0f} s")
    print(f"response_length/limit: stage 1 {result['stage1_limits']}, stage 2 {result['stage2_limits']}; longest "
          f"response: stage 1 {result['stage1_response_length_max']:.0f}, stage 2 "
          f"{result['stage2_response_length_max']:.0f} tokens")
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
