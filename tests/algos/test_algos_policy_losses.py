"""Policy losses: worked numbers (values, gradients, metrics), finiteness, loop comparison."""

import math

import pytest
import torch

import algos_reference as ref
from tiller.algos import POLICY_LOSSES, aggregate_loss, get_policy_loss
from tiller.errors import ConfigError

D = torch.float64


def leaf(values):
    return torch.tensor(values, dtype=D, requires_grad=True)


def grad_of(name, logp, old, adv, mask, mode="token-mean", **hyper):
    loss, metrics = get_policy_loss(name)(logp, old, adv, mask, **hyper)
    aggregate_loss(loss, mask, mode).backward()
    return loss.detach(), logp.grad, metrics


def test_registry():
    assert POLICY_LOSSES.names() == sorted(["vanilla", "gspo", "gpg", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov",
                                            "dppo_tv", "dppo_kl", "dro", "vespo", "bypass_mode"])
    with pytest.raises(ConfigError, match="did you mean 'vanilla'"):
        get_policy_loss("vanila")
    m = torch.ones(1, 1)
    with pytest.raises(TypeError, match="clip_ration"):
        get_policy_loss("vanilla")(m, m, m, m, clip_ration=0.2)
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        get_policy_loss("vanilla")(m, m, m, m, clip_ratio_c=1.0)


def test_vanilla_worked_numbers():
    # eps 0.2, c 3; (A, r):
    #  t0 (+1, 1.5): -A r = -1.5, -A clip = -1.2 -> max -1.2 (clipped, no grad)
    #  t1 (-1, 0.5): 0.5 vs 0.8 -> 0.8 (clipped); dual-clip min(3, 0.8) = 0.8
    #  t2 (-1, 4.0): 4.0 vs 1.2 -> 4.0; dual-clip min(3, 4) = 3 (lower clip, no grad)
    #  t3 (+2, 1.1): -2.2 both -> -2.2, grad d(-A r)/dlogp = -A r = -2.2, /4 tokens (token-mean)
    old = torch.zeros(1, 4, dtype=D)
    logp = leaf([[math.log(1.5), math.log(0.5), math.log(4.0), math.log(1.1)]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0]], dtype=D)
    mask = torch.ones(1, 4, dtype=D)
    loss, grad, met = grad_of("vanilla", logp, old, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    ref.assert_close(loss, [[-1.2, 0.8, 3.0, -2.2]], atol=1e-12)
    ref.assert_close(grad, [[0.0, 0.0, 0.0, -2.2 / 4]], atol=1e-12)
    assert met["pg_clipfrac"].item() == pytest.approx(0.5)  # t0, t1
    assert met["pg_clipfrac_lower"].item() == pytest.approx(0.25)  # t2
    # ppo_kl = mean(old - logp) = -(ln 1.5 + ln 0.5 + ln 4 + ln 1.1) / 4 = -0.298481
    assert met["ppo_kl"].item() == pytest.approx(-0.298481, abs=1e-6)
    assert all(v.dim() == 0 and not v.requires_grad for v in met.values())
    # DAPO clip-higher: eps_high 0.28 -> t0 clipped at 1.28
    loss, _, _ = grad_of("vanilla", leaf(logp.tolist()), old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss[0, 0].item() == pytest.approx(-1.28)


def test_gspo_worked_numbers():
    # log ratios [0.1, 0.3] -> sequence ratio exp(0.2) = 1.221403; A = 1
    # eps 0.2: clipped at 1.2 on both tokens, no grad. eps 0.3: -1.221403 on both;
    # seq-mean-token-mean: d/dlogp_t = -A s / 2 = -0.610701
    old = torch.zeros(1, 2, dtype=D)
    adv = torch.ones(1, 2, dtype=D)
    mask = torch.ones(1, 2, dtype=D)
    loss, grad, met = grad_of("gspo", leaf([[0.1, 0.3]]), old, adv, mask, "seq-mean-token-mean", clip_ratio=0.2)
    ref.assert_close(loss, [[-1.2, -1.2]], atol=1e-12)
    ref.assert_close(grad, [[0.0, 0.0]])
    assert met["pg_clipfrac"].item() == 1.0
    loss, grad, _ = grad_of("gspo", leaf([[0.1, 0.3]]), old, adv, mask, "seq-mean-token-mean", clip_ratio=0.3)
    ref.assert_close(loss, [[-1.221403, -1.221403]], atol=1e-6)
    ref.assert_close(grad, [[-0.610701, -0.610701]], atol=1e-6)


def test_gpg_cispo_sapo_worked_numbers():
    mask = torch.ones(1, 2, dtype=D)
    old = torch.zeros(1, 2, dtype=D)
    adv = torch.tensor([[1.0, -1.0]], dtype=D)
    # GPG: -A logp; grad -A / 2 (token-mean)
    loss, grad, _ = grad_of("gpg", leaf([[-0.5, -2.0]]), old, adv, mask)
    ref.assert_close(loss, [[0.5, -2.0]])
    ref.assert_close(grad, [[-0.5, 0.5]])
    # CISPO with r = [1.5, 0.5] (logp = ln r since old = 0), eps 0.2: weights sg(clip r) = [1.2, 0.8]
    #   loss = -w A logp = [-1.2 ln1.5, 0.8 ln0.5] = [-0.486558, -0.554518]; grad = -w A / 2 = [-0.6, 0.4]
    #   (the clipped tokens keep a gradient, unlike PPO)
    loss, grad, met = grad_of("cispo", leaf([[math.log(1.5), math.log(0.5)]]), old, adv, mask, clip_ratio=0.2)
    ref.assert_close(loss, [[-0.486558, -0.554518]], atol=1e-6)
    ref.assert_close(grad, [[-0.6, 0.4]], atol=1e-12)
    assert met["pg_clipfrac"].item() == 1.0
    # SAPO at r = 1: gate = sigmoid(0) 4 / tau = 2 / tau -> loss = -2A/tau_pos, +2/tau_neg = [-2, 1.904762]
    #   d gate / d logp = 4 sigmoid' r = 1 at r = 1 for any tau -> grad = -A / 2 = [-0.5, 0.5]
    loss, grad, _ = grad_of("sapo", leaf([[0.0, 0.0]]), old, adv, mask, sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    ref.assert_close(loss, [[-2.0, 2 / 1.05]], atol=1e-12)
    ref.assert_close(grad, [[-0.5, 0.5]], atol=1e-12)


def test_geo_mean_worked_numbers():
    # row 0, A = +1, log ratios [0.1, 0.5], eps 0.2: positive A caps rho at +0.2 -> [0.1, 0.2]
    #   ratio = exp(0.15) = 1.161834, sequence loss -1.161834 on both tokens;
    #   grad wrt logp_0 = -A ratio / 2 = -0.580917, logp_1 is clipped -> 0
    # row 1, A = -1, log ratios [-0.1, -0.5]: negative A floors rho at -0.2 -> [-0.1, -0.2]
    #   ratio = exp(-0.15) = 0.860708, loss +0.860708; grad logp_0 = +0.860708 / 2 (x 1/2 seq-mean)
    old = torch.zeros(2, 2, dtype=D)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=D)
    mask = torch.ones(2, 2, dtype=D)
    loss, grad, met = grad_of("geo_mean", leaf([[0.1, 0.5], [-0.1, -0.5]]), old, adv, mask, "seq-mean-token-mean")
    ref.assert_close(loss, [[-1.161834, -1.161834], [0.860708, 0.860708]], atol=1e-6)
    ref.assert_close(grad, [[-0.580917 / 2, 0.0], [0.860708 / 4, 0.0]], atol=1e-6)
    assert met["pg_clipfrac"].item() == 0.25 and met["pg_clipfrac_lower"].item() == 0.25


def test_clip_cov_and_kl_cov_worked_numbers():
    # A = [2, 0, 0, 0] (mean 0.5), logp = [0, -2, -2, -2] (mean -1.5)
    # cov = (A - 0.5)(logp + 1.5) = [2.25, 0.25, 0.25, 0.25]; window (1, 5) holds token 0 only;
    # k = max(1, floor(0.0002 * 4)) = 1 -> token 0 is detached
    mask = torch.ones(1, 4, dtype=D)
    adv = torch.tensor([[2.0, 0.0, 0.0, 0.0]], dtype=D)
    old = torch.tensor([[-0.1, -2.0, -2.0, -2.0]], dtype=D)
    loss, grad, met = grad_of("clip_cov", leaf([[0.0, -2.0, -2.0, -2.0]]), old, adv, mask, clip_ratio=0.2)
    # r_0 = exp(0.1) = 1.105171 is inside the PPO clip, so only the covariance rule zeroes it
    ref.assert_close(loss, [[0.0, 0.0, 0.0, 0.0]])
    ref.assert_close(grad, [[0.0, 0.0, 0.0, 0.0]])
    assert met["pg_clipfrac"].item() == 0.25
    # kl_cov: the top-covariance token 0 gets -A r + coef |rho| = -2 exp(0.1) + 1 * 0.1 = -2.110342
    loss, grad, met = grad_of("kl_cov", leaf([[0.0, -2.0, -2.0, -2.0]]), old, adv, mask, ppo_kl_coef=1.0)
    ref.assert_close(loss, [[-2.110342, 0.0, 0.0, 0.0]], atol=1e-6)
    # grad_0 = (-A r + coef * sign(rho)) / 4 = (-2.210342 + 1) / 4
    assert grad[0, 0].item() == pytest.approx((-2 * math.exp(0.1) + 1) / 4)
    assert met["ppo_kl"].item() == pytest.approx(0.1 / 4)  # mean |rho|, as verl reports for kl_cov


def test_clip_cov_selection_is_random_but_reproducible_and_sized():
    # 1000 tokens all in the window -> k = floor(0.01 * 1000) = 10 detached tokens, chosen at random
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(10, 100, generator=g, dtype=D)
    logp = (adv * 0 + 1).clone()
    logp = leaf((adv * 1.0).tolist())  # cov = (A - mean)(A - mean) >= 0, in window for most
    old = logp.detach().clone()
    mask = torch.ones(10, 100, dtype=D)
    kw = dict(clip_cov_ratio=0.01, clip_cov_lb=-1.0, clip_cov_ub=1e9)
    l1, m1 = get_policy_loss("clip_cov")(logp, old, adv, mask, generator=torch.Generator().manual_seed(1), **kw)
    l2, _ = get_policy_loss("clip_cov")(logp, old, adv, mask, generator=torch.Generator().manual_seed(1), **kw)
    l3, _ = get_policy_loss("clip_cov")(logp, old, adv, mask, generator=torch.Generator().manual_seed(2), **kw)
    assert m1["pg_clipfrac"].item() == pytest.approx(10 / 1000)
    assert torch.equal(l1, l2) and not torch.equal(l1, l3)


def test_vanilla_matches_token_loop():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(6, 9, generator=g, dtype=D) * 0.5
    old = logp + torch.randn(6, 9, generator=g, dtype=D) * 0.4
    adv = torch.randn(6, 9, generator=g, dtype=D)
    mask = (torch.rand(6, 9, generator=g) > 0.2).to(D)
    loss, _ = get_policy_loss("vanilla")(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    expected = [
        [ref.vanilla_token(logp[i, t].item(), old[i, t].item(), adv[i, t].item(), 0.2, 0.28, 3.0) * mask[i, t].item() for t in range(9)]
        for i in range(6)
    ]
    ref.assert_close(loss, expected, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(["vanilla", "gspo", "gpg", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov"]))
def test_extreme_log_ratios_and_garbage_padding_stay_finite(name, dtype):
    # log ratios of +-1000 with advantages of both signs (A < 0 with rho = +1000 is the case that
    # overflows an unclamped geometric mean), and huge garbage under the mask
    logp = torch.tensor([[1000.0, 1000.0, 0.0, 1e4], [-1000.0, -1000.0, 3.0, -1e4]], dtype=dtype, requires_grad=True)
    old = torch.zeros(2, 4, dtype=dtype)
    adv = torch.tensor([[-1.0, 1.0, 0.0, 1e6], [1.0, -1.0, -2.0, -1e6]], dtype=dtype)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 0]], dtype=dtype)
    loss, met = get_policy_loss(name)(logp, old, adv, mask, clip_cov_lb=-1e9, clip_cov_ub=1e9)
    assert torch.isfinite(loss).all(), loss
    assert (loss[:, 3] == 0).all()
    for mode in ("token-mean", "seq-mean-token-mean"):
        logp.grad = None
        total = aggregate_loss(get_policy_loss(name)(logp, old, adv, mask, clip_cov_lb=-1e9, clip_cov_ub=1e9)[0], mask, mode)
        total.backward()
        assert torch.isfinite(logp.grad).all() and (logp.grad[:, 3] == 0).all(), (mode, logp.grad)
    assert all(torch.isfinite(v) for v in met.values())


@pytest.mark.parametrize("name", sorted(["vanilla", "gspo", "gpg", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov"]))
def test_fully_masked_rows_have_zero_loss_and_grad(name):
    logp = leaf([[-1.0, -2.0], [-0.5, -0.7]])
    old = torch.tensor([[-1.1, -1.9], [-0.4, -0.9]], dtype=D)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=D)
    loss, _ = get_policy_loss(name)(logp, old, adv, mask)
    aggregate_loss(loss, mask, "seq-mean-token-mean").backward()
    assert (loss[1] == 0).all() and (logp.grad[1] == 0).all()
