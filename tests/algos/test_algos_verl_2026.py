"""verl's 2026 algorithms: gdpo, the vectorised names, optimal token baseline (single and multi-turn),
dppo_tv / dppo_kl, dro, bypass mode, token-sum, seq-mean counting, SAPO's tau names. Worked numbers."""

import math

import pytest
import torch

import algos_reference as ref
from tiller.algos import aggregate_loss, get_advantage_estimator, get_policy_loss, sum_pi_squared_from_logits
from tiller.algos.aggregate import count_sequences
from tiller.errors import ConfigError, DataError

D = torch.float64
ln = math.log


def leaf(values):
    return torch.tensor(values, dtype=D, requires_grad=True)


def grad_of(name, logp, old, adv, mask, mode="token-sum", **hyper):
    loss, metrics = get_policy_loss(name)(logp, old, adv, mask, **hyper)
    aggregate_loss(loss, mask, mode).backward()
    return loss.detach(), logp.grad, metrics


# ------------------------------------------------------------------------------------- advantages
def test_gdpo_normalises_each_channel_then_whitens():
    # groups a = rows 0, 1 and b = rows 2, 3; T = 2, all tokens valid
    # acc [1, 0 | 0, 1], fmt [0, 1 | 0, 1]: each pair z-scores to +-0.5 / std(0.707107) = +-0.707106
    #   acc z: [+.7071, -.7071 | -.7071, +.7071]; fmt z: [-.7071, +.7071 | -.7071, +.7071]
    #   sum:   [0, 0 | -1.414214, +1.414214]
    # whiten over the 8 tokens: mean 0, unbiased var = 4 * 2 / 7 = 8/7, std 1.069045 -> +-1.322876
    r = torch.zeros(4, 2, dtype=D)
    m = torch.ones(4, 2, dtype=D)
    comps = {"acc": [1.0, 0.0, 0.0, 1.0], "fmt": [0.0, 1.0, 0.0, 1.0], "unused": [5.0, 5.0, 5.0, 5.0]}
    gdpo = get_advantage_estimator("gdpo")
    adv, ret = gdpo(r, m, ["a", "a", "b", "b"], None, reward_components=comps, gdpo_reward_keys=["acc", "fmt"])
    ref.assert_close(adv[:, 0], [0.0, 0.0, -1.322876, 1.322876], atol=1e-5)
    assert torch.equal(adv, ret)
    # weights [1, 0.5]: a: +-(0.7071 - 0.3536) = +-0.353553; b: +-1.060660
    #   whiten: sum of squares 2 * 2 * (0.125 + 1.125) = 5 -> var 5/7, std 0.845154
    #   -> +-0.418330, +-1.254990
    adv, _ = gdpo(r, m, ["a", "a", "b", "b"], None, reward_components=comps, gdpo_reward_keys=["acc", "fmt"],
                  gdpo_reward_weights=[1.0, 0.5])
    ref.assert_close(adv[:, 1], [0.418330, -0.418330, -1.254990, 1.254990], atol=1e-5)
    # summing first (GRPO on acc + fmt) loses group a's signal differently: a = [1, 1] -> 0 as well, but b = [0, 2]
    with pytest.raises(ConfigError, match="one weight per key"):
        gdpo(r, m, [0, 0, 1, 1], None, reward_components=comps, gdpo_reward_keys=["acc"], gdpo_reward_weights=[1, 2])
    with pytest.raises(DataError, match=r"\['len'\] not among"):
        gdpo(r, m, [0, 0, 1, 1], None, reward_components=comps, gdpo_reward_keys=["len"])
    with pytest.raises(ConfigError, match="returned no named scores"):
        gdpo(r, m, [0, 0, 1, 1], None, gdpo_reward_keys=["acc"])


def test_gdpo_without_keys_is_whitened_grpo():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(6, 3, generator=g, dtype=D)
    m = torch.ones(6, 3, dtype=D)
    index = [0, 0, 0, 1, 1, 1]
    grpo, _ = get_advantage_estimator("grpo")(r, m, index, None)
    gdpo, _ = get_advantage_estimator("gdpo")(r, m, index, None)
    ref.assert_close(gdpo, ref.whiten(grpo.tolist(), m.tolist()), atol=1e-9)


def test_grpo_vectorized_floors_the_variance():
    # group x: [1, 0, 1, 0] -> as grpo, +-0.866025; group y: [0, 1e-4]: var 5e-9 < eps = 1e-6 is floored:
    #   std = sqrt(1e-6) = 1e-3 -> A = +-5e-5 / (1e-3 + 1e-6) = +-0.0499500 (grpo: +-5e-5 / 7.0711e-5 = +-0.697246)
    # group z: singleton 2 -> 2 / (1 + 1e-6)
    scores = [1, 0, 1, 0, 0, 1e-4, 2]
    r = torch.tensor(scores, dtype=D).unsqueeze(-1)
    m = torch.ones_like(r)
    index = ["x"] * 4 + ["y", "y", "z"]
    adv, _ = get_advantage_estimator("grpo_vectorized")(r, m, index, None)
    ref.assert_close(adv[:, 0], [0.866025, -0.866025, 0.866025, -0.866025, -0.0499500, 0.0499500, 2.0], atol=1e-5)
    plain, _ = get_advantage_estimator("grpo")(r, m, index, None)
    assert plain[5, 0].item() == pytest.approx(0.697246, abs=1e-5)
    dr, _ = get_advantage_estimator("grpo_vectorized")(r, m, index, None, norm_adv_by_std_in_grpo=False)
    ref.assert_close(dr[:, 0], [0.5, -0.5, 0.5, -0.5, -5e-5, 5e-5, 2.0], atol=1e-12)


def test_rloo_vectorized_singleton_is_zero():
    # [3, 1, 2]: s_i - mean(others) = [1.5, -1.5, 0]; the singleton 7 gets 0 (rloo keeps 7)
    r = torch.tensor([[3.0], [1.0], [2.0], [7.0]], dtype=D)
    m = torch.ones_like(r)
    adv, _ = get_advantage_estimator("rloo_vectorized")(r, m, [0, 0, 0, 1], None)
    ref.assert_close(adv[:, 0], [1.5, -1.5, 0.0, 0.0], atol=1e-12)


def _otb_inputs():
    # group g: two trajectories of 2 tokens, outcome 1 and 0; singleton s: one token, outcome 0.7
    #   traj0: pi = [0.5, 0.5], sum pi^2 = [0.5, 0.5] -> w = 1 - 2 pi + sum pi^2 = [0.5, 0.5], W = [0.5, 1.0]
    #   traj1: pi = [0.25, 0.5], sum pi^2 = [0.25, 0.5] -> w = [0.75, 0.5], W = [0.75, 1.25]
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.7, 0.0]], dtype=D)
    m = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]], dtype=D)
    old = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.5], [0.5, 1.0]], dtype=D))
    spi2 = torch.tensor([[0.5, 0.5], [0.25, 0.5], [0.5, 1.0]], dtype=D)
    return r, m, ["g", "g", "s"], old, spi2


def test_optimal_token_baseline_worked_numbers():
    r, m, index, old, spi2 = _otb_inputs()
    otb = get_advantage_estimator("optimal_token_baseline")
    adv, ret = otb(r, m, index, None, old_logp=old, sum_pi_squared=spi2)
    # returns G: traj0 [1, 1], traj1 [0, 0], singleton [0.7, 0]
    ref.assert_close(ret, [[1, 1], [0, 0], [0.7, 0]], atol=1e-12)
    # B_0 = (1 * 0.5 + 0 * 0.75) / (0.5 + 0.75) = 0.4 ; B_1 = (1 * 1.0 + 0) / (1.0 + 1.25) = 0.444444
    # singleton: baseline 0 -> A = G
    ref.assert_close(adv, [[0.6, 0.555556], [-0.4, -0.444444], [0.7, 0.0]], atol=1e-6)
    # rollout IS weight 2 on traj1 scales its w by 4: w = [3, 2], W = [3, 5]
    #   B_0 = 0.5 / 3.5 = 0.142857 ; B_1 = 1 / 6 = 0.166667
    rho = torch.tensor([[1.0, 1.0], [2.0, 2.0], [1.0, 1.0]], dtype=D)
    adv, _ = otb(r, m, index, None, old_logp=old, sum_pi_squared=spi2, rollout_is_weights=rho)
    ref.assert_close(adv[:2], [[0.857143, 0.833333], [-0.142857, -0.166667]], atol=1e-6)
    with pytest.raises(ConfigError, match="sum_pi_squared"):
        otb(r, m, index, None, old_logp=old)


def test_optimal_token_baseline_zero_tail():
    # lengths 3 (outcome 1) and 1 (outcome 0), w = 1 - 2 * 0.5 + 1 = 1 per token: W_A = [1, 2, 3], W_B = [1]
    # t = 0: B = (1 * 1 + 0 * 1) / 2 = 0.5 -> A_A = 0.5, A_B = -0.5
    # t = 1, 2: only A has tokens. zero tail: B = 0 -> A = G = 1; without: B = G_A -> A = 0
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=D)
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=D)
    old = torch.full((2, 3), ln(0.5), dtype=D)
    spi2 = torch.ones(2, 3, dtype=D)
    otb = get_advantage_estimator("optimal_token_baseline")
    adv, _ = otb(r, m, [0, 0], None, old_logp=old, sum_pi_squared=spi2)
    ref.assert_close(adv, [[0.5, 1.0, 1.0], [-0.5, 0.0, 0.0]], atol=1e-6)
    adv, _ = otb(r, m, [0, 0], None, old_logp=old, sum_pi_squared=spi2, handle_zero_tail=False)
    ref.assert_close(adv, [[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]], atol=1e-6)


def test_tir_optimal_token_baseline_skips_tool_tokens():
    # traj0's second token is a tool output (mask 0): its generated tokens are positions 0 and 2, compared with
    # traj1's positions 0 and 1; same numbers as the single-turn example
    r, m, index, old, spi2 = _otb_inputs()
    r3 = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.7, 0.0, 0.0]], dtype=D)
    m3 = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=D)
    old3 = torch.log(torch.tensor([[0.5, 0.9, 0.5], [0.25, 0.5, 1.0], [0.5, 1.0, 1.0]], dtype=D))
    spi3 = torch.tensor([[0.5, 0.9, 0.5], [0.25, 0.5, 1.0], [0.5, 1.0, 1.0]], dtype=D)
    adv, ret = get_advantage_estimator("tir_optimal_token_baseline")(r3, m3, index, None, old_logp=old3,
                                                                       sum_pi_squared=spi3)
    ref.assert_close(adv, [[0.6, 0.0, 0.555556], [-0.4, -0.444444, 0.0], [0.7, 0.0, 0.0]], atol=1e-6)
    assert ret[0, 0].item() == pytest.approx(1.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_tir_equals_otb_on_contiguous_masks(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 10, 6
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    m = (torch.arange(T)[None] < lengths[:, None]).to(D)
    r = torch.zeros(B, T, dtype=D)
    r[torch.arange(B), lengths - 1] = torch.rand(B, generator=g, dtype=D)
    logits = torch.randn(B, T, 5, generator=g, dtype=D)
    old = torch.log_softmax(logits, -1)[..., 0]
    spi2 = sum_pi_squared_from_logits(logits).to(D)
    index = [i // 3 for i in range(B)]
    a, ra = get_advantage_estimator("optimal_token_baseline")(r, m, index, None, old_logp=old, sum_pi_squared=spi2)
    b, rb = get_advantage_estimator("tir_optimal_token_baseline")(r, m, index, None, old_logp=old, sum_pi_squared=spi2)
    ref.assert_close(b, a.tolist(), atol=1e-9)
    ref.assert_close(rb, ra.tolist(), atol=1e-12)


def test_sum_pi_squared_from_logits():
    # logits [0, ln 3]: p = [0.25, 0.75] -> 0.0625 + 0.5625 = 0.625 ; uniform over 4 -> 0.25
    logits = torch.tensor([[[0.0, ln(3.0)], [0.0, 0.0]]])
    assert sum_pi_squared_from_logits(logits)[0, 0].item() == pytest.approx(0.625)
    assert sum_pi_squared_from_logits(torch.zeros(1, 1, 4))[0, 0].item() == pytest.approx(0.25)


# ---------------------------------------------------------------------------------- policy losses
def test_dppo_tv_worked_numbers():
    # p_old = 0.5 everywhere, threshold 0.15 (clip_ratio), c = 3
    #  t0 A=+1 p=0.6: diff +0.1 <= 0.15 valid; loss = -1 * r(1.2) * ln 0.6 = 0.612991; grad -1.2
    #  t1 A=+1 p=0.8: diff +0.3 > 0.15 masked (no grad)
    #  t2 A=-1 p=0.4: diff -0.1 >= -0.15 valid; loss = +0.8 * ln 0.4 = -0.733033; grad +0.8
    #  t3 A=-1 p=0.2: diff -0.3 < -0.15 masked
    old = torch.full((1, 4), ln(0.5), dtype=D)
    logp = leaf([[ln(0.6), ln(0.8), ln(0.4), ln(0.2)]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=D)
    mask = torch.ones(1, 4, dtype=D)
    loss, grad, met = grad_of("dppo_tv", logp, old, adv, mask, clip_ratio=0.15, clip_ratio_c=3.0)
    ref.assert_close(loss, [[0.612991, 0.0, -0.733033, 0.0]], atol=1e-6)
    ref.assert_close(grad, [[-1.2, 0.0, 0.8, 0.0]], atol=1e-12)
    assert met["pg_clipfrac"].item() == pytest.approx(0.5)
    assert met["pg_clipfrac_lower"].item() == 0.0
    # a ratio above c is truncated: p_old 0.1 -> p 0.5 (r = 5 > c = 3), A = +1, threshold 0.5 keeps it valid
    logp = leaf([[ln(0.5)]])
    _, grad, met = grad_of("dppo_tv", logp, torch.tensor([[ln(0.1)]], dtype=D), torch.ones(1, 1, dtype=D),
                           torch.ones(1, 1, dtype=D), clip_ratio=0.5, clip_ratio_c=3.0)
    assert grad.item() == pytest.approx(-3.0) and met["pg_clipfrac_lower"].item() == 1.0


def test_dppo_kl_worked_numbers():
    # binary KL from p_old = 0.5: p = 0.6 or 0.4 -> 0.5 ln(0.5/0.6) + 0.5 ln(0.5/0.4) = 0.020411
    #                             p = 0.8 or 0.2 -> 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.223144; threshold 0.05
    #  A>0: p 0.6 valid (KL small); p 0.8 masked (KL big, moved up); p 0.3 valid (moved against A: always kept)
    #  A<0: p 0.4 valid; p 0.2 masked (moved down too far); p 0.9 valid (moved against A)
    old = torch.full((1, 6), ln(0.5), dtype=D)
    probs = [0.6, 0.8, 0.3, 0.4, 0.2, 0.9]
    logp = leaf([[ln(p) for p in probs]])
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]], dtype=D)
    _, grad, met = grad_of("dppo_kl", logp, old, adv, torch.ones(1, 6, dtype=D), clip_ratio=0.05, clip_ratio_c=3.0)
    # grad = -A * min(r, 3) on valid tokens, r = p / 0.5
    ref.assert_close(grad, [[-1.2, 0.0, -0.6, 0.8, 0.0, 1.8]], atol=1e-12)
    assert met["pg_clipfrac"].item() == pytest.approx(2 / 6)


def test_dro_worked_numbers():
    # logp -1, old -1.5 (rho 0.5), A 2, beta 0.1: loss = -(2 * -1 - 0.05 * 0.25) = 2.0125
    # grad = -(A - beta rho) = -(2 - 0.05) = -1.95
    loss, grad, met = grad_of("dro", leaf([[-1.0]]), torch.tensor([[-1.5]], dtype=D), torch.tensor([[2.0]], dtype=D),
                              torch.ones(1, 1, dtype=D), dro_beta=0.1)
    assert loss.item() == pytest.approx(2.0125) and grad.item() == pytest.approx(-1.95)
    assert met["ppo_kl"].item() == pytest.approx(-0.5)
    with pytest.raises(ConfigError, match="dro_beta"):
        get_policy_loss("dro")(loss, loss, loss, loss, dro_beta=0.0)


def test_bypass_mode_ppo_clip_is_vanilla_against_the_rollout_policy():
    g = torch.Generator().manual_seed(3)
    rollout = -torch.rand(3, 5, generator=g, dtype=D)
    logp = rollout + 0.3 * torch.randn(3, 5, generator=g, dtype=D)
    adv = torch.randn(3, 5, generator=g, dtype=D)
    mask = torch.ones(3, 5, dtype=D)
    mask[2, 3:] = 0
    a, ma = get_policy_loss("bypass_mode")(logp, rollout, adv, mask, clip_ratio=0.2)
    b, mb = get_policy_loss("vanilla")(logp, rollout, adv, mask, clip_ratio=0.2)
    assert torch.equal(a, b) and torch.equal(ma["pg_clipfrac"], mb["pg_clipfrac"])
    assert "kl" in ma  # the rollout-correction diagnostics ride along


def test_bypass_mode_reinforce_with_truncated_is_and_rejection():
    # p / p_rollout: t0 0.6 / 0.2 = 3 -> w = min(3, 2) = 2; t1 0.3 / 0.6 = 0.5 -> w = 0.5; A = 1
    # loss = -A w logp -> grad = -w: [-2, -0.5]
    rollout = torch.tensor([[ln(0.2), ln(0.6)]], dtype=D)
    adv = torch.ones(1, 2, dtype=D)
    mask = torch.ones(1, 2, dtype=D)
    hyper = dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold=2.0)
    _, grad, met = grad_of("bypass_mode", leaf([[ln(0.6), ln(0.3)]]), rollout, adv, mask, **hyper)
    ref.assert_close(grad, [[-2.0, -0.5]], atol=1e-12)
    assert met["rollout_is_mean"].item() == pytest.approx(1.25)  # applied weights (2 + 0.5) / 2, as verl
    # rejection: token_k1 keeps p_rollout / p in [0.4, 2.5] (verl's k1 orientation): t0 (1/3) leaves the loss
    _, grad, met = grad_of("bypass_mode", leaf([[ln(0.6), ln(0.3)]]), rollout, adv, mask, rollout_rs="token_k1",
                           rollout_rs_threshold="0.4_2.5", **hyper)
    ref.assert_close(grad, [[0.0, -0.5]], atol=1e-12)
    assert met["rollout_rs_masked_fraction"].item() == pytest.approx(0.5)
    # no IS: plain REINFORCE -A logp
    _, grad, _ = grad_of("bypass_mode", leaf([[ln(0.6), ln(0.3)]]), rollout, adv, mask, loss_type="reinforce")
    ref.assert_close(grad, [[-1.0, -1.0]], atol=1e-12)
    with pytest.raises(ConfigError, match="loss_type"):
        get_policy_loss("bypass_mode")(rollout, rollout, adv, mask, loss_type="ppo")


def test_sapo_tau_names():
    logp, old = torch.tensor([[0.2, -0.1]]), torch.zeros(1, 2)
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    sapo = get_policy_loss("sapo")
    new, _ = sapo(logp, old, adv, mask, tau_pos=2.0, tau_neg=3.0)
    old_names, _ = sapo(logp, old, adv, mask, sapo_tau_pos=2.0, sapo_tau_neg=3.0)
    assert torch.equal(new, old_names)
    # t0: r = e^0.2 = 1.221403, gate = sigmoid(2 * 0.221403) * 4 / 2 = 0.608930 * 2 = 1.217860 -> loss -1.217860
    assert new[0, 0].item() == pytest.approx(-1.217860, abs=1e-5)
    with pytest.raises(TypeError, match="same setting"):
        sapo(logp, old, adv, mask, tau_pos=2.0, sapo_tau_pos=2.0)


# ------------------------------------------------------------------------------------- aggregation
def test_token_sum_and_seq_mean_counts_only_nonempty_rows():
    loss = torch.tensor([[1.0, 2, 3], [4, 5, 99], [7, 7, 7]], dtype=D)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=D)
    assert aggregate_loss(loss, mask, "token-sum").item() == pytest.approx(15.0)  # 1+2+3+4+5
    assert count_sequences(mask).item() == 2
    # the empty third row no longer dilutes: (6 + 9) / 2 = 7.5, not / 3
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(7.5)
