"""A TRL GRPO script through `tiller.trl` with `use_vllm=True` (colocate) against the installed vLLM: two steps
complete on the real engine, the rewards are finite, and the rollout logprobs (vLLM's) agree with the actor's as
closely as `tiller rl` with vllm asserts (tests/vllm_lane/test_vllm_rl_real.py)."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from tests.trl_front.test_trl_tools import caller_model_dir, train_caller  # noqa: E402,F401 (a tool-calling policy)


def digits(completions, **kwargs):
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


@pytest.mark.slow  # ~40 s (a vLLM start): the lane's TRL tools test runs TRL's GRPO on vLLM colocate too
def test_trl_grpo_script_on_vllm_colocate(tmp_path, sharp_model_dir):
    from datasets import Dataset

    from tiller.trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_list([{"prompt": f"Question {i}: count to {i % 7 + 2}."} for i in range(8)])
    args = GRPOConfig(output_dir=str(tmp_path / "run"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=6, learning_rate=1e-2, max_steps=2, bf16=False, seed=0,
                      use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1)
    trainer = GRPOTrainer(model=str(sharp_model_dir), reward_funcs=digits, args=args, train_dataset=dataset)
    trainer.train()
    assert trainer.tiller_keys["actor_rollout_ref.rollout.name"] == "vllm"
    assert trainer.tiller_keys["actor_rollout_ref.rollout.gpu_memory_utilization"] == 0.1
    # TRL's default vLLM importance sampling (sequence_mask, clip_max 3) is tiller's rollout correction
    assert trainer.tiller_keys["algorithm.rollout_correction.rollout_is"] == "sequence"
    assert trainer.state.global_step == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(row["reward"]) and math.isfinite(row["rewards/digits/mean"]), row
        # the rollout logprobs are vLLM's; the actor recomputes them in fp32: they agree closely
        assert row["training/rollout_probs_diff_mean"] < 1e-4, row["training/rollout_probs_diff_mean"]
        assert row["training/rollout_actor_probs_pearson_corr"] > 0.9999


def test_trl_tools_on_vllm_colocate(tmp_path, caller_model_dir):  # noqa: F811
    """GRPOTrainer(tools=...) with use_vllm=True: every turn of TRL's tool loop is a vLLM call (the policy, taught to
    call `add`, calls it; vLLM continues after the tool tokens); the model tokens' logprobs are vLLM's and agree with
    the actor's."""
    trainer, seen = train_caller(tmp_path / "run", caller_model_dir, use_vllm=True, vllm_mode="colocate",
                                 vllm_gpu_memory_utilization=0.1)
    assert trainer.tiller_keys["actor_rollout_ref.rollout.name"] == "vllm"
    called = [c for c in seen if len(c) == 3]
    assert len(seen) == 16 and len(called) >= 12, seen
    for c in called:
        assert c[1] == {"role": "tool", "name": "add", "content": "5"} and c[2]["content"] == "Done."
    for row in trainer.state.log_history:
        assert row["tools/call_frequency"] >= 0.75, row
        assert row["training/rollout_probs_diff_mean"] < 1e-4, row["training/rollout_probs_diff_mean"]
