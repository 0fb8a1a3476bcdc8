"""DPO / cDPO / IPO, KTO, pairwise RM loss; DARLING diversity; masked helpers and group ids."""

import math
from collections import Counter

import numpy as np
import pytest
import torch

import algos_reference as ref
from tiller.algos import (
    diversity_from_partition,
    dpo_loss,
    fuse_diversity,
    group_ids,
    kto_loss,
    masked_mean,
    masked_var,
    masked_whiten,
    pairwise_rm_loss,
    reference_free_loss,
)
from tiller.errors import ConfigError, DataError

D = torch.float64


def t(*xs):
    return torch.tensor(xs, dtype=D)


def softplus(x):
    return math.log1p(math.exp(x))


def test_dpo_worked_numbers():
    # h = (pc - pr) - (rc - rr) = (-1 + 3) - (-2 + 2) = 2 ; beta 0.1 -> beta h = 0.2
    # sigmoid: -log sigma(0.2) = softplus(-0.2) = 0.598139
    loss, cr, rr = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.1)
    assert loss.item() == pytest.approx(softplus(-0.2))
    assert loss.item() == pytest.approx(0.598139, abs=1e-6)
    # implicit rewards beta (pi - ref): chosen 0.1 * 1, rejected 0.1 * -1
    assert cr.item() == pytest.approx(0.1) and rr.item() == pytest.approx(-0.1)
    # cDPO eps 0.1: 0.9 * softplus(-0.2) + 0.1 * softplus(0.2) = 0.538325 + 0.079814 = 0.618139
    loss, _, _ = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.1, label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.618139, abs=1e-6)
    # IPO: (h - 1 / (2 beta))^2 = (2 - 5)^2 = 9 (length 1); lengths 2 and 4: h' = 1/2 - (-1)/4 = 0.75 -> 18.0625
    one = torch.ones(1)
    loss, _, _ = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.1, loss_type="ipo", chosen_lengths=one,
                          rejected_lengths=one)
    assert loss.item() == pytest.approx(9.0)
    loss, _, _ = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.1, loss_type="ipo", chosen_lengths=2 * one,
                          rejected_lengths=4 * one)
    assert loss.item() == pytest.approx((0.75 - 5) ** 2)
    with pytest.raises(ConfigError, match="sigmoid, hinge, ipo, exo_pair"):
        dpo_loss(t(0.0), t(0.0), t(0.0), t(0.0), beta=0.1, loss_type="sppo")


def test_dpo_gradient_direction_and_extremes():
    pc = t(-1.0, -500.0).requires_grad_(True)
    pr = t(-1.0, -1.0).requires_grad_(True)
    loss, _, _ = dpo_loss(pc, pr, t(-1.0, -1.0), t(-1.0, -1.0), beta=1.0)
    loss.sum().backward()
    # at h = 0: loss ln 2, d loss / d pc = -sigma(-h) = -0.5: raising the chosen log-prob lowers the loss
    assert loss[0].item() == pytest.approx(math.log(2))
    assert pc.grad[0].item() == pytest.approx(-0.5) and pr.grad[0].item() == pytest.approx(0.5)
    assert torch.isfinite(loss).all() and loss[1].item() == pytest.approx(499.0)


def test_reference_free_losses_worked_numbers():
    # chosen: sum -2 over 2 tokens (average -1); rejected: sum -6 over 3 tokens (average -2); beta 2
    pc, pr, lc, lr = t(-2.0), t(-6.0), t(2.0), t(3.0)
    # simpo, gamma 0.5: d = -1 - (-2) - 0.5 / 2 = 0.75; loss = -log sigma(2 x 0.75) = log(1 + e^-1.5) = 0.20141
    loss, rc, rr, odds = reference_free_loss(pc, pr, lc, lr, 2.0, "simpo", simpo_gamma=0.5)
    assert loss.item() == pytest.approx(softplus(-1.5), abs=1e-12) and odds is None
    assert (rc.item(), rr.item()) == (-2.0, -4.0)  # beta x the averages
    # cpo: d = -2 - (-6) = 4 on the sums; loss = -log sigma(8); with eps 0.1: -0.9 log sigma(8) - 0.1 log sigma(-8)
    loss, rc, _, _ = reference_free_loss(pc, pr, lc, lr, 2.0, "cpo", label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.9 * softplus(-8) + 0.1 * softplus(8), abs=1e-12) and rc.item() == -4.0
    # orpo: log odds(y) = a - log(1 - e^a): chosen -1 - log(1 - e^-1) = -0.54132, rejected -2 - log(1 - e^-2) =
    # -1.85459; ratio l = 1.31326; loss = -beta log sigma(l) = 2 log(1 + e^-l)
    loss, _, _, odds = reference_free_loss(pc, pr, lc, lr, 2.0, "orpo")
    l_odds = (-1 - math.log(1 - math.exp(-1))) - (-2 - math.log(1 - math.exp(-2)))
    assert odds.item() == pytest.approx(l_odds, abs=1e-12) and l_odds == pytest.approx(1.31326, abs=1e-5)
    assert loss.item() == pytest.approx(2 * softplus(-l_odds), abs=1e-12)
    # the stable log(1 - e^a) holds near 0 (log odds -a - log(-a) ~ 27.63 at a = -1e-12) and far below it (~ a),
    # where the naive log1p(-exp(a)) rounds: the ratio is 27.63 + 50
    odds = reference_free_loss(t(-1e-12), t(-50.0), t(1.0), t(1.0), 1.0, "orpo")[3]
    assert odds.item() == pytest.approx(50.0 - math.log(1e-12), rel=1e-6)
    with pytest.raises(ConfigError, match="unknown reference-free loss"):
        reference_free_loss(pc, pr, lc, lr, 1.0, "dpo")


def test_cpo_hinge_ipo_and_alphapo_worked_numbers():
    # the same pair: sums -2 / -6 (d = 4), averages -1 / -2 (d = 1)
    pc, pr, lc, lr = t(-2.0), t(-6.0), t(2.0), t(3.0)
    loss, rc, _, _ = reference_free_loss(pc, pr, lc, lr, 0.1, "cpo_hinge")  # max(0, 1 - 0.1 x 4)
    assert loss.item() == pytest.approx(0.6, abs=1e-6) and rc.item() == pytest.approx(-0.2)  # beta x the sum
    assert reference_free_loss(pc, pr, lc, lr, 0.5, "cpo_hinge")[0].item() == 0.0  # margin met: no loss
    loss, rc, _, _ = reference_free_loss(pc, pr, lc, lr, 2.0, "cpo_ipo")  # (1 - 1 / (2 x 2))^2 on the averages
    assert loss.item() == pytest.approx(0.5625, abs=1e-6) and rc.item() == -2.0
    # AlphaPO, alpha 0.5, simpo (beta 2, gamma 0.5) on the averages: r = (1 - e^(0.5 x 1)) / 0.5 = -1.29744,
    # r' = (1 - e^1) / 0.5 = -3.43656; d = 2.13912 - 0.25; loss -log sigma(2 d) = 0.0226
    loss, rc, rr, _ = reference_free_loss(pc, pr, lc, lr, 2.0, "simpo", simpo_gamma=0.5, alpha=0.5)
    r_c, r_r = (1 - math.exp(0.5)) / 0.5, (1 - math.e) / 0.5
    assert loss.item() == pytest.approx(softplus(-2.0 * (r_c - r_r - 0.25)), abs=1e-6) and loss.item() == pytest.approx(
        0.0226, abs=1e-4)
    assert (rc.item(), rr.item()) == (pytest.approx(2.0 * r_c), pytest.approx(2.0 * r_r))
    # alpha -> 0 gives the log-probs back
    near = reference_free_loss(pc, pr, lc, lr, 2.0, "simpo", alpha=1e-6)[0]
    assert near.item() == pytest.approx(reference_free_loss(pc, pr, lc, lr, 2.0, "simpo")[0].item(), abs=1e-5)
    for name in ("orpo", "cpo"):  # summed log-probs: p^-alpha overflows on real completions
        with pytest.raises(ConfigError, match=f"AlphaPO's alpha=0.5 applies to simpo, cpo_ipo, not {name}"):
            reference_free_loss(pc, pr, lc, lr, 1.0, name, alpha=0.5)


@pytest.mark.parametrize("loss_type, alpha", [("sigmoid", 0.0), ("hinge", 0.0), ("ipo", 0.0), ("simpo", 0.0),
                                             ("ipo", 0.3), ("simpo", 0.3)])
def test_cpo_losses_equal_trls_cpo_loss(loss_type, alpha):
    # TRL's own CPOTrainer.cpo_loss on the log-probs it would read (sums for sigmoid / hinge, averages for ipo /
    # simpo): tiller's loss and rewards equal its
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    g = torch.Generator().manual_seed(0)
    sums_c, sums_r = -torch.rand(6, generator=g, dtype=torch.float64) * 8, -torch.rand(6, generator=g,
                                                                                      dtype=torch.float64) * 8
    lc, lr = torch.randint(1, 9, (6,), generator=g).double(), torch.randint(1, 9, (6,), generator=g).double()
    averaged = loss_type in ("ipo", "simpo")
    trainer = type("T", (), {"alpha": alpha, "beta": 0.2, "label_smoothing": 0.1 if loss_type == "sigmoid" else 0.0,
                             "loss_type": loss_type, "simpo_gamma": 0.7,
                             "accelerator": type("A", (), {"device": "cpu"})()})()
    want = cpo.CPOTrainer.cpo_loss(trainer, sums_c / lc if averaged else sums_c, sums_r / lr if averaged else sums_r)
    name = {"sigmoid": "cpo", "hinge": "cpo_hinge", "ipo": "cpo_ipo", "simpo": "simpo"}[loss_type]
    got = reference_free_loss(sums_c, sums_r, lc, lr, 0.2, name, trainer.label_smoothing, 0.7, alpha)
    for a, b in zip(got[:3], want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_kto_worked_numbers():
    # logratio r = [-1 + 1.5, -2 + 1.5] = [0.5, -0.5]; z = 0.2; beta 0.5
    # desirable: 1 - sigma(0.5 (0.5 - 0.2)) = 1 - sigma(0.15) = 0.462570
    # undesirable (w 1.33): 1.33 (1 - sigma(0.5 (0.2 + 0.5))) = 1.33 (1 - sigma(0.35)) = 1.33 * 0.413382 = 0.549798
    loss, met = kto_loss(t(-1.0, -2.0), t(-1.5, -1.5), torch.tensor([True, False]), t(0.2), beta=0.5, undesirable_weight=1.33)
    ref.assert_close(loss, [0.462570, 0.549798], atol=1e-6)
    assert met["kl"].item() == pytest.approx(0.2)
    assert met["rewards_chosen_sum"].item() == pytest.approx(0.25) and met["num_chosen"].item() == 1
    assert met["rewards_rejected_sum"].item() == pytest.approx(-0.25) and met["num_rejected"].item() == 1
    # a negative KL estimate is clamped at 0, and no gradient flows into it
    z = t(-1.0).requires_grad_(True)
    loss, met = kto_loss(t(-1.0), t(-1.0), torch.tensor([True]), z, beta=1.0)
    assert met["kl"].item() == 0.0 and loss.item() == pytest.approx(0.5)
    assert not loss.requires_grad


def test_pairwise_rm_loss_worked_numbers():
    # -log sigma(2 - 1) = softplus(-1) = 0.313262 ; with margin 0.5: softplus(-0.5) = 0.474077
    c, r = t(2.0, 2.0), t(1.0, 1.0)
    ref.assert_close(pairwise_rm_loss(c, r), [0.313262, 0.313262], atol=1e-6)
    ref.assert_close(pairwise_rm_loss(c, r, margin=t(0.5, 0.0)), [0.474077, 0.313262], atol=1e-6)
    ref.assert_close(pairwise_rm_loss(c, r, kind="logexp"), pairwise_rm_loss(c, r), atol=1e-15)
    # extreme score gaps stay finite: softplus(-1e4) = 0, softplus(1e4) = 1e4
    ref.assert_close(pairwise_rm_loss(t(1e4, -1e4), t(0.0, 0.0), kind="logexp"), [0.0, 1e4], atol=1e-9)
    with pytest.raises(ConfigError, match="sigmoid, logexp"):
        pairwise_rm_loss(c, r, kind="hinge")


def test_diversity_worked_numbers():
    # group 0: classes [a, a, b, c], n = 4 -> (4 - |class|) / 3 = [2/3, 2/3, 1, 1]
    # group 1: a singleton -> 1 by convention ; group 2: all alike [x, x, x] -> 0
    # the same class label "a" in group 2's position means nothing across groups
    classes = ["a", "a", "b", "c", "a", "x", "x", "x"]
    groups = [0, 0, 0, 0, 1, 2, 2, 2]
    div = diversity_from_partition(classes, groups)
    ref.assert_close(div, [2 / 3, 2 / 3, 1, 1, 1, 0, 0, 0], atol=1e-7)
    # all distinct -> 1 everywhere
    ref.assert_close(diversity_from_partition([0, 1, 2], ["p", "p", "p"]), [1, 1, 1])


def test_diversity_matches_pairwise_loop():
    g = np.random.default_rng(0)
    classes = g.integers(0, 3, size=40).tolist()
    groups = g.integers(0, 6, size=40).tolist()
    expected = []
    for i in range(40):
        peers = [j for j in range(40) if groups[j] == groups[i] and j != i]
        expected.append(1.0 if not peers else sum(classes[j] != classes[i] for j in peers) / len(peers))
    ref.assert_close(diversity_from_partition(classes, groups), expected, atol=1e-6)


def test_fuse_diversity_worked_numbers():
    quality = t(1.0, 0.0, 1.0, 1.0)
    div = t(2 / 3, 2 / 3, 1.0, 0.5)
    groups = [0, 0, 1, 1]
    # multiplicative (paper): quality * Div
    ref.assert_close(fuse_diversity(quality, div, groups), [2 / 3, 0.0, 1.0, 0.5])
    # additive, weight 0.5: quality + 0.5 Div
    ref.assert_close(fuse_diversity(quality, div, groups, mode="additive", weight=0.5), [4 / 3, 1 / 3, 1.5, 1.25])
    # group_max: group 0 max 2/3 -> [1, 1]; group 1 max 1 -> [1, 0.5]
    ref.assert_close(fuse_diversity(quality, div, groups, normalization="group_max"), [1.0, 0.0, 1.0, 0.5])
    # a collapsed group (all Div 0) stays at 0 with group_max, never NaN
    ref.assert_close(fuse_diversity(t(1.0, 1.0), t(0.0, 0.0), [0, 0], normalization="group_max"), [0.0, 0.0])
    with pytest.raises(ConfigError, match="multiplicative, additive"):
        fuse_diversity(quality, div, groups, mode="max")
    with pytest.raises(DataError):
        fuse_diversity(quality, div[:2], groups)


def test_masked_helpers_worked_numbers():
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), 6.0]], dtype=D)
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]], dtype=D)
    # valid values [1, 2, 3, 6]: mean 3; unbiased var = (4 + 1 + 0 + 9) / 3 = 14/3
    assert masked_mean(x, m).item() == pytest.approx(3.0)
    ref.assert_close(masked_mean(x, m, dim=-1), [1.5, 4.5])
    assert masked_var(x, m).item() == pytest.approx(14 / 3)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(3.5)
    w = masked_whiten(x, m)
    ref.assert_close(w, [[-2 / math.sqrt(14 / 3), -1 / math.sqrt(14 / 3), 0.0], [0.0, 0.0, 3 / math.sqrt(14 / 3)]], atol=1e-8)
    # shift_mean=False keeps the mean: (x - 3) / std + 3
    assert masked_whiten(x, m, shift_mean=False)[0, 0].item() == pytest.approx(-2 / math.sqrt(14 / 3) + 3, abs=1e-8)
    # one valid element: var 0, whitened 0 ; none: mean 0
    one = torch.tensor([[5.0, 7.0]], dtype=D)
    assert masked_whiten(one, torch.tensor([[1.0, 0.0]], dtype=D)).abs().sum().item() == 0.0
    assert masked_mean(one, torch.zeros(1, 2)).item() == 0.0


def test_group_ids_forms():
    ids, g = group_ids(["b", "a", "b", "c"])
    assert g == 3 and ids.tolist() == [1, 0, 1, 2]
    ids, g = group_ids(np.array(["x", 3, "x"], dtype=object))
    assert g == 2 and ids[0] == ids[2] != ids[1]
    ids, g = group_ids(torch.tensor([7, 7, 2]))
    assert g == 2 and Counter(ids.tolist()) == Counter({1: 2, 0: 1})
    with pytest.raises(DataError, match="1-D"):
        group_ids(np.zeros((2, 2)))


@pytest.mark.parametrize("loss_type,kw,want", [
    # r_c = pi_c - ref_c = 1, r_r = -1, d = r_c - r_r = 2, beta 0.5 (TRL 1.16's formulas, by hand)
    ("nca_pair", {}, softplus(-0.5) + 0.5 * softplus(0.5) + 0.5 * softplus(-0.5)),  # 1.198154
    ("bco_pair", {}, 2 * softplus(-0.5)),  # -log s(beta r_c) - log s(-beta r_r) = 0.948154
    ("sppo_hard", {}, 0.0),  # (r_c - 1/(2 beta))^2 + (r_r + 1/(2 beta))^2 = 0 + 0
    ("apo_zero", {}, 1 - 1 / (1 + math.exp(-0.5)) + 1 / (1 + math.exp(0.5))),  # 0.755081
    ("apo_down", {}, 1 / (1 + math.exp(-0.5)) + 1 - 1 / (1 + math.exp(-1.0))),  # 0.891401
    ("discopop", {"discopop_tau": 0.05}, 0.367879),  # sigma(1 / 0.05) ~ 1: exp(-beta d) = e^-1
    ("exo_pair", {"label_smoothing": 1e-3}, 1.276310),  # KL(sigma(+-1) || (0.999, 0.001))
    ("sigmoid", {"f_divergence": "forward_kl"}, 0.269078),  # s = 1 - 1/t: d = (1 - e^-1) - (1 - e) = 2.350402
    ("hinge", {"f_divergence": "js_divergence"}, 0.5),  # s = log 2 + log s(r): d = 1.0, relu(1 - 0.5)
    ("sigmoid_norm", {}, softplus(-0.375)),  # lengths 2 and 4: d' = 1/2 + 1/4 = 0.75
])
def test_trls_other_dpo_losses_worked_numbers(loss_type, kw, want):
    lengths = dict(chosen_lengths=torch.tensor([2.0]), rejected_lengths=torch.tensor([4.0]))
    loss, cr, rr = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5, loss_type=loss_type, **lengths, **kw)
    assert loss.item() == pytest.approx(want, abs=2e-6)
    assert (cr.item(), rr.item()) == pytest.approx((0.5, -0.5))


def test_aot_sorts_the_batch_and_f_divergences_are_limited_to_trls_losses():
    pc, pr, rc, rr = t(-1.0, -4.0), t(-3.0, -1.0), t(-2.0, -2.0), t(-2.0, -2.0)
    # one pair: aot is sigmoid-with-eps on its own margin
    one, _, _ = dpo_loss(pc[:1], pr[:1], rc[:1], rr[:1], beta=0.5, loss_type="aot", label_smoothing=0.1)
    sig, _, _ = dpo_loss(pc[:1], pr[:1], rc[:1], rr[:1], beta=0.5, label_smoothing=0.1)
    assert one.item() == pytest.approx(sig.item())
    # two pairs: the sorted policy margins (-3, 2) against the sorted reference margins (0, 0), not pairwise
    two, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="aot")
    assert two.tolist() == pytest.approx([softplus(1.5), softplus(-1.0)])
    with pytest.raises(ConfigError, match="applies to sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust, discopop"):
        dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="bco_pair", f_divergence="js_divergence")
    with pytest.raises(ConfigError, match="exo_pair' needs label_smoothing > 0"):
        dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="exo_pair")


def test_token_masks_worked_numbers():
    from tiller.algos.token_masks import high_entropy_mask, off_policy_sequence_mask

    entropy = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.7, 0.2, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])  # the 9.0s are padding: never counted or kept
    # valid entropies sorted: 0.1 0.2 0.3 0.5 0.7 0.9; the 0.5 quantile (top half) interpolates to 0.4
    assert high_entropy_mask(entropy, mask, 0.5).tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    # top 0.2: the 0.8 quantile sits at position 0.8 * 5 = 4.0 of the 6 sorted values: 0.7; tokens >= 0.7
    assert high_entropy_mask(entropy, mask, 0.2).tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    assert high_entropy_mask(entropy, torch.zeros_like(mask), 0.5).sum() == 0
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    behaviour = torch.tensor([[-0.5, -0.5], [-0.5, float("nan")], [-0.9, -0.9]])  # mean KL 0.5, 0.25 (NaN -> 0), 0.1
    adv = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    keep = off_policy_sequence_mask(adv, logp, behaviour, torch.ones(3, 2), threshold=0.2)
    assert keep.squeeze(-1).tolist() == [0.0, 0.0, 1.0]
    keep = off_policy_sequence_mask(-adv, logp, behaviour, torch.ones(3, 2), threshold=0.2)  # positive: all kept
    assert keep.squeeze(-1).tolist() == [1.0, 1.0, 1.0]
