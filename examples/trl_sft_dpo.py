"""A TRL script on tiller: SFT, then DPO from the SFT model, then a reward model, with the import changed only
(`from trl import ...` -> `from tiller.trl import ...`). Runs on CPU in under a minute with a tiny local model:

    python examples/trl_sft_dpo.py runs/trl_example            # builds a 1M-parameter model to start from
    python examples/trl_sft_dpo.py runs/trl_example path/to/model

Each trainer writes a tiller run dir (config.yaml, metrics.jsonl, checkpoints/, data/) under the output dir; the
`tiller sft|dpo|rm` command with the same keys gives the same run (docs/trl.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

from datasets import Dataset

from tiller.trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer

SUMS = [(1, 2), (3, 4), (5, 1), (2, 7), (8, 1), (4, 4), (6, 3), (9, 0)]


def main(out: str, model: str | None = None) -> dict[str, float]:
    out_dir = Path(out)
    if model is None:
        from tiller.models.tiny import make_tiny_model

        model = str(make_tiny_model(out_dir / "tiny", n_params=1_000_000, seed=0))
    common = dict(bf16=False, gradient_checkpointing=False, report_to="none", per_device_train_batch_size=4,
                  lr_scheduler_type="constant")

    # 1. SFT on conversational prompt-completion rows (loss on the completions)
    sft_data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                                   "completion": [{"role": "assistant", "content": str(a + b)}]} for a, b in SUMS])
    sft = SFTTrainer(model=model, train_dataset=sft_data,
                     args=SFTConfig(output_dir=str(out_dir / "sft"), learning_rate=3e-3, num_train_epochs=5, **common))
    sft.train()
    sft.save_model()  # a Hugging Face model dir: the DPO run starts from it

    # 2. DPO: the right sum preferred to the sum plus one (implicit prompt: whole conversations)
    pairs = Dataset.from_list([{
        "chosen": [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}],
        "rejected": [{"role": "user", "content": f"What is {a} + {b}?"},
                     {"role": "assistant", "content": str(a + b + 1)}]} for a, b in SUMS])
    dpo = DPOTrainer(model=str(out_dir / "sft"), train_dataset=pairs, eval_dataset=pairs,
                     args=DPOConfig(output_dir=str(out_dir / "dpo"), learning_rate=1e-3, num_train_epochs=3, **common))
    dpo.train()
    dpo.save_model()

    # 3. A reward model on the same pairs (a sequence-classification model `tiller rl` scores with)
    rm = RewardTrainer(model=model, train_dataset=pairs, eval_dataset=pairs,
                       args=RewardConfig(output_dir=str(out_dir / "rm"), num_train_epochs=6, **common))
    rm.train()
    rm.save_model()

    result = {"sft_loss_first": sft.state.log_history[0]["loss"], "sft_loss_last": sft.state.log_history[-1]["loss"],
              "dpo_eval_margin": dpo.evaluate()["eval_rewards_margins"],
              "rm_eval_accuracy": rm.evaluate()["eval_accuracy"], "rm_eval_margin": rm.evaluate()["eval_margin"]}
    print(" ".join(f"{k}={v:.4f}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    main(*sys.argv[1:3])
