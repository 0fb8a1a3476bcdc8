"""DARLING (diversity-aware RL) against a quality-only run with the same seed, at tiny scale, on a CPU.

    python examples/darling.py [--out runs/darling] [--seed 0] [--steps 60] [key=value ...]

1. Starter model: the demo's (`tiller demo`, cached under ~/.cache/tiller/demo or $TILLER_CACHE/demo): a ~2M
   parameter Qwen2 given a supervised warm-up on two-digit addition (`tiller.tasks.arithmetic`).
2. Two RL runs with `--preset darling` (GRPO without the std normalisation, token-mean loss, n = 8), the same seed,
   data, prompts and steps; they differ only in the reward:
   - quality-only: `reward_model.diversity.fusion=additive reward_model.diversity.weight=0`: the reward is the
     task's score, and the partition is still computed, so `diversity/mean` is measured the same way;
   - DARLING: the preset's reward, quality x diversity (multiplicative fusion), diversity from the n-gram
     partitioner (answers of a few tokens are compared by their words: "85" and "58" are two classes).
3. Compares, over the last half of the steps, `diversity/mean` (the mean diversity of the training samples) and
   `reward_extra/quality/mean` (the task score of the training samples, before fusion), and held-out greedy
   accuracy on 256 unseen prompts at the end.
   Tiny-scale departures from the preset, all overrides below: 32 prompts per step (paper 256), lr 1e-4 with a
   10-step warmup (paper 1e-6), responses of at most 6 tokens (paper 8192).

What to expect on this task: a sum has one right answer, so the right answers of a group are one class and
diversity can only come from wrong answers; multiplicative fusion then rewards a right answer more when fewer of
its group agree with it. The paper's math gains come from diverse solution paths, which 6-token answers do not
have. Prints one JSON line with both runs' numbers.
Measured (shared 2-core AMD EPYC, 1 thread): see the README's Recipes section.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

QUALITY_ONLY = ["reward_model.diversity.fusion=additive", "reward_model.diversity.weight=0.0"]


def darling_overrides(model_dir: Path, data_dir: Path, run_dir: Path, args) -> list[str]:
    """The tiny-scale overrides on top of `--preset darling` (see the module docstring)."""
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files=[{data_dir / 'train.parquet'}]", f"data.val_files=[{data_dir / 'test.parquet'}]",
        "data.max_prompt_length=16", "data.max_response_length=6", "data.apply_chat_template=false",
        "data.train_batch_size=32", f"data.seed={args.seed}",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128",
        "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.resume_mode=disable", "trainer.overwrite=true", "trainer.val_before_train=true",
        f"trainer.seed={args.seed}", f"trainer.num_threads={args.threads}", f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[jsonl]", "trainer.project_name=tiller", f"trainer.experiment_name={run_dir.name}",
    ]


def run(model_dir: Path, data_dir: Path, run_dir: Path, args, extra: list[str]) -> dict:
    """One RL run; returns the late-half means of diversity / quality and the held-out accuracy before / after."""
    from tiller.config import load_config
    from tiller.trainer import demo
    from tiller.trainer.rl import RLTrainer

    cfg = load_config(darling_overrides(model_dir, data_dir, run_dir, args) + extra + list(args.overrides),
                      preset="darling")
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    late = [r for r in rows if "diversity/mean" in r and r["step"] > args.steps // 2]
    early = [r for r in rows if "diversity/mean" in r and r["step"] <= 5]

    def mean(rs, key):
        return sum(r[key] for r in rs) / len(rs)

    return {"diversity_first5": mean(early, "diversity/mean"), "diversity_late": mean(late, "diversity/mean"),
            "quality_first5": mean(early, "reward_extra/quality/mean"),
            "quality_late": mean(late, "reward_extra/quality/mean"),
            "val_acc_before": trainer.val_history[0][1][demo.VAL_KEY],
            "val_acc_after": trainer.val_history[-1][1][demo.VAL_KEY]}


def main(argv: list[str] | None = None) -> dict:
    import torch

    from tiller.tasks import arithmetic
    from tiller.trainer import demo

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/darling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="RL config overrides for both runs")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    out = Path(args.out).expanduser().resolve()
    starter = demo.starter_model(SimpleNamespace(seed=args.seed, model_params=2_000_000, warmup_target=0.4,
                                                 train_size=4000, rebuild=False))
    data_dir = out / "data"
    arithmetic.write_task(data_dir, n_train=4000, n_test=256, seed=args.seed)
    quality = run(starter, data_dir, out / "quality_only", args, QUALITY_ONLY)
    darling = run(starter, data_dir, out / "darling", args, [])
    result = {"seed": args.seed, "steps": args.steps, "quality_only": quality, "darling": darling,
              "diversity_gain": darling["diversity_late"] - quality["diversity_late"],
              "quality_gain": darling["quality_late"] - quality["quality_late"],
              "val_acc_gain": darling["val_acc_after"] - quality["val_acc_after"], "wall_s": time.time() - t0}
    for name, r in (("quality-only", quality), ("DARLING", darling)):
        print(f"{name:>12}: diversity/mean {r['diversity_first5']:.3f} (steps 1-5) -> {r['diversity_late']:.3f} "
              f"(last half); quality {r['quality_first5']:.3f} -> {r['quality_late']:.3f}; held-out accuracy "
              f"{r['val_acc_before']:.3f} -> {r['val_acc_after']:.3f}")
    print(f"DARLING - quality-only (same seed {args.seed}, {args.steps} steps): diversity/mean "
          f"{result['diversity_gain']:+.3f}, training quality {result['quality_gain']:+.3f}, held-out accuracy "
          f"{result['val_acc_gain']:+.3f} ({result['wall_s']:.0f} s)")
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
