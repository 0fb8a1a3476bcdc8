"""Worked numbers: the SFT token losses (nll, DFT) and the reward model's centring term."""

from __future__ import annotations

import math

import pytest
import torch

from tiller.algos import pairwise_rm_loss, sft_token_loss
from tiller.errors import ConfigError


def test_dft_scales_nll_by_detached_probability():
    # p = 0.5 and 0.25: nll = ln 2 = 0.693147, ln 4 = 1.386294; dft = p * nll = 0.346574, 0.346574
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_(True)
    dft = sft_token_loss(logp, "dft")
    assert torch.allclose(dft, torch.tensor([[0.5 * math.log(2), 0.25 * math.log(4)]]), atol=1e-6)
    assert torch.allclose(sft_token_loss(logp, "nll"), torch.tensor([[math.log(2), math.log(4)]]), atol=1e-6)
    # gradient w.r.t. logp: -p (the scale is a constant), not -(p + p logp) as without the stop-gradient
    dft.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.25]]), atol=1e-6)


def test_label_smoothing_equals_transformers_label_smoother():
    from transformers.trainer_pt_utils import LabelSmoother

    from tiller.algos import aggregate_loss, logprobs_from_logits
    from tiller.algos.sft import label_smoothed_loss

    # worked number (tiller.algos.sft): logits (0, ln 3), target 1, eps 0.1 -> 0.342613
    z = torch.tensor([[[0.0, math.log(3.0)]]])
    assert label_smoothed_loss(torch.log_softmax(z, -1)[..., 1], z, 0.1).item() == pytest.approx(0.3426126, abs=1e-6)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, 11, (3, 7), generator=g)
    labels[0, :3] = labels[2, 5:] = -100  # ignored positions
    mask = labels != -100
    logp = logprobs_from_logits(logits, labels.clamp(min=0))
    ours = aggregate_loss(label_smoothed_loss(logp, logits, 0.2), mask, "token-mean")
    want = LabelSmoother(epsilon=0.2)({"logits": logits}, labels)
    plain = aggregate_loss(-logp, mask, "token-mean")
    # (transformers sums the smoothing term in float32)
    assert ours.item() == pytest.approx(want.item(), rel=1e-7) and abs(ours.item() - plain.item()) > 0.1


def test_unknown_sft_loss_names_the_valid_ones():
    with pytest.raises(ConfigError, match="nll, dft"):
        sft_token_loss(torch.zeros(1, 1), "focal")


def test_center_term_matches_trl_formula():
    # s_c = [1, 0.5], s_r = [-0.5, 0.5], c = 0.01:
    # BT: -log sigma(1.5) = 0.201413, -log sigma(0) = 0.693147
    # centring: 0.01 * (0.5)^2 = 0.0025, 0.01 * (1.0)^2 = 0.01
    sc, sr = torch.tensor([1.0, 0.5]), torch.tensor([-0.5, 0.5])
    per_pair = pairwise_rm_loss(sc, sr, center_coef=0.01)
    assert torch.allclose(per_pair, torch.tensor([0.201413 + 0.0025, 0.693147 + 0.01]), atol=1e-5)
    # TRL: -logsigmoid(sc - sr).mean() + c * mean((sc + sr)^2) == mean of the per-pair values
    trl = -torch.nn.functional.logsigmoid(sc - sr).mean() + 0.01 * torch.mean((sc + sr) ** 2)
    assert torch.allclose(per_pair.mean(), trl, atol=1e-7)
    assert torch.equal(pairwise_rm_loss(sc, sr), pairwise_rm_loss(sc, sr, center_coef=0.0))


def test_hinge_and_robust_dpo_match_trl_formulas():
    from tiller.algos import dpo_loss

    # logps: pi_c = -1, pi_r = -2, ref_c = -1.5, ref_r = -1.5 -> h = (-1 + 2) - 0 = 1; beta = 0.5: beta h = 0.5
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -2.0, -1.5, -1.5))
    hinge, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="hinge")
    assert torch.allclose(hinge, torch.tensor([0.5]))  # relu(1 - 0.5)
    # robust, eps = 0.1: -log sigma(0.5) = 0.474077, -log sigma(-0.5) = 0.974077
    # (0.9 * 0.474077 - 0.1 * 0.974077) / 0.8 = (0.426669 - 0.097408) / 0.8 = 0.411577
    robust, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="robust", label_smoothing=0.1)
    assert torch.allclose(robust, torch.tensor([0.411577]), atol=1e-5)
    # TRL 1.16 DPOTrainer: clean = -(1 - ls) logsigmoid(beta d), flipped = -ls logsigmoid(-beta d),
    # loss = (clean - flipped) / (1 - 2 ls); hinge = relu(1 - beta d)
    d = torch.tensor([1.0])
    F = torch.nn.functional
    trl_robust = (-(0.9) * F.logsigmoid(0.5 * d) - (-0.1 * F.logsigmoid(-0.5 * d))) / 0.8
    assert torch.allclose(robust, trl_robust, atol=1e-7)


def test_apo_zero_unpaired_is_kto_with_a_zero_baseline():
    from tiller.algos import kto_loss

    # r = pi - ref = [0.4, -0.6], beta 0.5, desirable [True, False]; TRL 1.16 apo_zero_unpaired:
    # desirable 1 - sigma(0.2) = 0.450166, undesirable sigma(-0.3) = 0.425557
    r = torch.tensor([0.4, -0.6])
    loss, _ = kto_loss(r, torch.zeros(2), torch.tensor([True, False]), torch.zeros(()), beta=0.5)
    assert torch.allclose(loss, torch.tensor([0.450166, 0.425557]), atol=1e-6)
    assert torch.allclose(loss, torch.stack([1 - torch.sigmoid(0.5 * r[0]), torch.sigmoid(0.5 * r[1])]))
