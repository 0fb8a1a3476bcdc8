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
