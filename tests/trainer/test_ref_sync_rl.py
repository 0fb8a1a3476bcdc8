"""TR-DPO's reference updates in RL (actor_rollout_ref.ref.ref_model_sync_steps, TRL's sync_ref_model): counted in
actor optimizer steps, ref <- alpha x policy + (1 - alpha) x ref on every N-th; the moving reference and the count
travel with the checkpoint."""

from __future__ import annotations

import pytest
import torch

from tiller.config import load_config
from tiller.errors import ConfigError
from tiller.protocol import Batch


def _worker(model_dir, *extra):
    from tiller.workers.actor import ActorRolloutRefWorker

    cfg = load_config([f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=hf",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.train_batch_size=4",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                       "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.optim.lr=1e-2",
                       "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.ref_model_sync_steps=2",
                       "actor_rollout_ref.ref.ref_model_mixup_alpha=0.25", *extra])
    return ActorRolloutRefWorker(cfg, total_training_steps=2, need_ref=True)


def _batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    prompts, responses = torch.randint(5, 300, (8, 4), generator=g), torch.randint(5, 300, (8, 5), generator=g)
    rmask = torch.ones(8, 5, dtype=torch.long)
    return Batch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                  "attention_mask": torch.ones(8, 9, dtype=torch.long), "response_mask": rmask,
                  "advantages": torch.randn(8, 5, generator=g), "ref_log_prob": -torch.rand(8, 5, generator=g) - 3},
                 meta={"mini_batch_size": 4, "temperature": 1.0})


def _params(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def test_the_reference_follows_every_second_optimizer_step_and_resumes(tiny_model_dir, tmp_path):
    w = _worker(tiny_model_dir)
    start = _params(w.module)
    w.update_actor(_batch())  # 8 samples in mini-batches of 4: two optimizer steps, the 2nd syncs
    pol, ref = _params(w.module), _params(w.ref_module)
    assert any(not torch.equal(pol[k], start[k]) for k in start)
    for k in start:
        torch.testing.assert_close(ref[k], 0.25 * pol[k] + 0.75 * start[k], rtol=0, atol=1e-6)
    assert w._ref_sync.optimizer_steps == 2
    path = w.save_checkpoint(str(tmp_path / "ck"), 1, {"x": 1})
    again = _worker(tiny_model_dir)
    assert again.load_checkpoint(path)["x"] == 1
    assert all(torch.equal(again.ref_module.get_parameter(k), ref[k]) for k in ref)
    assert again._ref_sync.optimizer_steps == 2


def test_refused_with_a_lora_actor_and_noop_without_a_kl(tiny_model_dir):
    with pytest.raises(ConfigError, match="ref_model_sync_steps: refused with LoRA \\(a LoRA actor"):
        load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.model.lora_rank=4",
                     "actor_rollout_ref.ref.ref_model_sync_steps=2"])
    from tiller.config.edge import noop_keys

    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.ref.ref_model_sync_steps=2"])
    assert noop_keys(cfg) == ["actor_rollout_ref.ref.ref_model_sync_steps=2"]  # no KL: no reference to move
