"""`tiller rm`: accuracy rises on a separable preference set; the export scores in the RL reward-model scorer."""

from __future__ import annotations

import json

import pytest
import torch

from tests.sft.conftest import job_overrides, write_jsonl
from tiller.config import load_config
from tiller.config.jobs import RMConfig, validate_job
from tiller.errors import DataError
from tiller.trainer.rm import train_rm


def _pairs(numbers) -> list[dict]:
    # separable: the chosen answer is the right sum, the rejected one says it does not know
    return [{"prompt": f"What is {a} + {b}?", "chosen": f"The answer is {a + b}.", "rejected": "I do not know."}
            for a, b in numbers]


def test_rm_accuracy_rises_and_export_scores_in_rl_scorer(tiny_model_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", _pairs([(i, 2 * i + 1) for i in range(16)]))
    val_rows = _pairs([(20 + i, i) for i in range(8)])
    val = write_jsonl(tmp_path / "val.jsonl", val_rows)
    run = tmp_path / "rm"
    cfg = load_config(job_overrides(tiny_model_dir, train, run, **{
        "data.val_files": f"[{val}]", "data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 4,
        "optim.lr": 1e-3, "trainer.total_training_steps": 12, "trainer.test_freq": 12}), schema=RMConfig,
        validate=validate_job)
    last = train_rm(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["train/accuracy"] <= 0.75  # a random head separates little at first
    assert last["train/accuracy"] == 1.0 and last["val/accuracy"] == 1.0
    assert last["train/loss"] < 0.5 * rows[0]["train/loss"]

    # the exported dir is what `reward_model.enable=True reward_model.model.path=...` loads
    from tiller.rewards.reward_model import RewardModelScorer

    scorer = RewardModelScorer(str(run / "hf_model"), micro_batch_size=3, device="cpu")
    prompts = [r["prompt"] for r in val_rows]
    chosen = scorer.score_texts(prompts, [r["chosen"] for r in val_rows])
    rejected = scorer.score_texts(prompts, [r["rejected"] for r in val_rows])
    assert (chosen > rejected).all()
    # and the scorer's numbers are the trainer's: mean gap equals the logged val/score_gap
    assert float((chosen - rejected).mean()) == pytest.approx(last["val/score_gap"], rel=1e-4, abs=1e-4)


def test_rm_margin_and_bad_inputs(tiny_model_dir, tmp_path):
    from tiller.data.preference import load_preference_examples
    from tiller.models.loading import load_tokenizer
    from tiller.trainer.rm import RMJob

    tok = load_tokenizer(tiny_model_dir)
    cfg = RMConfig()
    cfg.data.margin_key = "margin"
    f = write_jsonl(tmp_path / "m.jsonl", [{**_pairs([(1, 2)])[0], "margin": 2.0}])
    (pair,) = load_preference_examples([f], cfg.data, tok, "rm")
    assert pair.margin == 2.0
    # margin enters the loss as -log sigma(s_c - s_r - m): with a constant-score model (s_c = s_r)
    # the loss is -log sigma(-2) = log(1 + e^2) = 2.126928
    class Const(torch.nn.Module):
        def forward(self, input_ids, attention_mask, use_cache=False):
            return type("Out", (), {"logits": torch.zeros(input_ids.shape[0], 1)})()

    job = RMJob(tok.pad_token_id, 1, use_margin=True)
    loss, metrics = job.loss(Const(), job.micro_batches([pair])[0], 1.0)
    assert loss.item() == pytest.approx(2.126928, abs=1e-6)
    assert metrics["accuracy"].item() == 0.0  # a tie is not a win

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x", "chosen": "a", "rejected": ""}])
    with pytest.raises(DataError, match=r"bad.jsonl row 0: rejected is empty"):
        load_preference_examples([bad], cfg.data, tok, "rm")
    missing = write_jsonl(tmp_path / "miss.jsonl", [{"prompt": "x", "chosen": "a", "rejected": "b"}])
    with pytest.raises(DataError, match=r"missing key 'margin' \(data.margin_key\)"):
        load_preference_examples([missing], cfg.data, tok, "rm")


def _train_lora_rm(tiny_model_dir, tmp_path, steps: int):
    train = write_jsonl(tmp_path / "train.jsonl", _pairs([(i, i + 1) for i in range(8)]))
    run = tmp_path / "rm_lora"
    cfg = load_config(job_overrides(tiny_model_dir, train, run, **{
        "model.lora_rank": 4, "data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 8, "optim.lr": 3e-3,
        "trainer.total_training_steps": steps}), schema=RMConfig, validate=validate_job)
    train_rm(cfg)
    return run


def test_rm_lora_exports_a_plain_sequence_classifier(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    run = _train_lora_rm(tiny_model_dir, tmp_path, steps=3)
    model = AutoModelForSequenceClassification.from_pretrained(run / "hf_model")
    keys = model.state_dict().keys()
    assert "score.weight" in keys and not any("lora" in k or "modules_to_save" in k for k in keys)
    assert (run / "checkpoints" / "global_step_3" / "model" / "adapter_model.safetensors").exists()


def test_tiller_export_of_a_lora_rm_checkpoint_gives_the_same_classifier(tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification

    from tiller.models.checkpoint import export_hf

    run = _train_lora_rm(tiny_model_dir, tmp_path, steps=2)
    exported = export_hf(run / "checkpoints" / "global_step_2", tmp_path / "exported")
    a = AutoModelForSequenceClassification.from_pretrained(run / "hf_model").eval()
    b = AutoModelForSequenceClassification.from_pretrained(exported).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(a(input_ids=ids).logits, b(input_ids=ids).logits, atol=1e-5)
