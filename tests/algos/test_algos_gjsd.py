"""The full-vocabulary generalized JSD (tiller.algos.distill.gjsd_*) with worked numbers on V = 2, its closed-form
gradient against autograd of the plain formula, chunking invariance and refusals."""

import math

import pytest
import torch

from tiller.algos.aggregate import aggregate_loss
from tiller.algos.distill import gjsd_loss, gjsd_per_token
from tiller.errors import ConfigError

D = torch.float64
LN3 = math.log(3.0)


def _pair(scale: float = 1.0):
    # student logits (0, 0): p = (1/2, 1/2); teacher logits (ln 3, 0): q = (3/4, 1/4). `scale` multiplies both (so
    # temperature = scale gives back the same p, q).
    zs = torch.tensor([[[0.0, 0.0]]], dtype=D, requires_grad=True)
    zt = torch.tensor([[[LN3 * scale, 0.0]]], dtype=D)
    return zs, zt


@pytest.mark.parametrize("beta, expected, grad", [
    # beta = 0, forward KL(q || p) = 3/4 ln(3/2) + 1/4 ln(1/2) = 0.130812; d/dz = p - q = (-1/4, 1/4)
    (0.0, 0.75 * math.log(1.5) + 0.25 * math.log(0.5), [-0.25, 0.25]),
    # beta = 1, reverse KL(p || q) = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3) = 0.143841;
    # d/dz = p (log p - log q - KL) = 1/2 (ln(2/3) - KL, ln 2 - KL) = (-0.274653, 0.274653)
    (1.0, 0.5 * math.log(4 / 3), [0.5 * (math.log(2 / 3) - 0.5 * math.log(4 / 3)),
                                 0.5 * (math.log(2) - 0.5 * math.log(4 / 3))]),
    # beta = 1/2, m = (5/8, 3/8): KL(p || m) = 1/2 ln(16/15) = 0.032269, KL(q || m) = 3/4 ln 1.2 + 1/4 ln(2/3)
    # = 0.035375, JSD = (0.032269 + 0.035375) / 2 = 0.033822; d/dz = 1/2 p (log p - log m - KL(p||m))
    (0.5, 0.5 * (0.5 * math.log(16 / 15) + 0.75 * math.log(1.2) + 0.25 * math.log(2 / 3)),
     [0.25 * (math.log(0.8) - 0.5 * math.log(16 / 15)), 0.25 * (math.log(4 / 3) - 0.5 * math.log(16 / 15))]),
])
def test_gjsd_worked_numbers(beta, expected, grad):
    zs, zt = _pair()
    div, entropy = gjsd_per_token(zs, zt, beta)
    assert float(div.detach()) == pytest.approx(expected, rel=1e-12)
    assert float(entropy) == pytest.approx(math.log(2.0), rel=1e-12)  # p uniform on 2 tokens
    div.sum().backward()
    assert zs.grad[0, 0].tolist() == pytest.approx(grad, rel=1e-10)


def test_gjsd_temperature_divides_both_logits():
    # logits twice as large with temperature 2: the same p, q, so the same divergence; the gradient in the raw
    # logits is the one in the scaled logits divided by the temperature (reverse KL: (-0.274653, 0.274653) / 2).
    zs, zt = _pair(scale=2.0)
    div, _ = gjsd_per_token(zs, zt, 1.0, temperature=2.0)
    assert float(div.detach()) == pytest.approx(0.5 * math.log(4 / 3), rel=1e-12)
    div.sum().backward()
    g = 0.5 * (math.log(2) - 0.5 * math.log(4 / 3)) / 2
    assert zs.grad[0, 0].tolist() == pytest.approx([-g, g], rel=1e-10)


def _plain(zs, zt, beta):
    # the definition, left to autograd
    lp, lq = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    if beta == 0.0:
        return (lq.exp() * (lq - lp)).sum(-1)
    if beta == 1.0:
        return (lp.exp() * (lp - lq)).sum(-1)
    m = (1 - beta) * lp.exp() + beta * lq.exp()
    return beta * (lq.exp() * (lq - m.log())).sum(-1) + (1 - beta) * (lp.exp() * (lp - m.log())).sum(-1)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_gjsd_closed_form_gradient_and_chunking_match_autograd(beta):
    g = torch.Generator().manual_seed(0)
    zs = (torch.randn(3, 5, 11, generator=g, dtype=D) * 2).requires_grad_()
    zt = torch.randn(3, 5, 11, generator=g, dtype=D) * 2
    w = torch.rand(3, 5, generator=g, dtype=D)  # an upstream gradient that is not all ones
    ref = _plain(zs, zt, beta)
    (ref_grad,) = torch.autograd.grad((ref * w).sum(), zs)
    for chunk in (1, 4, 15, 256):  # 15 = every position at once
        div, _ = gjsd_per_token(zs, zt, beta, chunk_rows=chunk)
        (grad,) = torch.autograd.grad((div * w).sum(), zs)
        torch.testing.assert_close(div, ref, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)


def test_gjsd_loss_masks_and_token_mean():
    # two positions with the worked reverse KL 0.143841 and one padding position (any logits): the token-mean
    # loss is 0.143841 and the padding position gets no gradient.
    zs = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [5.0, -5.0]]], dtype=D, requires_grad=True)
    zt = torch.tensor([[[LN3, 0.0], [LN3, 0.0], [-9.0, 9.0]]], dtype=D)
    mask = torch.tensor([[1, 1, 0]])
    tok, metrics = gjsd_loss(zs, zt, mask, beta=1.0)
    assert tok[0, 2] == 0.0
    assert float(metrics["divergence"]) == pytest.approx(0.5 * math.log(4 / 3), rel=1e-12)
    assert float(metrics["student_entropy"]) == pytest.approx(math.log(2.0), rel=1e-12)
    loss = aggregate_loss(tok, mask, "token-mean", global_tokens=2.0)
    assert float(loss.detach()) == pytest.approx(0.5 * math.log(4 / 3), rel=1e-12)
    loss.backward()
    assert zs.grad[0, 2].tolist() == [0.0, 0.0]


def test_gjsd_refuses_bad_beta_and_shapes():
    zs, zt = _pair()
    with pytest.raises(ConfigError, match="beta must be in"):
        gjsd_per_token(zs, zt, 1.5)
    with pytest.raises(ValueError, match="vocabulary"):
        gjsd_per_token(zs, torch.zeros(1, 1, 3, dtype=D))
