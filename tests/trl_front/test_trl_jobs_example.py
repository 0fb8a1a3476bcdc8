"""examples/trl_sft_dpo.py, run as a user runs it (in-process, the tiny model from the shared fixture): SFT learns,
DPO separates the pair, the reward model ranks it, each output dir a loadable Hugging Face model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_trl_sft_dpo_example(tiny_model_dir, tmp_path):
    pytest.importorskip("datasets")
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    spec = importlib.util.spec_from_file_location("trl_sft_dpo", ROOT / "examples" / "trl_sft_dpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(str(tmp_path), str(tiny_model_dir))
    assert result["sft_loss_last"] < 0.5 * result["sft_loss_first"]
    assert result["dpo_eval_margin"] > 0.2
    assert result["rm_eval_accuracy"] > 0.6 and result["rm_eval_margin"] > 0.5
    AutoModelForCausalLM.from_pretrained(tmp_path / "dpo")
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").config.num_labels == 1


def test_docs_hold_the_generated_field_tables():
    from tiller.trl import CPOConfig, DPOConfig, KTOConfig, ORPOConfig, RewardConfig, SFTConfig
    from tiller.trl.common import field_table

    doc = (ROOT / "docs" / "trl.md").read_text()
    section = doc[doc.index("## SFT, DPO, KTO, reward models"):]
    for cls in (SFTConfig, DPOConfig, KTOConfig, RewardConfig, CPOConfig, ORPOConfig):
        assert f"### {cls.__name__} fields\n\n" + field_table(cls.__name__, cls.RULES) in section, cls.__name__
