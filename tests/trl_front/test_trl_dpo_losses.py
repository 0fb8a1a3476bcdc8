"""Every DPO loss of TRL 1.16 (`loss_type`, lists with `loss_weights`, f-divergences, LD-DPO, WPO) against TRL's own
DPOTrainer: the same rows, model and reference (a perturbed copy, so the log-ratios are not 0), two optimizer
steps; tiller's logged losses and reward margins equal TRL's (the second step checks the gradients too)."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

SUMS = [(1, 2), (3, 4), (5, 1), (2, 7), (8, 1), (4, 4), (6, 3), (9, 0)]
# standard (not conversational) rows: TRL and tiller tokenize them identically (tests/trl_front/test_trl_preference.py)
ROWS = [{"prompt": f"What is {a} + {b}?\n", "chosen": str(a + b), "rejected": str(a + b + 1) * (1 + a % 3)}
        for a, b in SUMS]
CASES = [
    dict(loss_type=["sigmoid"]),
    dict(loss_type=["ipo"]),
    dict(loss_type=["aot"], label_smoothing=0.1),
    dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),  # MPO
    dict(loss_type=["exo_pair"], label_smoothing=1e-3),
    dict(loss_type=["discopop"], discopop_tau=0.1),
    dict(loss_type=["hinge"], f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3),
    dict(loss_type=["sigmoid_norm", "robust"], f_divergence_type="js_divergence", label_smoothing=0.2),
    dict(loss_type=["apo_down", "sppo_hard", "nca_pair", "aot_unpaired", "apo_zero"], label_smoothing=0.2),
    dict(loss_type=["sigmoid"], ld_alpha=0.3, f_divergence_type="forward_kl"),
    dict(loss_type=["sigmoid", "bco_pair"], use_weighting=True),  # (TRL 1.16 fails on sft with WPO: in-place on an
    #                                                                 expanded tensor; tiller weights sft like the rest)
]


@pytest.fixture(scope="module")
def reference_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    out = tmp_path_factory.mktemp("dpo_ref")
    ref.save_pretrained(out)
    return out


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "+".join(kw["loss_type"]) + "".join(
    f"-{k}" for k in kw if k not in ("loss_type", "loss_weights", "label_smoothing")))
def test_dpo_loss_equals_trls(kw, tiny_model_dir, reference_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from tiller.trl import DPOConfig, DPOTrainer

    args = dict(report_to="none", bf16=False, per_device_train_batch_size=8, max_steps=2, logging_steps=1, beta=0.5,
                learning_rate=1e-3, lr_scheduler_type="constant", **kw)
    theirs = trl.DPOTrainer(model=str(tiny_model_dir), ref_model=AutoModelForCausalLM.from_pretrained(reference_dir),
                            args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **args),
                            train_dataset=datasets.Dataset.from_list(ROWS))
    theirs.train()
    ours = DPOTrainer(model=str(tiny_model_dir), ref_model=str(reference_dir),
                      args=DPOConfig(output_dir=str(tmp_path / "tiller"), **args), train_dataset=ROWS)
    ours.train()
    want = [v for h in theirs.state.log_history if "loss" in h for v in (h["loss"], h["rewards/margins"])]
    got = [v for h in ours.state.log_history if "loss" in h for v in (h["loss"], h["rewards/margins"])]
    assert len(want) == len(got) == 4  # (loss, margin) of steps 1 and 2
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert want[0] != pytest.approx(want[2], rel=1e-3)  # the step moved the loss: step 2 compares the gradients
