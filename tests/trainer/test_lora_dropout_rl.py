"""LoRA dropout on the RL actor and critic (`actor_rollout_ref.model.lora_dropout`, `critic.model.lora_dropout`;
TRL's `peft_config.lora_dropout` / `--lora_dropout`, 0.05 by default, and OpenRLHF's `--lora_dropout` map there).

peft's dropout acts on the adapters' input in train mode only. The workers run their updates in train mode and
compute the old / reference logprobs and the critic's values in eval mode, and the rollout runs merged weights: so
only the updates' forwards are random, as in TRL (whose train-mode model applies it in the loss forward) and
OpenRLHF."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.test_rl import make_cfg, rl_data  # noqa: F401 (rl_data: a fixture)
from tiller.errors import ConfigError

LORA = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.lora_dropout=0.5", "algorithm.adv_estimator=gae", "critic.model.lora_rank=4",
        "critic.model.lora_alpha=8", "critic.model.lora_dropout=0.5", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.actor.optim.lr=1e-2", "critic.optim.lr=1e-2", "data.val_files=[]",
        # two epochs: the old logprobs are a forward of their own (eval mode), not the update's detached ones
        "actor_rollout_ref.actor.ppo_epochs=2")


def _dropouts(module) -> set[float]:
    return {m.p for n, m in module.named_modules() if n.endswith("lora_dropout.default")}


def test_dropout_acts_in_the_updates_only(tiny_model_dir, rl_data, tmp_path):  # noqa: F811
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(make_cfg(tmp_path / "run", tiny_model_dir, rl_data, *LORA))
    try:
        trainer.fit()
        actor, critic = trainer.actor.worker.module, trainer.critic.worker.module
        assert _dropouts(actor) == {0.5} and _dropouts(critic) == {0.5}
        ids = torch.randint(5, 400, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            for module in (actor, critic):  # the adapters trained (B != 0): dropout now changes the output
                was = module.training
                module.eval()
                a, b = module(input_ids=ids).logits, module(input_ids=ids).logits
                assert torch.equal(a, b)
                module.train()
                c, d = module(input_ids=ids).logits, module(input_ids=ids).logits
                assert not torch.equal(c, d) and (c - a).abs().max() > 1e-4
                module.train(was)
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["training/rollout_probs_diff_max"] for r in rows if "training/rollout_probs_diff_max" in r]
    # the old logprobs (eval mode) equal the rollout's (merged weights, fp32): the dropout is not in them
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps


@pytest.mark.parametrize("value,match", [(1.0, r"lora_dropout must be a number in \[0, 1\)"),
                                         (-0.1, r"lora_dropout must be a number in \[0, 1\)"),
                                         ("x", r"lora_dropout = 'x' is not a valid float")])
def test_bad_dropout_is_refused_by_key(tiny_model_dir, rl_data, tmp_path, value, match):  # noqa: F811
    with pytest.raises(ConfigError, match=f"actor_rollout_ref.model.{match}"):  # (a type error: the loader's)
        make_cfg(tmp_path / "run", tiny_model_dir, rl_data, "actor_rollout_ref.model.lora_rank=4",
                 f"actor_rollout_ref.model.lora_dropout={value}")
    with pytest.raises(ConfigError, match=r"critic.model.lora_dropout=0.1 needs LoRA"):
        make_cfg(tmp_path / "run", tiny_model_dir, rl_data, "algorithm.adv_estimator=gae",
                 "critic.model.lora_dropout=0.1")
