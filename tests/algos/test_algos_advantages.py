"""Advantage estimators: worked numbers, loop-vs-vectorised, edge cases."""

import numpy as np
import pytest
import torch

import algos_reference as ref
from tiller.algos import ADV_ESTIMATORS, get_advantage_estimator
from tiller.errors import ConfigError, DataError, UserError


def outcome(scores, lengths, T=None):
    """Token rewards with each score on the last valid token, and the mask."""
    T = T or max(max(lengths), 1)
    r = torch.zeros(len(scores), T, dtype=torch.float64)
    m = torch.zeros(len(scores), T, dtype=torch.float64)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        m[i, :n] = 1
        if n:
            r[i, n - 1] = s
    return r, m


def first_col(adv):
    return adv[:, 0].tolist()


def test_registry_names_and_errors():
    assert ADV_ESTIMATORS.names() == sorted(
        ["gae", "grpo", "grpo_passk", "rloo", "remax", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "gpg",
         "grpo_vectorized", "rloo_vectorized", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline",
         "prime"]
    )
    with pytest.raises(ConfigError, match=r"did you mean 'grpo'.*valid: gae, gdpo, gpg, grpo"):
        get_advantage_estimator("grp")
    r, m = outcome([1.0, 0.0], [2, 2])
    with pytest.raises(TypeError, match="gama"):
        get_advantage_estimator("grpo")(r, m, [0, 0], None, gama=0.9)
    # known hyper-parameters that an estimator does not use are accepted (trainer passes one set)
    get_advantage_estimator("rloo")(r, m, [0, 0], None, gamma=0.9, lam=0.95, norm_adv_by_std_in_grpo=False)


def test_grpo_worked_numbers():
    # group "a": scores [1, 0, 1, 0]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.577350
    #   -> A = +-0.5 / 0.577350 = +-0.866025 ; group "b" is a singleton of score 2: mean 0, std 1
    #   -> A = 2 / (1 + 1e-6) (verl's rule)
    r, m = outcome([1, 0, 1, 0, 2], [3, 2, 1, 3, 2], T=3)
    adv, ret = get_advantage_estimator("grpo")(r, m, ["a", "a", "a", "a", "b"], None)
    assert first_col(adv) == pytest.approx([0.866025, -0.866025, 0.866025, -0.866025, 2.0], abs=1e-5)
    assert torch.equal(adv, ret)
    # broadcast over the response tokens only
    assert adv[2].tolist() == pytest.approx([0.866025, 0.0, 0.0], abs=1e-5)
    # Dr.GRPO: no std division -> +-0.5, singleton keeps its score
    adv, _ = get_advantage_estimator("grpo")(r, m, ["a", "a", "a", "a", "b"], None, norm_adv_by_std_in_grpo=False)
    assert first_col(adv) == pytest.approx([0.5, -0.5, 0.5, -0.5, 2.0])


def test_rloo_opo_gpg_worked_numbers():
    # RLOO: scores [3, 1, 2]: A_i = s_i - mean(others) = 3-1.5, 1-2.5, 2-2 = [1.5, -1.5, 0]
    r, m = outcome([3, 1, 2, 7], [2, 2, 2, 2])
    adv, _ = get_advantage_estimator("rloo")(r, m, [0, 0, 0, 1], None)
    assert first_col(adv) == pytest.approx([1.5, -1.5, 0.0, 7.0])  # singleton keeps s
    # OPO: scores [1, 0], lengths [1, 3]: b = (1*1 + 3*0) / 4 = 0.25 -> [0.75, -0.25]
    r, m = outcome([1, 0], [1, 3])
    adv, _ = get_advantage_estimator("opo")(r, m, [5, 5], None)
    assert first_col(adv) == pytest.approx([0.75, -0.25])
    # GPG: scores [1, 0, 1, 1] groups a a b b: alpha = 4 / 3 nonzero = 4/3;
    #   group a mean 0.5 -> +-0.5 * 4/3 = +-0.6667 ; group b mean 1 -> 0
    r, m = outcome([1, 0, 1, 1], [2, 2, 2, 2])
    adv, _ = get_advantage_estimator("gpg")(r, m, ["a", "a", "b", "b"], None)
    assert first_col(adv) == pytest.approx([2 / 3, -2 / 3, 0.0, 0.0])


def test_passk_worked_numbers():
    # scores [0.2, 0.9, 0.5, 0.1]: best = 0.9, second = 0.5, gap 0.4;
    # std: mean 0.425, squared deviations sum 0.3875, / 3 = 0.129167, sqrt = 0.359398 -> 0.4 / 0.359398 = 1.112968
    r, m = outcome([0.2, 0.9, 0.5, 0.1], [1, 1, 1, 1])
    adv, _ = get_advantage_estimator("grpo_passk")(r, m, [0, 0, 0, 0], None)
    assert first_col(adv) == pytest.approx([0, 1.112968, 0, 0], abs=1e-5)
    adv, _ = get_advantage_estimator("grpo_passk")(r, m, [0, 0, 0, 0], None, norm_adv_by_std_in_grpo=False)
    assert first_col(adv) == pytest.approx([0, 0.4, 0, 0])
    # ties at the top: the gap is 0, nobody gets credit
    r, m = outcome([1, 1, 0], [1, 1, 1])
    adv, _ = get_advantage_estimator("grpo_passk")(r, m, [0, 0, 0], None)
    assert first_col(adv) == [0, 0, 0]
    with pytest.raises(DataError, match="at least 2"):
        get_advantage_estimator("grpo_passk")(r, m, [0, 0, 1], None)


def test_remax_and_reinforce_pp_worked_numbers():
    # ReMax: rewards [0, 0, 1] -> reward-to-go [1, 1, 1]; baseline 0.4 -> A = 0.6 on each token
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1.0, 1, 1], [1, 1, 0]], dtype=torch.float64)
    adv, ret = get_advantage_estimator("remax")(r, m, None, None, baseline_rewards=torch.tensor([0.4, 0.5], dtype=torch.float64))
    ref.assert_close(ret, [[1, 1, 1], [0.5, 0.5, 0]], atol=1e-9)
    ref.assert_close(adv, [[0.6, 0.6, 0.6], [0, 0, 0]], atol=1e-9)
    with pytest.raises(ConfigError, match="baseline_rewards"):
        get_advantage_estimator("remax")(r, m, None, None)
    # REINFORCE++ gamma 0.5: row 0 [0, 0, 1] -> G = [0.25, 0.5, 1]; row 1 [0, 1, pad] -> [0.5, 1, 0]
    # whiten over the 5 valid: mean 0.65, squared deviations sum 0.45, /4 = 0.1125, std 0.335410
    #   -> G[0,0] = (0.25 - 0.65) / 0.335410 = -1.192570
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    adv, ret = get_advantage_estimator("reinforce_plus_plus")(r, m, None, None, gamma=0.5)
    ref.assert_close(ret, [[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]], atol=1e-9)
    assert adv[0, 0].item() == pytest.approx(-1.192570, abs=1e-5)
    assert adv[1, 2].item() == 0.0


def test_reinforce_pp_multi_turn_mask_carries_the_return_across_observations():
    # one response of 5 tokens: turn 1 (t0, t1), a tool observation (t2, t3: mask 0, reward 7 there is not the
    # policy's), turn 2 (t4, reward 1). gamma 0.5, as verl's compute_reinforce_plus_plus_outcome_advantage after
    # its fix #7278: G4 = 1; t3, t2 skipped (G stays 1, no discount); G1 = 0 + 0.5 * 1 = 0.5; G0 = 0.25.
    # (Before the fix tiller reset the return to 0 at t3, giving turn 1 G = [0, 0].) A second row: plain [0, 1].
    r = torch.tensor([[0.0, 0.0, 7.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]])
    adv, ret = get_advantage_estimator("reinforce_plus_plus")(r, m, None, None, gamma=0.5)
    ref.assert_close(ret, [[0.25, 0.5, 0.0, 0.0, 1.0], [0.5, 1.0, 0.0, 0.0, 0.0]], atol=1e-12)
    # whitened over the 5 valid returns [0.25, 0.5, 1, 0.5, 1]: mean 0.65, squared deviations
    # 0.16 + 0.0225 + 0.1225 + 0.0225 + 0.1225 = 0.45, unbiased var 0.1125, std 0.335410 -> A0 = -0.4 / 0.335410
    assert adv[0, 0].item() == pytest.approx(-1.192570, abs=1e-5)
    assert adv[0, 4].item() == pytest.approx(0.35 / 0.335410, abs=1e-5)
    assert adv[0, 2].item() == adv[0, 3].item() == 0.0


def test_reinforce_pp_baseline_worked_numbers():
    # scores [1, 0 | 1]: centred [0.5, -0.5 | 1 (singleton: mean 0)] -> tokens (2 each):
    #   [0.5, 0.5, -0.5, -0.5, 1, 1]: mean 2/6 = 1/3; squared deviations 2/36 + 50/36 + 32/36 = 84/36,
    #   unbiased var 84/36/5 = 0.466667, std 0.683130 -> A[0,0] = (0.5 - 1/3) / 0.683130 = 0.243975
    r, m = outcome([1, 0, 1], [2, 2, 2])
    adv, _ = get_advantage_estimator("reinforce_plus_plus_baseline")(r, m, [0, 0, 1], None)
    centred = [[0.5, 0.5], [-0.5, -0.5], [1.0, 1.0]]
    ref.assert_close(adv, ref.whiten(centred, m.tolist()), atol=1e-6)
    assert adv[0, 0].item() == pytest.approx(0.243975, abs=1e-6)


def test_gae_worked_numbers():
    # rewards [0, 1], values [0.5, 0.8], gamma 0.9, lam 0.8:
    #   delta_1 = 1 + 0.9*0 - 0.8 = 0.2 -> A_1 = 0.2
    #   delta_0 = 0 + 0.9*0.8 - 0.5 = 0.22 -> A_0 = 0.22 + 0.9*0.8*0.2 = 0.364
    #   returns = A + V = [0.864, 1.0]; whitened A over 2 tokens = [+0.7071, -0.7071]
    r = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 0.8]], dtype=torch.float64)
    m = torch.ones(1, 2, dtype=torch.float64)
    adv, ret = get_advantage_estimator("gae")(r, m, None, v, gamma=0.9, lam=0.8)
    ref.assert_close(ret, [[0.864, 1.0]], atol=1e-9)
    ref.assert_close(adv, [[0.707107, -0.707107]], atol=1e-5)
    with pytest.raises(ConfigError, match="critic"):
        get_advantage_estimator("gae")(r, m, None, None)


def _random_batch(seed, B=13, T=7, n_groups=4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g).tolist()
    lengths[0] = T
    scores = torch.randint(0, 3, (B,), generator=g).double().tolist()
    r, m = outcome(scores, lengths, T=T)
    r = r + torch.where(m > 0, 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64), 0.0)
    index = [f"p{int(i)}" for i in torch.randint(0, n_groups, (B,), generator=g)]
    index[-1] = "lonely"  # always one singleton group
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    return r, m, index, values


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_matches_loop(seed):
    r, m, index, values = _random_batch(seed)
    rl, ml = r.tolist(), m.tolist()
    for norm in (True, False):
        adv, _ = get_advantage_estimator("grpo")(r, m, index, None, norm_adv_by_std_in_grpo=norm)
        ref.assert_close(adv, ref.grpo(rl, ml, index, norm=norm), atol=1e-9)
    cases = {"rloo": ref.rloo, "opo": ref.opo, "gpg": ref.gpg}
    for name, loop in cases.items():
        adv, _ = get_advantage_estimator(name)(r, m, np.array(index, dtype=object), None)
        ref.assert_close(adv, loop(rl, ml, index), atol=1e-9)
    adv, ret = get_advantage_estimator("gae")(r, m, index, values, gamma=0.95, lam=0.9)
    exp_adv, exp_ret = ref.gae(rl, values.tolist(), ml, 0.95, 0.9)
    ref.assert_close(adv, exp_adv, atol=1e-9)
    ref.assert_close(ret, exp_ret, atol=1e-9)
    adv, ret = get_advantage_estimator("reinforce_plus_plus")(r, m, index, None, gamma=0.9)
    exp_ret = ref.discounted_returns(rl, ml, 0.9)
    ref.assert_close(ret, exp_ret, atol=1e-9)
    ref.assert_close(adv, ref.whiten(exp_ret, ml), atol=1e-9)


@pytest.mark.parametrize("seed", [3, 4])
def test_passk_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(12, generator=g, dtype=torch.float64).round(decimals=1).tolist()
    r, m = outcome(scores, [3] * 12)
    index = [i // 4 for i in range(12)]
    for norm in (True, False):
        adv, _ = get_advantage_estimator("grpo_passk")(r, m, index, None, norm_adv_by_std_in_grpo=norm)
        ref.assert_close(adv, ref.passk(r.tolist(), m.tolist(), index, norm=norm), atol=1e-9)


def test_group_labels_ints_strings_tensor_equivalent():
    r, m, _, _ = _random_batch(7, B=8)
    ints = [0, 0, 1, 1, 2, 2, 2, 3]
    a1, _ = get_advantage_estimator("grpo")(r, m, ints, None)
    a2, _ = get_advantage_estimator("grpo")(r, m, [f"uid-{i}" for i in ints], None)
    a3, _ = get_advantage_estimator("grpo")(r, m, torch.tensor(ints), None)
    a4, _ = get_advantage_estimator("grpo")(r, m, np.array(ints), None)
    assert torch.equal(a1, a2) and torch.equal(a1, a3) and torch.equal(a1, a4)


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"])
def test_edge_cases_all_equal_group_and_empty_response(name):
    # group 0: all rewards equal -> no learning signal; row 3 has an empty response -> all-zero row
    r, m = outcome([1, 1, 1, 0, 0.5, 0.7], [3, 2, 3, 0, 2, 3], T=3)
    adv, ret = get_advantage_estimator(name)(r, m, [0, 0, 0, 1, 1, 1], None)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert adv[3].abs().sum() == 0
    assert (adv * (1 - m)).abs().sum() == 0  # nothing outside the mask
    if name != "reinforce_plus_plus_baseline":  # whitening shifts the zero
        assert adv[:3].abs().max() == 0


def test_whole_batch_masked_is_finite():
    r = torch.zeros(3, 4)
    m = torch.zeros(3, 4)
    for name in ADV_ESTIMATORS.names():
        if name == "grpo_passk":
            continue
        kw = {"baseline_rewards": torch.zeros(3)} if name == "remax" else {}
        if "optimal_token_baseline" in name:
            kw = {"old_logp": torch.zeros(3, 4), "sum_pi_squared": torch.ones(3, 4)}
        if name == "prime":
            kw = {"prime_token_rewards": torch.zeros(3, 4)}
        adv, ret = get_advantage_estimator(name)(r, m, [0, 0, 1], torch.zeros(3, 4), **kw)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all() and adv.abs().sum() == 0, name


def test_bad_shapes_are_user_errors():
    r, m = outcome([1, 0], [2, 2])
    with pytest.raises(UserError, match="group_index has 3 labels"):
        get_advantage_estimator("grpo")(r, m, [0, 0, 1], None)
    with pytest.raises(UserError, match="must be equal"):
        get_advantage_estimator("grpo")(r, m[:, :1], [0, 0], None)
