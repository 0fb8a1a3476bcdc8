"""tiller.trl.RLOOConfig / RLOOTrainer: fields, translation, TRL 1.16's RLOO math (quoted from
trl/trainer/rloo_trainer.py) against tiller's rloo estimator, KL in reward and loss, and one training step."""

from __future__ import annotations

import json

import pytest
import torch

from tiller.algos.advantages import get_advantage_estimator
from tiller.algos.aggregate import aggregate_loss
from tiller.algos.kl import apply_kl_in_reward
from tiller.algos.policy_losses import get_policy_loss
from tiller.errors import ConfigError
from tiller.trl import RLOOConfig, RLOOTrainer
from tiller.trl.fields import FIELDS

A = "actor_rollout_ref.actor"


def chars(completions, **kwargs):
    return [len(c) / 10 for c in completions]


def test_every_rloo_field_has_a_rule_and_trls_defaults():
    assert set(RLOOConfig.RULES) >= set(FIELDS["RLOOConfig"]) and len(FIELDS["RLOOConfig"]) == 165
    args = RLOOConfig(output_dir="o")
    assert (args.beta, args.num_generations, args.learning_rate, args.generation_batch_size) == (0.05, 2, 1e-6, 8)


def test_translation(tiny_model_dir, tmp_path):
    args = RLOOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=4,
                      reward_clip_range=(-1.0, 2.0), bf16=False)
    keys, notices = RLOOTrainer(str(tiny_model_dir), chars, args=args,
                                train_dataset=[{"prompt": f"q{i}"} for i in range(8)]).translate()
    assert notices == []
    assert keys["algorithm.adv_estimator"] == "rloo" and keys[f"{A}.loss_agg_mode"] == "seq-mean-token-sum"
    assert keys["algorithm.use_kl_in_reward"] is True and keys["algorithm.kl_penalty"] == "kl"
    assert keys["algorithm.kl_ctrl.kl_coef"] == 0.05 and keys[f"{A}.use_kl_loss"] is False
    assert keys["reward_model.clip_range"] == [-1.0, 2.0] and keys["data.train_batch_size"] == 1
    for kw, match in ((dict(num_iterations=2), "^num_iterations=2, steps_per_generation=1: refused"),
                      (dict(normalize_advantages=True), "^normalize_advantages=True: refused")):
        with pytest.raises(ConfigError, match=match):
            RLOOTrainer(str(tiny_model_dir), chars, args=RLOOConfig(output_dir="o", **kw),
                        train_dataset=[{"prompt": "q"}] * 4).translate()


def test_rloo_reward_advantage_and_on_policy_gradient_equal_trls():
    gen = torch.Generator().manual_seed(1)
    b, t, g, beta = 6, 4, 3, 0.05
    mask = torch.ones(b, t)
    for i, n in enumerate([4, 2, 3, 1, 4, 3]):
        mask[i, n:] = 0
    scores = torch.randn(b, generator=gen)
    logp = -torch.rand(b, t, generator=gen) * 2
    ref = logp + 0.2 * torch.randn(b, t, generator=gen)
    # TRL: rewards - beta * sum_t (old - ref); leave-one-out baseline; loss -min(r A, clip(r) A) on the
    # sequence's ratio, mean over sequences; on-policy old = current
    trl_rewards = scores - beta * ((logp - ref) * mask).sum(-1)
    grouped = trl_rewards.view(-1, g)
    trl_adv = (trl_rewards - ((grouped.sum(1, keepdim=True) - grouped) / (g - 1)).view(-1))
    # tiller: score on the last token, KL in reward (k1), rloo estimator
    tokens = torch.zeros(b, t)
    tokens[torch.arange(b), mask.sum(-1).long() - 1] = scores
    rewards, _ = apply_kl_in_reward(tokens, logp, ref, mask, beta, kind="kl")
    adv, _ = get_advantage_estimator("rloo")(rewards, mask, [0, 0, 0, 1, 1, 1], None)
    assert adv[:, 0] == pytest.approx(trl_adv, abs=1e-6)
    ours, theirs = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    ratio = torch.exp((theirs * mask).sum(1) - (logp * mask).sum(1))
    trl_loss = -torch.min(ratio * trl_adv, torch.clamp(ratio, 0.8, 1.2) * trl_adv).mean()
    per_token, _ = get_policy_loss("vanilla")(ours, logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                              clip_ratio_c=1e9)
    aggregate_loss(per_token, mask, "seq-mean-token-sum").backward()
    trl_loss.backward()
    assert torch.allclose(ours.grad, theirs.grad, atol=1e-7)


def test_one_rloo_step_trains_with_the_reference_model(tmp_path, tiny_model_dir):
    args = RLOOConfig(output_dir=str(tmp_path / "run"), num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=5, learning_rate=1e-2, max_steps=1, bf16=False, eval_strategy="steps",
                      eval_steps=1)
    trainer = RLOOTrainer(model=str(tiny_model_dir), reward_funcs=chars, args=args,
                          train_dataset=[{"prompt": f"Question {i}:"} for i in range(8)],
                          eval_dataset=[{"prompt": f"Test {i}:"} for i in range(2)])
    out = trainer.train()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "val-core/trl/acc/mean@4" in row  # eval_dataset validated every eval_steps, num_generations samples
    assert trainer.state.log_history[0]["eval_reward"] == row["val-core/trl/acc/mean@4"]
    assert out.global_step == 1 and "actor/reward_kl_penalty" in row and "timing_s/ref" in row
    assert row["actor/reward_kl_penalty_coeff"] == 0.05
    assert row["rewards/chars/mean"] == pytest.approx(row["critic/score/mean"], abs=1e-6)
