"""model.router_aux_loss_coef (OpenRLHF's --aux_loss_coef, TRL's router_aux_loss_coef): a mixture-of-experts model's
router load-balancing loss joins the SFT / DPO / KTO loss with that weight, as transformers computes it."""

from __future__ import annotations

import json

import pytest
import torch

from tests.sft.conftest import job_overrides, write_jsonl
from tests.sft.test_sft_preference import _rows
from tiller.config import load_config
from tiller.config.jobs import DPOConfig, SFTConfig, validate_job
from tiller.errors import ConfigError


@pytest.fixture(scope="module")
def tiny_moe_dir(tiny_model_dir, tmp_path_factory):
    """A ~0.5M-parameter Mixtral (4 experts, 2 per token) with the tiny model's tokenizer, saved for from_pretrained."""
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=256, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                           bos_token_id=tok.bos_token_id, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("moe") / "mixtral"
    MixtralForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _first(run) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


def _sft(model_dir, train, run, coef):
    from tiller.trainer.sft import train_sft

    train_sft(load_config(job_overrides(model_dir, train, run, **{
        "data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 8, "trainer.total_training_steps": 1,
        "trainer.export_hf": False, "model.router_aux_loss_coef": coef}), schema=SFTConfig, validate=validate_job))
    return _first(run)


def test_sft_adds_transformers_router_loss(tiny_moe_dir, sft_file, tmp_path):
    from transformers import AutoModelForCausalLM

    from tiller.data.packing import collate_padded
    from tiller.data.sft import load_sft_examples
    from tiller.models.loading import load_tokenizer

    plain, aux = _sft(tiny_moe_dir, sft_file, tmp_path / "a", 0.0), _sft(tiny_moe_dir, sft_file, tmp_path / "b", 0.5)
    assert "train/aux_loss" not in plain
    # the step's loss (before any update, the same weights) gains 0.5 x the router loss of its one micro-batch, which
    # is transformers' own for those rows
    assert aux["train/loss"] - plain["train/loss"] == pytest.approx(0.5 * aux["train/aux_loss"], rel=1e-5)
    cfg = load_config(job_overrides(tiny_moe_dir, sft_file, tmp_path / "c"), schema=SFTConfig, validate=validate_job)
    tok = load_tokenizer(str(tiny_moe_dir))
    batch = collate_padded(load_sft_examples(cfg.data.train_files, cfg.data, tok, cfg.data.max_samples, seed=1),
                           tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    with torch.no_grad():
        want = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     output_router_logits=True).aux_loss
    assert aux["train/aux_loss"] == pytest.approx(float(want), rel=1e-5) and float(want) > 1.0  # ~num experts x ...


def test_dpo_adds_it_too_and_a_dense_model_is_refused(tiny_moe_dir, tiny_model_dir, tmp_path):
    from tiller.trainer.preference import train_dpo

    train = write_jsonl(tmp_path / "d.jsonl", _rows(4))
    runs = {}
    for coef in (0.0, 0.3):
        run = tmp_path / f"dpo{coef}"
        train_dpo(load_config(job_overrides(tiny_moe_dir, train, run, **{
            "data.train_batch_size": 4, "data.micro_batch_size_per_gpu": 2, "trainer.total_training_steps": 1,
            "trainer.export_hf": False, "model.router_aux_loss_coef": coef}), schema=DPOConfig, validate=validate_job))
        runs[coef] = _first(run)
    assert runs[0.3]["train/loss"] - runs[0.0]["train/loss"] == pytest.approx(0.3 * runs[0.3]["train/aux_loss"],
                                                                               rel=1e-5)
    assert runs[0.3]["train/aux_loss"] > 1.0
    from tiller.trainer.sft import train_sft

    with pytest.raises(ConfigError, match="model.router_aux_loss_coef=0.1: .* is not a mixture-of-experts model"):
        train_sft(load_config(job_overrides(tiny_model_dir, train, tmp_path / "x", **{
            "model.router_aux_loss_coef": 0.1}), schema=SFTConfig, validate=validate_job))


def test_trl_fields_map_with_trls_default_of_the_models_own_coefficient(tiny_moe_dir, tiny_model_dir, tmp_path,
                                                                        capsys):
    # TRL's router_aux_loss_coef=None takes a mixture-of-experts model's config value (Mixtral's 0.001), a dense
    # model's none; OpenRLHF's --aux_loss_coef maps too
    from tiller.openrlhf.cli import main as openrlhf_main
    from tiller.trl import DPOConfig as TRLDPOConfig, DPOTrainer, SFTConfig as TRLSFTConfig, SFTTrainer

    rows = [{"prompt": "a", "completion": " b"}] * 4
    keys = SFTTrainer(model=str(tiny_moe_dir), train_dataset=rows,
                      args=TRLSFTConfig(output_dir=str(tmp_path / "a"))).tiller_keys()
    assert keys["model.router_aux_loss_coef"] == pytest.approx(0.001)
    keys = SFTTrainer(model=str(tiny_model_dir), train_dataset=rows,
                      args=TRLSFTConfig(output_dir=str(tmp_path / "b"))).tiller_keys()
    assert "model.router_aux_loss_coef" not in keys
    pairs = [{"prompt": "a", "chosen": " b", "rejected": " c"}] * 4
    keys = DPOTrainer(model=str(tiny_moe_dir), train_dataset=pairs,
                      args=TRLDPOConfig(output_dir=str(tmp_path / "c"), router_aux_loss_coef=0.2)).tiller_keys()
    assert keys["model.router_aux_loss_coef"] == 0.2
    train = write_jsonl(tmp_path / "s.jsonl", [{"input": "a", "output": "b"}] * 4)
    assert openrlhf_main(["train_sft", "--pretrain", str(tiny_moe_dir), "--dataset", str(train), "--input_key",
                          "input", "--output_key", "output", "--aux_loss_coef", "0.01", "--dry-run"]) == 0
    assert "router_aux_loss_coef: 0.01" in capsys.readouterr().out
