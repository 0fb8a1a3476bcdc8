"""NEFTune (model.neftune_noise_alpha; TRL's neftune_noise_alpha): transformers' uniform noise on the input
embeddings while training, none in eval (validation) or for a LoRA policy's adapter-disabled reference pass."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.sft.conftest import job_overrides
from tiller.config import load_config
from tiller.config.jobs import SFTConfig, validate_job
from tiller.errors import ConfigError
from tiller.models.lora import apply_lora
from tiller.models.neftune import neftune, without_neftune
from tiller.trainer.preference import Reference
from tiller.trainer.sft import train_sft


def test_noise_is_uniform_of_magnitude_alpha_over_sqrt_l_d_in_train_mode_only(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    emb = model.get_input_embeddings()
    ids = torch.randint(5, 200, (3, 11), generator=torch.Generator().manual_seed(0))
    model.train()
    clean = emb(ids).detach()
    mag = 5.0 / math.sqrt(11 * clean.shape[-1])  # alpha / sqrt(L d)
    with neftune(model, 5.0):
        torch.manual_seed(1)
        diff = (emb(ids) - clean).detach()
        assert diff.abs().max() <= mag * (1 + 1e-6) and diff.abs().max() > 0.95 * mag
        assert diff.abs().mean() == pytest.approx(mag / 2, rel=0.05)  # |U(-m, m)| averages m / 2
        with without_neftune(model):
            assert torch.equal(emb(ids), clean) and emb.training is False
        assert emb.training  # restored
        model.eval()
        assert torch.equal(emb(ids), clean)  # eval: no noise
        model.train()
    assert torch.equal(emb(ids), clean)  # off after the block


def test_a_lora_policys_reference_pass_sees_clean_embeddings(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    policy = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 4, 8)
    ids = torch.randint(5, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :4] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    ref = Reference(policy=policy)
    policy.train()
    want, _, _ = ref.token_logps(batch)
    with neftune(policy, 5.0):
        got, _, _ = ref.token_logps(batch)
        noisy = policy(input_ids=ids).logits  # the policy's own training forward is noisy
    assert torch.equal(got, want)
    assert not torch.allclose(noisy, policy(input_ids=ids).logits, atol=1e-4)


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_sft_trains_with_noise_and_validates_without(tiny_model_dir, sft_file, tmp_path):
    # lr ~0: the weights do not move, so validation after step 1 is the start's either way - noise-free - while the
    # training loss (the forward with noisy embeddings) is not the clean one
    losses = {}
    for alpha in (None, 5.0):
        run = tmp_path / str(alpha)
        extra = {"data.val_files": f"[{sft_file}]", "trainer.total_training_steps": 1, "optim.lr": 1e-12}
        if alpha:
            extra["model.neftune_noise_alpha"] = alpha
        cfg = load_config(job_overrides(tiny_model_dir, sft_file, run, **extra), schema=SFTConfig,
                          validate=validate_job)
        train_sft(cfg)
        losses[alpha] = _rows(run)[0]
    assert losses[5.0]["val/loss"] == pytest.approx(losses[None]["val/loss"], abs=1e-6)
    assert abs(losses[5.0]["train/loss"] - losses[None]["train/loss"]) > 1e-3
    with pytest.raises(ConfigError, match="model.neftune_noise_alpha must be > 0"):
        load_config(job_overrides(tiny_model_dir, sft_file, tmp_path / "x", **{"model.neftune_noise_alpha": 0}),
                    schema=SFTConfig, validate=validate_job)
