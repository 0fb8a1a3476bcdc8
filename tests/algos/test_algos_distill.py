"""On-policy distillation's per-token loss (tiller.algos.distill) with worked numbers."""

import math

import pytest
import torch

from tiller.algos.aggregate import aggregate_loss
from tiller.algos.distill import distillation_divergence, distillation_loss
from tiller.errors import ConfigError

D = torch.float64
LN2 = math.log(2.0)


def _inputs():
    # one response of 3 tokens, the last one padding. student p = (.5, .25), teacher q = (.25, .5)
    lp = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]], dtype=D, requires_grad=True)
    lq = torch.tensor([[math.log(0.25), math.log(0.5), -7.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0]])
    return lp, lq, mask


def test_k1_policy_gradient_worked_numbers():
    # k1 = lp - lq = (ln2, -ln2); advantage A = -k1 = (-ln2, +ln2). On-policy the ratio is 1, so the per-token loss
    # -A * ratio = (ln2, -ln2) and its gradient in lp is -A = (ln2, -ln2): the over-confident first token is pushed
    # down, the under-confident second one up. Token mean of the loss: 0; reverse_kl (token mean of k1): 0.
    lp, lq, mask = _inputs()
    tok, m = distillation_loss(lp, lp.detach(), lq, mask)
    assert tok.detach().tolist()[0] == pytest.approx([LN2, -LN2, 0.0])
    assert float(m["reverse_kl"]) == pytest.approx(0.0, abs=1e-12)
    aggregate_loss(tok, mask, "token-mean", global_tokens=2.0).backward()
    assert lp.grad.tolist()[0] == pytest.approx([LN2 / 2, -LN2 / 2, 0.0])  # / 2 tokens


def test_k1_policy_gradient_is_clipped_like_ppo():
    # old = lp - 0.5: ratio r = e^0.5 = 1.648721. Token 1, A = -ln2 < 0: max(-A r, -A clip(r, .8, 1.2)) = ln2 * r
    # (the pessimistic side; dual-clip min(-A * 3, .) keeps it). Token 2, A = +ln2: max(-ln2 r, -ln2 * 1.2) = -1.2 ln2,
    # clipped: no gradient.
    lp, lq, mask = _inputs()
    tok, m = distillation_loss(lp, lp.detach() - 0.5, lq, mask)
    r = math.exp(0.5)
    assert tok.detach().tolist()[0] == pytest.approx([LN2 * r, -1.2 * LN2, 0.0])
    tok.sum().backward()
    assert lp.grad.tolist()[0] == pytest.approx([LN2 * r, 0.0, 0.0])
    assert float(m["pg_clipfrac"]) == pytest.approx(0.5)


def test_k3_supervised_worked_numbers():
    # k3 = exp(lq - lp) - (lq - lp) - 1. Token 1: lq - lp = -ln2 -> 0.5 + ln2 - 1 = 0.193147;
    # token 2: lq - lp = ln2 -> 2 - ln2 - 1 = 0.306853. d k3 / d lp = 1 - exp(lq - lp) = (0.5, -1).
    lp, lq, mask = _inputs()
    tok, m = distillation_loss(lp, lp.detach(), lq, mask, loss_mode="k3", use_policy_gradient=False)
    assert tok.detach().tolist()[0] == pytest.approx([0.193147, 0.306853, 0.0], abs=1e-6)
    assert float(m["divergence"]) == pytest.approx(0.25, abs=1e-6)
    tok.sum().backward()
    assert lp.grad.tolist()[0] == pytest.approx([0.5, -1.0, 0.0])


def test_clamps():
    # lp = 0, lq = -3: k1 = 3. log_prob_min_clamp=-2 lifts lq to -2 (k1 = 2); loss_max_clamp=1.5 caps it; a negative
    # k1 (lp = -3, lq = 0) is capped at -1.5.
    lp, lq = torch.tensor([[0.0, -3.0]], dtype=D), torch.tensor([[-3.0, 0.0]], dtype=D)
    assert distillation_divergence(lp, lq, "k1", None, None).tolist()[0] == [3.0, -3.0]
    assert distillation_divergence(lp, lq, "k1", -2.0, None).tolist()[0] == [2.0, -2.0]
    assert distillation_divergence(lp, lq, "k1", -2.0, 1.5).tolist()[0] == [1.5, -1.5]


def test_k1_as_a_supervised_loss_is_refused():
    lp, lq, mask = _inputs()
    with pytest.raises(ConfigError, match="k1"):
        distillation_loss(lp, lp.detach(), lq, mask, loss_mode="k1", use_policy_gradient=False)
    with pytest.raises(ConfigError, match="loss_mode"):
        distillation_divergence(lp, lq, "k9")


def test_micro_batch_invariance():
    # token-mean over two micro-batches with the global token count = one batch
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(4, 5, generator=g, dtype=D) - 2
    lq = torch.randn(4, 5, generator=g, dtype=D) - 2
    mask = (torch.rand(4, 5, generator=g) > 0.3).long()
    n = float(mask.sum())
    whole = aggregate_loss(distillation_loss(lp, lp, lq, mask)[0], mask, "token-mean", global_tokens=n)
    parts = sum(aggregate_loss(distillation_loss(lp[i:i + 2], lp[i:i + 2], lq[i:i + 2], mask[i:i + 2])[0],
                               mask[i:i + 2], "token-mean", global_tokens=n) for i in (0, 2))
    assert float(whole) == pytest.approx(float(parts))
