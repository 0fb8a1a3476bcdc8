"""A Hugging Face TRL GRPO script run on tiller: the TRL code below is unchanged except its import
(`from tiller.trl import ...` for `from trl import ...`).

    python examples/trl_grpo.py [--out runs/trl_grpo] [--steps 12]

The model is a ~1M-parameter Qwen2 built by tiller's tiny-model kit (no hub); the task: write digits. Each row
has a `weight` column and the reward function reads it (TRL passes every dataset column to reward functions):
reward = weight x the fraction of digits in the completion. An untrained model writes almost none; a dozen
GRPO steps raise the reward. Prints one JSON line: the reward of the first and last three steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from datasets import Dataset

from tiller.models.tiny import make_tiny_model
from tiller.trl import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer


def digit_reward(completions, weight, **kwargs):
    """weight x the fraction of digits in each completion (`weight`: a dataset column)."""
    return [w * sum(ch.isdigit() for ch in c) / max(len(c), 1) for c, w in zip(completions, weight)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/trl_grpo")
    parser.add_argument("--steps", type=int, default=12)
    opts = parser.parse_args(argv)
    out = Path(opts.out)
    model_dir = out / "tiny_model"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, n_params=1_000_000)

    # ---- the TRL script
    dataset = Dataset.from_list([{"prompt": f"Question {i}: count to {i % 7 + 2}.", "weight": 1.0 + (i % 2)}
                                 for i in range(32)])
    args = GRPOConfig(
        output_dir=str(out / "run"), num_generations=8, per_device_train_batch_size=32, max_completion_length=6,
        learning_rate=1e-2, max_steps=opts.steps, bf16=False, log_completions=True, seed=0,
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=digit_reward, args=args, train_dataset=dataset)
    trainer.train()
    trainer.save_model()
    # ----

    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    result = {"first3": sum(rewards[:3]) / 3, "last3": sum(rewards[-3:]) / 3, "steps": trainer.state.global_step}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
