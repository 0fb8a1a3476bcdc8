"""TRL's `optim` / `optim_args` / `weight_decay` / warmup through tiller.trl, against TRL itself: the same SFT steps
(one batch of every row per step, so sampling order cannot matter) give TRL's losses with SGD + momentum, Adafactor,
AdamW with weight decay (biases and norm weights spared, as transformers' Trainer spares them) and a warmup that
starts at lr 0, as transformers' schedules do."""

from __future__ import annotations

import pytest

from tests.trl_front.test_trl_sft import MEMO
from tiller.errors import ConfigError
from tiller.trl import SFTConfig, SFTTrainer

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

ROWS = [{"prompt": p + " ", "completion": c} for p, c in MEMO]
COMMON = dict(per_device_train_batch_size=8, max_steps=3, logging_steps=1, bf16=False, report_to="none",
              gradient_checkpointing=False, seed=0, save_strategy="no")


def _losses(trainer) -> list[float]:
    trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def _trl(model_dir, out, **kw) -> list[float]:
    args = trl.SFTConfig(output_dir=str(out), use_cpu=True, **{**COMMON, **kw})
    return _losses(trl.SFTTrainer(model=str(model_dir), args=args, train_dataset=datasets.Dataset.from_list(ROWS)))


def _tiller(model_dir, out, **kw) -> tuple[list[float], SFTTrainer]:
    trainer = SFTTrainer(model=str(model_dir), args=SFTConfig(output_dir=str(out), **{**COMMON, **kw}),
                         train_dataset=datasets.Dataset.from_list(ROWS))
    return _losses(trainer), trainer


@pytest.mark.parametrize("kw", [
    dict(optim="sgd", optim_args="momentum=0.9,nesterov=true", learning_rate=0.2, weight_decay=0.05),
    dict(optim="adafactor", learning_rate=1e-2),
    dict(optim="adamw_torch", learning_rate=1e-2, weight_decay=1.0),
    dict(optim="paged_adamw_8bit", learning_rate=1e-2, weight_decay=0.1),
    dict(learning_rate=1e-2, warmup_steps=2),  # transformers' warmup: lr 0 at the first step (loss 2 = loss 1)
    dict(learning_rate=1e-2, warmup_steps=0.4, lr_scheduler_type="cosine", max_steps=5),
    dict(learning_rate=1e-2, warmup_steps=1, lr_scheduler_type="polynomial", max_steps=4,
         lr_scheduler_kwargs={"lr_end": 1e-3, "power": 2.0}),
    dict(learning_rate=1e-2, warmup_steps=1, lr_scheduler_type="warmup_stable_decay", max_steps=5,
         lr_scheduler_kwargs={"num_decay_steps": 2, "decay_type": "linear", "min_lr_ratio": 0.1}),
    dict(learning_rate=1e-2, label_smoothing_factor=0.2),  # transformers' LabelSmoother in TRL's SFT loss
], ids=["sgd", "adafactor", "adamw-decay", "bnb-paged-8bit", "warmup-linear", "warmup-cosine", "polynomial", "wsd",
        "label-smoothing"])
def test_sft_steps_equal_trls(tiny_model_dir, tmp_path, kw):
    if "8bit" in kw.get("optim", ""):
        pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (the test and quant extras install it)")
    want = _trl(tiny_model_dir, tmp_path / "trl", **kw)
    got, trainer = _tiller(tiny_model_dir, tmp_path / "tiller", **kw)
    assert len(want) == len(got) == kw.get("max_steps", 3) and want[-1] < want[0]
    assert got == pytest.approx(want, rel=2e-5, abs=1e-6), (got, want)
    keys = trainer.tiller_keys()
    if kw.get("optim") == "sgd":
        assert keys["optim.override_optimizer_config"] == {"momentum": 0.9, "nesterov": True}
        assert "optim.betas" not in keys and keys["optim.optimizer"] == "SGD"
    if kw.get("weight_decay"):
        assert keys["optim.weight_decay_exempt"] == "transformers"


def test_decaying_every_parameter_would_differ_from_trl(tiny_model_dir, tmp_path):
    """The AdamW comparison above can fail: with every parameter decayed (verl's rule, tiller's own default) the third
    step's loss leaves TRL's."""
    from tiller.trainer.sft import main as sft_main
    from tiller.trl.common import overrides
    import json

    kw = dict(optim="adamw_torch", learning_rate=1e-2, weight_decay=1.0)
    want = _trl(tiny_model_dir, tmp_path / "trl", **kw)
    trainer = SFTTrainer(model=str(tiny_model_dir), args=SFTConfig(output_dir=str(tmp_path / "t"), **COMMON, **kw),
                         train_dataset=datasets.Dataset.from_list(ROWS))
    keys = trainer.tiller_keys()
    keys.pop("optim.weight_decay_exempt")
    keys["trainer.default_local_dir"] = str(tmp_path / "every")
    assert sft_main(overrides(keys)) == 0
    rows = [json.loads(x) for x in (tmp_path / "every" / "metrics.jsonl").read_text().splitlines()]
    assert abs(rows[-1]["train/loss"] - want[-1]) > 1e-4 * abs(want[-1])


def test_unbuilt_optimizers_and_ignored_args_are_refused(tiny_model_dir, tmp_path):
    def make(**kw):
        return SFTTrainer(model=str(tiny_model_dir), args=SFTConfig(output_dir=str(tmp_path / "o"), **kw),
                          train_dataset=ROWS).tiller_keys()

    with pytest.raises(ConfigError, match="^optim='galore_adamw': refused: tiller builds adamw_torch_fused"):
        make(optim="galore_adamw")
    with pytest.raises(ConfigError, match="optim_args='betas=0.1': refused: transformers reads no optim_args for "
                                          "optim='adamw_torch_fused'"):
        make(optim_args="betas=0.1")
    with pytest.raises(ConfigError, match="transformers reads momentum, dampening, nesterov for optim='sgd' and "
                                          "ignores 'lr'"):
        make(optim="sgd", optim_args="lr=0.1")
    with pytest.raises(ConfigError, match="parameter groups set weight_decay from the weight_decay field"):
        make(optim="rmsprop", optim_args="alpha=0.9,weight_decay=0.1")
    keys = make(optim="paged_adamw_8bit", adam_epsilon=1e-6)
    assert (keys["optim.optimizer_impl"], keys["optim.optimizer"], keys["optim.override_optimizer_config"],
            keys["optim.eps"]) == ("bitsandbytes.optim", "AdamW", {"optim_bits": 8, "is_paged": True}, 1e-6)
    keys = make(optim="lion_32bit", adam_beta2=0.99)
    assert keys["optim.override_optimizer_config"] == {"optim_bits": 32, "is_paged": False, "betas": [0.9, 0.99]}
    assert "optim.betas" not in keys
    with pytest.raises(ConfigError, match="label_smoothing_factor=0.1: refused: TRL's SFTTrainer smooths the nll loss"):
        make(label_smoothing_factor=0.1, loss_type="dft")
    assert make(label_smoothing_factor=0.1)["algorithm.label_smoothing"] == 0.1
