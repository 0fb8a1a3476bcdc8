"""Rollout correction (TIS weights, rejection masks) and the rollout-vs-actor mismatch metrics, worked numbers."""

import math

import pytest
import torch

from tiller.algos.rollout_correction import (
    merge_mismatch_sums,
    mismatch_metrics,
    mismatch_sums,
    offpolicy_metrics,
    parse_is_threshold,
    parse_rs_options,
    rollout_correction,
    rollout_mismatch_metrics,
)
from tiller.errors import ConfigError

D = torch.float64
# p_old and p_rollout of 4 tokens laid out as 2 rows x 2 tokens: ratios r = p_old / p_rollout = [[2, 0.5], [3, 1.2]]
P_OLD = torch.tensor([[0.5, 0.2], [0.9, 0.6]], dtype=D)
P_ROLL = torch.tensor([[0.25, 0.4], [0.3, 0.5]], dtype=D)
MASK = torch.ones(2, 2, dtype=torch.long)


def _correct(**hyper):
    return rollout_correction(P_OLD.log(), P_ROLL.log(), MASK, **hyper)


def test_off_by_default_is_identity_with_diagnostics():
    weights, mask, metrics = _correct()
    assert torch.equal(weights, torch.ones(2, 2)) and torch.equal(mask, MASK)
    # kl = mean(log p_roll - log p_old) = -mean(log r) = -(ln2 - ln2 + ln3 + ln1.2) / 4 = -(1.098612 + 0.182322) / 4
    assert float(metrics["kl"]) == pytest.approx(-0.320234, abs=1e-5)
    # chi2_token = mean(r^2) - 1 = (4 + 0.25 + 9 + 1.44) / 4 - 1 = 2.6725
    assert float(metrics["chi2_token"]) == pytest.approx(2.6725, rel=1e-5)
    # k3 = mean(r - 1 - ln r) = (0.306853 + 0.193147 + 0.901388 + 0.017678) / 4 = 0.354767
    assert float(metrics["k3_kl"]) == pytest.approx(0.354767, abs=1e-5)
    assert not any(k.startswith(("rollout_is", "rollout_rs")) for k in metrics)


def test_token_tis_caps_the_ratio():
    weights, mask, m = _correct(rollout_is="token", rollout_is_threshold=2.5)
    # min(r, 2.5): [[2, 0.5], [2.5, 1.2]]
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5], [2.5, 1.2]]), rtol=1e-5, atol=0)
    assert torch.equal(mask, MASK) and not weights.requires_grad
    assert float(m["rollout_is_ratio_fraction_high"]) == pytest.approx(0.25)  # 3 > 2.5
    assert float(m["rollout_is_ratio_fraction_low"]) == 0.0  # none below 1/2.5 = 0.4
    # verl's mean / max / min are of the applied (capped) weights: mean (2 + 0.5 + 2.5 + 1.2) / 4 = 1.55
    assert float(m["rollout_is_mean"]) == pytest.approx(1.55, rel=1e-5)
    assert float(m["rollout_is_max"]) == pytest.approx(2.5, rel=1e-5)
    assert float(m["rollout_is_min"]) == pytest.approx(0.5, rel=1e-5)
    # std of the capped weights: mean(w^2) = (4 + 0.25 + 6.25 + 1.44) / 4 = 2.985, minus 1.55^2 -> sqrt(0.5825)
    assert float(m["rollout_is_std"]) == pytest.approx(math.sqrt(0.5825), rel=1e-5)
    # ESS of the capped weights w = [2, 0.5, 2.5, 1.2]: mean 1.55, mean((w / 1.55)^2) = 11.94 / 4 / 2.4025
    assert float(m["rollout_is_eff_sample_size"]) == pytest.approx(4 * 2.4025 / 11.94, rel=1e-5)


def test_sequence_tis_and_batch_normalisation():
    weights, _, m = _correct(rollout_is="sequence", rollout_is_threshold=2.5)
    # row products: 2 * 0.5 = 1.0 ; 3 * 1.2 = 3.6 -> capped at 2.5, on every token of the row
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0], [2.5, 2.5]]), rtol=1e-5, atol=0)
    assert float(m["rollout_is_ratio_fraction_high"]) == pytest.approx(0.5)  # one row of two
    weights, _, m = _correct(rollout_is="sequence", rollout_is_threshold=2.5, rollout_is_batch_normalize=True)
    # mean over rows (1.0 + 2.5) / 2 = 1.75 -> [1 / 1.75, 2.5 / 1.75]
    torch.testing.assert_close(weights, torch.tensor([[1 / 1.75] * 2, [2.5 / 1.75] * 2]), rtol=1e-5, atol=0)
    assert float(m["rollout_is_batch_norm_factor"]) == pytest.approx(1.75, rel=1e-5)
    weights, _, _ = _correct(rollout_is="token", rollout_is_threshold=2.5, rollout_is_batch_normalize=True)
    # token mean of [2, 0.5, 2.5, 1.2] = 1.55
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5], [2.5, 1.2]]) / 1.55, rtol=1e-5, atol=0)


def test_token_k1_bounds_verls_inverse_ratio():
    # verl's k1 = -log r: "lo_hi" bounds q = p_rollout / p_old = 1 / r = [[0.5, 2], [1/3, 0.8333]]
    # (rollout_corr_helper.compute_rollout_rejection_mask: keep log lo <= -log r <= log hi).
    # [0.6, 2.5] rejects q = 0.5 (r = 2) and q = 1/3 (r = 3), keeps q = 2 (r = 0.5) and q = 0.8333.
    weights, mask, m = _correct(rollout_rs="token_k1", rollout_rs_threshold="0.6_2.5")
    assert mask.tolist() == [[0, 1], [0, 1]] and mask.dtype == MASK.dtype
    assert weights.tolist() == [[0.0, 1.0], [0.0, 1.0]]  # no TIS: 1 on kept tokens, 0 on rejected ones
    # the k1 statistic reported is verl's -log r: mean(-ln2 + ln2 - ln3 - ln1.2) / 4 = -(1.098612 + 0.182322) / 4
    assert float(m["rollout_rs_token_k1_mean"]) == pytest.approx(-0.320234, abs=1e-5)
    assert float(m["rollout_rs_masked_fraction"]) == 0.5
    assert float(m["rollout_rs_seq_masked_fraction"]) == 1.0  # both rows lost a token
    # a float threshold h means [1/h, h], the same interval for both orientations: 2.1 keeps q in [0.476, 2.1]
    # -> only q = 1/3 (r = 3) is rejected
    _, mask, _ = _correct(rollout_rs="token_k1", rollout_rs_threshold=2.1)
    assert mask.tolist() == [[1, 1], [0, 1]]


def test_asymmetric_k1_bounds_follow_verl():
    # issue 38's case: "0.6_1.6" and a token with r = p_old / p_rollout = 1.644 (p_old 0.822, p_rollout 0.5):
    # verl keeps it (q = 1 / 1.644 = 0.608 in [0.6, 1.6]); bounding r itself would reject it (1.644 > 1.6).
    # A token with r = 0.61 (q = 1.639 > 1.6) is rejected by verl's reading, kept by the other.
    old = torch.tensor([[0.822, 0.305]], dtype=D).log()
    roll = torch.tensor([[0.5, 0.5]], dtype=D).log()
    _, mask, _ = rollout_correction(old, roll, torch.ones(1, 2), rollout_rs="token_k1", rollout_rs_threshold="0.6_1.6")
    assert mask.tolist() == [[1.0, 0.0]]
    # the reciprocal bounds 1/1.6 _ 1/0.6 select on r in [0.6, 1.6] instead
    _, mask, _ = rollout_correction(old, roll, torch.ones(1, 2), rollout_rs="token_k1",
                                    rollout_rs_threshold=f"{1 / 1.6}_{1 / 0.6}")
    assert mask.tolist() == [[0.0, 1.0]]
    # seq_sum_k1 bounds prod q: row q = 0.608 * 1.639 = 0.997 is kept by [0.9, 1.1]
    _, mask, _ = rollout_correction(old, roll, torch.ones(1, 2), rollout_rs="seq_sum_k1", rollout_rs_threshold="0.9_1.1")
    assert mask.tolist() == [[1.0, 1.0]]


def test_icepop_zeroes_weights_outside_the_bounds_and_keeps_the_mask():
    # rollout_is_threshold="lo_hi" (verl's IcePop): r = [[2, 0.5], [3, 1.2]], [0.5, 2.0] keeps 2, 0.5 and 1.2
    # (bounds inclusive) and sets the weight of r = 3 to 0; the mask is unchanged (the token still counts).
    weights, mask, m = _correct(rollout_is="token", rollout_is_threshold="0.5_2.0")
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5], [0.0, 1.2]]), rtol=1e-5, atol=0)
    assert torch.equal(mask, MASK)
    assert float(m["rollout_is_oob_ratio"]) == 0.25
    assert float(m["rollout_is_mean"]) == pytest.approx((2 + 0.5 + 0 + 1.2) / 4, rel=1e-5)
    assert float(m["rollout_is_min"]) == 0.0
    # sequence level: row products 1.0 and 3.6; "0.5_2.0" zeroes row 1, keeps row 0 at 1.0
    weights, mask, m = _correct(rollout_is="sequence", rollout_is_threshold="0.5_2.0")
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0], [0.0, 0.0]]), rtol=1e-5, atol=0)
    assert torch.equal(mask, MASK) and float(m["rollout_is_oob_ratio"]) == 0.5
    # a plain string float is TIS, as verl ("2.5" == 2.5)
    torch.testing.assert_close(_correct(rollout_is="token", rollout_is_threshold="2.5")[0],
                               _correct(rollout_is="token", rollout_is_threshold=2.5)[0])
    for bad in ("2_1", "abc", "0_2", "-1", True):
        with pytest.raises(ConfigError, match="rollout_is_threshold"):
            parse_is_threshold(bad)
    assert parse_is_threshold("0.5_2.0") == (2.0, 0.5) and parse_is_threshold(3) == (3.0, None)


def test_sequence_options_reject_whole_rows():
    # seq_sum_k1: row ratios 1.0 and 3.6; [0.5, 2] rejects row 1
    _, mask, _ = _correct(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0")
    assert mask.tolist() == [[1, 1], [0, 0]]
    # seq_mean_k1: geometric means 1.0 and sqrt(3.6) = 1.897; hi 1.8 rejects row 1, hi 1.95 keeps it
    assert _correct(rollout_rs="seq_mean_k1", rollout_rs_threshold=1.8)[1].tolist() == [[1, 1], [0, 0]]
    assert _correct(rollout_rs="seq_mean_k1", rollout_rs_threshold=1.95)[1].tolist() == [[1, 1], [1, 1]]
    # k3 = r - 1 - ln r: [[0.3069, 0.1931], [0.9014, 0.0177]]; seq_max 0.3069 / 0.9014 -> 0.5 rejects row 1
    _, mask, m = _correct(rollout_rs="seq_max_k3", rollout_rs_threshold=0.5)
    assert mask.tolist() == [[1, 1], [0, 0]]
    assert float(m["rollout_rs_seq_max_k3_max"]) == pytest.approx(0.901388, abs=1e-5)
    # k2 = 0.5 ln(r)^2: [[0.2402, 0.2402], [0.6035, 0.0166]]; token_k2 <= 0.3 rejects the 3
    assert _correct(rollout_rs="token_k2", rollout_rs_threshold=0.3)[1].tolist() == [[1, 1], [0, 1]]
    # seq_mean_k2: (0.2402 + 0.2402) / 2 = 0.2402 and (0.6035 + 0.0166) / 2 = 0.3101; 0.3 rejects row 1
    assert _correct(rollout_rs="seq_mean_k2", rollout_rs_threshold=0.3)[1].tolist() == [[1, 1], [0, 0]]


def test_combined_options_and_tis():
    # token_k2 <= 0.5 rejects the 3 (k2 0.6035); seq_sum_k1 in [0.5, 2] then also drops row 1 (product 3.6)
    weights, mask, m = _correct(rollout_is="token", rollout_is_threshold=2.5, rollout_rs="token_k2,seq_sum_k1",
                                rollout_rs_threshold="0.5,0.5_2.0")
    assert mask.tolist() == [[1, 1], [0, 0]]
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5], [0.0, 0.0]]), rtol=1e-5, atol=0)
    assert float(m["rollout_rs_token_k2_masked_fraction"]) == 0.25
    assert float(m["rollout_rs_seq_sum_k1_masked_fraction"]) == 0.5
    assert float(m["rollout_rs_masked_fraction"]) == 0.5


def test_padding_never_leaks():
    old = torch.tensor([[math.log(0.5), float("nan")], [math.log(0.9), float("-inf")]])
    roll = torch.tensor([[math.log(0.25), 0.0], [math.log(0.3), 5.0]])
    mask = torch.tensor([[1, 0], [1, 0]])
    weights, new_mask, m = rollout_correction(old, roll, mask, rollout_is="sequence", rollout_is_threshold=2.5,
                                              rollout_rs="token_k1", rollout_rs_threshold="0.4_2.5")
    assert new_mask.tolist() == [[1, 0], [0, 0]]  # q = 1 / r: 0.5 kept, 1/3 rejected; padding stays 0
    assert weights.tolist() == [[2.0, 0.0], [0.0, 0.0]]
    assert all(math.isfinite(float(v)) for v in m.values()), m


def test_threshold_parsing_names_the_key():
    assert parse_rs_options("token_k1,seq_max_k2", "0.5_2.0,0.1") == [("token_k1", 0.5, 2.0), ("seq_max_k2", None, 0.1)]
    assert parse_rs_options("token_k1", 4) == [("token_k1", 0.25, 4.0)]
    assert parse_rs_options(None, None) == []
    for rs, threshold, needle in [("token_k9", 2, "unknown option 'token_k9'"), ("token_k1", None, "needs"),
                                  ("token_k1", "2_1", "lo_hi"), ("token_k1", 0.5, "lo_hi"), ("token_k1", "0_1", "lo_hi"),
                                  ("token_k2", "0.1_0.2", "a float > 0"), ("token_k1,token_k2", "1,2,3", "one per")]:
        with pytest.raises(ConfigError, match=needle):
            parse_rs_options(rs, threshold)
    with pytest.raises(ConfigError, match="rollout_is = 'tok'"):
        _correct(rollout_is="tok")


def test_offpolicy_metrics_ppl():
    # row means of log p: old (ln0.5 + ln0.2) / 2 = -1.151293, rollout (ln0.25 + ln0.4) / 2 = -1.151293 (row 0 agrees)
    m = offpolicy_metrics(P_OLD.log(), P_ROLL.log(), MASK)
    # row 1: old (ln0.9 + ln0.6) / 2 = -0.308093, rollout (ln0.3 + ln0.5) / 2 = -0.948550 -> diff -0.640457 / 2 rows
    assert float(m["log_ppl_diff"]) == pytest.approx(-0.640457 / 2, abs=1e-5)
    assert float(m["training_ppl"]) == pytest.approx((math.exp(1.151293) + math.exp(0.308093)) / 2, rel=1e-5)


def test_mismatch_metrics_worked_numbers():
    x, y = P_OLD.reshape(1, 4), P_ROLL.reshape(1, 4)
    m = rollout_mismatch_metrics(x.log(), y.log(), torch.ones(1, 4))
    # |x - y| = [0.25, 0.2, 0.6, 0.1]: mean 0.2875, max 0.6, unbiased std sqrt(0.141875 / 3) = 0.217466
    assert float(m["rollout_probs_diff_mean"]) == pytest.approx(0.2875)
    assert float(m["rollout_probs_diff_max"]) == pytest.approx(0.6)
    assert float(m["rollout_probs_diff_std"]) == pytest.approx(0.217466, abs=1e-6)
    # Pearson: dx = [-0.05, -0.35, 0.35, 0.05], dy = [-0.1125, 0.0375, -0.0625, 0.1375];
    # sum dx dy = -0.0225, sum dx^2 = 0.25, sum dy^2 = 0.036875 -> -0.0225 / sqrt(0.25 * 0.036875) = -0.234340
    assert float(m["rollout_actor_probs_pearson_corr"]) == pytest.approx(-0.234340, abs=1e-6)
    assert float(m["rollout_actor_probs_pearson_corr"]) == pytest.approx(float(torch.corrcoef(torch.cat([x, y]))[0, 1]))


def test_mismatch_sums_merge_exactly_and_ignore_padding():
    g = torch.Generator().manual_seed(0)
    actor = -torch.rand(6, 5, generator=g, dtype=D) * 3
    rollout = actor + torch.randn(6, 5, generator=g, dtype=D) * 0.1
    mask = (torch.arange(5)[None] < torch.tensor([5, 1, 3, 0, 2, 4])[:, None]).long()
    whole = mismatch_metrics(mismatch_sums(actor, rollout, mask))
    parts = [mismatch_sums(actor[i:i + 2], rollout[i:i + 2], mask[i:i + 2]) for i in (0, 2, 4)]
    merged = mismatch_metrics(merge_mismatch_sums(parts))
    for k in whole:
        assert float(merged[k]) == pytest.approx(float(whole[k]), rel=1e-12, abs=1e-15), k
    poisoned = actor.masked_fill(mask == 0, float("nan"))
    assert float(rollout_mismatch_metrics(poisoned, rollout, mask)["rollout_probs_diff_mean"]) == pytest.approx(
        float(whole["rollout_probs_diff_mean"]))
    # identical policies: no difference, perfect correlation
    same = rollout_mismatch_metrics(actor, actor, mask)
    assert float(same["rollout_probs_diff_max"]) == 0.0
    assert float(same["rollout_actor_probs_pearson_corr"]) == pytest.approx(1.0)
