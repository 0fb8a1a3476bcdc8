"""Worked numbers for what a parity run against verl 0.10 (verl-project/verl 1dda039b) found or left unpinned:
geo_mean's rollout IS weights (a geometric mean per row), bypass mode's aggregation mask, the distillation surrogate's IS weights and metric
names, low_var_kl's clamps, the straight-through KL variants, the value loss under every aggregation mode."""

import math

import pytest
import torch

import algos_reference as ref
from tiller.algos import aggregate_loss, get_policy_loss, kl_penalty, value_loss
from tiller.algos.distill import distillation_loss
from tiller.algos.policy_losses import bypass_loss_mask, rollout_is_weights_for

D = torch.float64


def test_geo_mean_is_weights_are_each_rows_geometric_mean():
    # verl's geo_mean weights its one-per-row loss by exp(mean_t log(w_t + 1e-10)) over the row's valid tokens.
    # row 0: w = (2, 0.5) -> exp((ln 2 + ln 0.5) / 2) = 1 (the arithmetic mean would be 1.25)
    # row 1: w = (4, 1), the 9 sits on padding -> exp((ln 4 + 0) / 2) = 2 (arithmetic 2.5)
    w = torch.tensor([[2.0, 0.5, 1.0], [4.0, 1.0, 9.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=D)
    ref.assert_close(rollout_is_weights_for("geo_mean", w, mask), [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], atol=1e-7)
    assert rollout_is_weights_for("vanilla", w, mask) is w  # every other loss: each token's own weight
    # an IcePop zero keeps the row at ~0, not at the mean of the others: exp((ln 1e-10 + ln 1) / 2) = 1e-5
    zero = rollout_is_weights_for("geo_mean", torch.tensor([[0.0, 1.0]], dtype=D), torch.ones(1, 2, dtype=D))
    ref.assert_close(zero, [[1e-5, 1e-5]], atol=1e-12)
    # on-policy (log ratio 0, ratio 1): row losses -A = -1 (A = +1) and +1 (A = -1); weighted 1 and 2:
    # seq-mean-token-mean = (-1 * 1 + 1 * 2) / 2 = 0.5 (per-token weights would give (-1.25 + 2.5) / 2 = 0.625).
    # d/d logp_t of row i: -A_i * ratio / n_i * w_i / N_seq: row 0: -1 / 2 * 1 / 2 = -0.25; row 1: +1 / 2 * 2 / 2 = 0.5
    logp = torch.zeros(2, 3, dtype=D, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=D)
    tok, _ = get_policy_loss("geo_mean")(logp, torch.zeros(2, 3, dtype=D), adv, mask)
    total = aggregate_loss(tok * rollout_is_weights_for("geo_mean", w, mask), mask, "seq-mean-token-mean")
    assert total.item() == pytest.approx(0.5, abs=1e-7)  # verl divides by n_i + 1e-8: a 1e-8 relative shift
    total.backward()
    ref.assert_close(logp.grad, [[-0.25, -0.25, 0.0], [0.5, 0.5, 0.0]], atol=1e-7)


def test_bypass_mode_aggregates_over_the_tokens_rejection_keeps():
    # verl aggregates bypass_mode's loss over response_mask less the rejected tokens, so seq-mean-token-mean divides
    # each row by its KEPT tokens. REINFORCE, TIS cap 2, token_k1 keeps p_rollout / p in [0.4, 2.5], A = 1:
    #   row 0: p = (.6, .3), p_rollout = (.2, .6): t0 (ratio 1/3) rejected; t1 w = 0.5: -0.5 ln 0.3 = 0.601986 / 1 kept
    #   row 1: on-policy p = p_rollout = (.5, .5): w = 1, -ln 0.5 = 0.693147 on both: 0.693147 per token
    #   seq-mean-token-mean = (0.601986 + 0.693147) / 2 = 0.647567 (over the response mask: (0.300993 + 0.693147) / 2)
    #   grad: row 0 t1 -w / (1 kept * 2 rows) = -0.25; row 1 -1 / (2 * 2) = -0.25
    logp = torch.tensor([[math.log(0.6), math.log(0.3)], [math.log(0.5), math.log(0.5)]], dtype=D, requires_grad=True)
    rollout = torch.tensor([[math.log(0.2), math.log(0.6)], [math.log(0.5), math.log(0.5)]], dtype=D)
    mask = torch.ones(2, 2, dtype=D)
    hyper = dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                 rollout_rs_threshold="0.4_2.5", clip_ratio=0.2)
    kept = bypass_loss_mask(logp, rollout, mask, **hyper)
    ref.assert_close(kept, [[0.0, 1.0], [1.0, 1.0]], atol=0)
    tok, _ = get_policy_loss("bypass_mode")(logp, rollout, torch.ones(2, 2, dtype=D), mask, **hyper)
    total = aggregate_loss(tok, kept, "seq-mean-token-mean", global_tokens=4, global_seqs=2)
    assert total.item() == pytest.approx(0.647567, abs=1e-6)
    total.backward()
    ref.assert_close(logp.grad, [[0.0, -0.25], [-0.25, -0.25]], atol=1e-6)
    # token-mean's normaliser is the global count (4 response tokens, as verl's batch_num_tokens): the mask is moot
    assert aggregate_loss(tok, kept, "token-mean", global_tokens=4).item() == pytest.approx(
        aggregate_loss(tok, mask, "token-mean", global_tokens=4).item())


def test_distillation_surrogate_takes_the_is_weights_and_verls_metric_names():
    # student p = (.5, .25), teacher q = (.25, .5): k1 = (ln2, -ln2), A = -k1. old = lp - 0.5: r = e^0.5 = 1.648721.
    # token 0 (A = -ln2 < 0): ln2 * r = 1.142800; token 1 (A = +ln2): clipped at 1.2: -1.2 ln2 = -0.831777.
    # IS weights (3, 0.5) multiply them: (3.428401, -0.415888); verl passes its TIS weights to this surrogate.
    lp = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=D)
    lq = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=D)
    mask = torch.ones(1, 2, dtype=D)
    w = torch.tensor([[3.0, 0.5]], dtype=D)
    tok, m = distillation_loss(lp, lp - 0.5, lq, mask, rollout_is_weights=w)
    ref.assert_close(tok, [[3 * math.log(2) * math.exp(0.5), -0.5 * 1.2 * math.log(2)]], atol=1e-12)
    # verl logs distillation/pg_clipfrac, distillation/ppo_kl (= mean(old - lp) = -0.5), distillation/pg_clipfrac_lower
    assert float(m["ppo_kl"]) == pytest.approx(-0.5) and float(m["pg_clipfrac"]) == pytest.approx(0.5)
    assert "pg_clipfrac_lower" in m and "pg_ppo_kl" not in m
    # the supervised loss (k3) is not weighted (verl: the same)
    sup, _ = distillation_loss(lp, lp, lq, mask, loss_mode="k3", use_policy_gradient=False, rollout_is_weights=w)
    ref.assert_close(sup, [[0.193147, 0.306853]], atol=1e-6)


def test_low_var_kl_clamps_and_straight_through_gradients():
    # d = logp - ref; k3 = exp(-d) + d - 1 with -d clamped to [-20, 20], the result to [-10, 10]:
    #   d = -25: -d -> 20: exp(20) - 20 - 1 = 4.85e8 -> 10;  d = 12: exp(-12) + 12 - 1 = 11.000006 -> 10;
    #   d = 5: exp(-5) + 4 = 4.006738;  d = -1: e - 2 = 0.718282. Clamped entries have no gradient;
    #   else d k3 / d logp = 1 - exp(-d): d = 5 -> 0.993262, d = -1 -> 1 - e = -1.718282.
    ref_lp = torch.zeros(1, 4, dtype=D)
    logp = torch.tensor([[-25.0, 12.0, 5.0, -1.0]], dtype=D, requires_grad=True)
    k3 = kl_penalty(logp, ref_lp, "low_var_kl")
    ref.assert_close(k3, [[10.0, 10.0, 4.006738, 0.718282]], atol=1e-6)
    k3.sum().backward()
    ref.assert_close(logp.grad, [[0.0, 0.0, 0.993262, -1.718282]], atol=1e-6)
    # "+" variants: the value of the estimator, the gradient of k2 = d^2 / 2 (so d itself): verl's straight-through
    for name, value in (("k1+", [-25.0, 12.0, 5.0, -1.0]), ("abs+", [25.0, 12.0, 5.0, 1.0]),
                        ("k3+", [10.0, 10.0, 4.006738, 0.718282])):
        lp = logp.detach().clone().requires_grad_(True)
        out = kl_penalty(lp, ref_lp, name)
        ref.assert_close(out, [value], atol=1e-6)
        out.sum().backward()
        ref.assert_close(lp.grad, [[-25.0, 12.0, 5.0, -1.0]], atol=1e-12)


@pytest.mark.parametrize("mode, expected", [
    # per-token 0.5 max((v - R)^2, (v_clip - R)^2), row 0 = (0.08, 0.5), row 1 = (0.32, padding):
    ("token-mean", (0.08 + 0.5 + 0.32) / 3),
    ("token-sum", 0.08 + 0.5 + 0.32),
    ("seq-mean-token-sum", ((0.08 + 0.5) + 0.32) / 2),
    ("seq-mean-token-mean", ((0.08 + 0.5) / 2 + 0.32) / 2),
    ("seq-mean-token-sum-norm", ((0.08 + 0.5) + 0.32) / (2 * 2)),  # verl: / loss_mask.shape[-1] = 2
])
def test_value_loss_worked_numbers_in_every_aggregation_mode(mode, expected):
    # cliprange 0.2; v_clip = values + clip(vpred - values, -0.2, 0.2); per token 0.5 max((v - R)^2, (v_clip - R)^2):
    #   row 0 token 0: vpred 0.6, values 0.8 -> v_clip 0.6: 0.5 * 0.16 = 0.08 (a tie: not counted as clipped)
    #   row 0 token 1: vpred 0, values 0 -> 0.5 * 1 = 0.5
    #   row 1 token 0: vpred 0.6, values 0 -> v_clip 0.2: max(0.16, 0.64) / 2 = 0.32 (clipped); token 1 is padding
    vpreds = torch.tensor([[0.6, 0.0], [0.6, 5.0]], dtype=D)
    returns = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=D)
    values = torch.tensor([[0.8, 0.0], [0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=D)
    tok, met = value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    ref.assert_close(tok, [[0.08, 0.5], [0.32, 0.0]], atol=1e-12)
    assert aggregate_loss(tok, mask, mode).item() == pytest.approx(expected, abs=1e-12)
    assert met["vf_clipfrac"].item() == pytest.approx(1 / 3)  # only row 1's token 0 takes the clipped term
