"""actor_rollout_ref.model.lm_head_fp32 (TRL's cast_lm_head_to_fp32, ScaleRL): the LM head's matmul and logits in
float32 under bf16 autocast, for the policy and its reference copy."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.trainer.test_rl import make_cfg, rl_data  # noqa: F401 (rl_data: the fixture)
from tiller.errors import ConfigError
from tiller.models.loading import load_causal_lm
from tiller.workers.common import Float32Head, fp32_lm_head


def test_the_head_computes_in_float32_under_bf16_autocast(tiny_model_dir):
    plain = load_causal_lm(tiny_model_dir)
    model = copy.deepcopy(plain)
    fp32_lm_head(model, "actor_rollout_ref.model.lm_head_fp32")
    assert set(model.state_dict()) == set(plain.state_dict())  # the same parameters, saved under the same keys
    ids = torch.tensor([[3, 17, 42, 9, 28, 5]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.model(input_ids=ids).last_hidden_state  # the final norm's output
        got = model(input_ids=ids).logits
        rounded = plain(input_ids=ids).logits
    assert got.dtype == torch.float32 and rounded.dtype == torch.bfloat16  # autocast: the plain head's matmul in bf16
    want = torch.nn.functional.linear(hidden.float(), plain.lm_head.weight)  # the fp32 matmul
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (rounded.float() - want).abs().max() > 1e-3  # what the option removes: the logits' bf16 rounding
    ref = copy.deepcopy(model)  # the reference is a copy of the policy: its head too
    assert type(ref.lm_head) is Float32Head and ref.lm_head.weight is not model.lm_head.weight
    with torch.no_grad():  # outside autocast nothing changes
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, atol=0, rtol=0)


def test_a_head_that_is_no_plain_linear_is_refused(tiny_model_dir):
    from tiller.models.lora import apply_lora

    peft_model = apply_lora(load_causal_lm(tiny_model_dir), 4, 8, ["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.lm_head_fp32=True: the model's LM head is a "
                                          "ModulesToSaveWrapper"):
        fp32_lm_head(peft_model.get_base_model(), "actor_rollout_ref.model.lm_head_fp32")


def test_the_rl_actor_and_its_reference_run_float32_heads(tmp_path, tiny_model_dir, rl_data, monkeypatch):  # noqa: F811
    from tiller import hostinfo
    from tiller.trainer.rl import RLTrainer

    # bf16 autocast on, whatever this CPU's timing says (the option only matters under bf16)
    monkeypatch.setattr(hostinfo, "_DECISION", hostinfo.Bf16Decision(True, "test: bf16 compute on"))
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, rl_data, "actor_rollout_ref.model.lm_head_fp32=true",
                   "actor_rollout_ref.actor.dtype=bfloat16", "actor_rollout_ref.actor.use_kl_loss=true",
                   "trainer.total_training_steps=1", "data.val_files=[]")
    trainer = RLTrainer(cfg)
    try:
        worker = trainer.actor.worker
        assert type(worker.module.lm_head) is Float32Head and type(worker.ref_module.lm_head) is Float32Head
        metrics = trainer.fit()
    finally:
        trainer.shutdown()
    assert metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == reference, head and all
    assert all(torch.isfinite(torch.tensor(metrics[k])) for k in ("actor/pg_loss", "actor/grad_norm"))
