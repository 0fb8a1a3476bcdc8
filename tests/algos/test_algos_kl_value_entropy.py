"""KL estimators and controllers, KL-in-reward, value loss, explained variance, entropy."""

import math

import pytest
import torch

import algos_reference as ref
from tiller.algos import (
    AdaptiveEntropyController,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    build_kl_controller,
    entropy_from_logits,
    explained_variance,
    kl_penalty,
    logprobs_and_entropy,
    logprobs_from_logits,
    value_loss,
)
from tiller.errors import ConfigError

D = torch.float64
LN2 = math.log(2.0)


def test_kl_estimators_worked_numbers():
    # d = logp - ref = ln 0.5 - ln 0.25 = ln 2 = 0.693147
    lp, rf = torch.tensor([math.log(0.5)], dtype=D), torch.tensor([math.log(0.25)], dtype=D)
    assert kl_penalty(lp, rf, "kl").item() == pytest.approx(LN2)
    assert kl_penalty(lp, rf, "k1").item() == pytest.approx(LN2)
    assert kl_penalty(rf, lp, "abs").item() == pytest.approx(LN2)
    assert kl_penalty(lp, rf, "mse").item() == pytest.approx(0.5 * LN2**2)  # 0.240227
    # k3 = exp(-d) + d - 1 = 0.5 + 0.693147 - 1 = 0.193147 ; reversed (d = -ln2): 2 - 0.693147 - 1 = 0.306853
    assert kl_penalty(lp, rf, "low_var_kl").item() == pytest.approx(0.193147, abs=1e-6)
    assert kl_penalty(rf, lp, "k3").item() == pytest.approx(0.306853, abs=1e-6)
    # verl's clamps: d = -100 -> exp(20) - 20 - 1 clamped to 10; d = +100 -> exp(-20) + 20 - 1 = 19 -> 10
    assert kl_penalty(torch.tensor([-100.0]), torch.tensor([0.0]), "k3").item() == 10.0
    assert kl_penalty(torch.tensor([100.0]), torch.tensor([0.0]), "k3").item() == 10.0
    with pytest.raises(ConfigError, match="low_var_kl"):
        kl_penalty(lp, rf, "k4")


def test_kl_straight_through_value_of_k3_gradient_of_k2():
    lp = torch.tensor([math.log(0.5)], dtype=D, requires_grad=True)
    rf = torch.tensor([math.log(0.25)], dtype=D)
    v = kl_penalty(lp, rf, "k3+")
    v.backward()
    # value: k3 = 0.193147; gradient: d(k2)/dlogp = d = ln 2 (plain k3 would give 1 - exp(-d) = 0.5)
    assert v.item() == pytest.approx(0.193147, abs=1e-6)
    assert lp.grad.item() == pytest.approx(LN2)
    lp.grad = None
    kl_penalty(lp, rf, "low_var_kl").backward()
    assert lp.grad.item() == pytest.approx(0.5)
    assert torch.equal(kl_penalty(lp, rf, "k2+"), kl_penalty(lp, rf, "k2"))


def test_k1_and_k3_expectations_equal_exact_kl():
    # E_{v ~ p}[k(log p_v, log q_v)] = KL(p || q) for k1 and k3 (unbiased estimators); k2 is not.
    # k3 = q/p - 1 - log(q/p): E_p[q/p - 1] = 0. (Logit scale 0.5 keeps every k3 under verl's clamp
    # at 10; a token with q/p > ~12.3 would be clamped and bias k3 low.)
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(0.5 * torch.randn(50, generator=g, dtype=D), -1)
    logq = torch.log_softmax(0.5 * torch.randn(50, generator=g, dtype=D), -1)
    exact = (logp.exp() * (logp - logq)).sum()
    for kind in ("k1", "k3"):
        assert (logp.exp() * kl_penalty(logp, logq, kind)).sum().item() == pytest.approx(exact.item(), rel=1e-9)


def test_importance_weighted_kl_worked_numbers_and_unbiased_gradient():
    """DeepSeek-V3.2's estimate (TRL's use_bias_correction_kl): k3 x pi / pi_old. logp [-1, -2], old [-1.2, -2],
    ref [-1.5, -1]: d = [0.5, -1], k3 = [e^-0.5 - 0.5, e - 2] = [0.106531, 0.718282], ratio [e^0.2, 1]; its gradient
    in logp is ratio x (1 - e^-d + k3) = ratio x d: the unbiased gradient of KL(pi || ref) from pi_old's samples."""
    from tiller.algos.kl import importance_weighted_kl, kl_penalty

    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.2, -2.0]], dtype=torch.float64)
    ref_lp = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    w = importance_weighted_kl(kl_penalty(logp, ref_lp, "low_var_kl"), logp, old, mask)
    assert w.detach()[0].tolist() == pytest.approx([0.106531 * math.exp(0.2), 0.718282], abs=1e-6)
    w.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([math.exp(0.2) * 0.5, -1.0], abs=1e-9)
    # on-policy (old = logp): the value is the plain KL, the gradient is not (k3's own gradient is 1 - e^-d)
    logp.grad = None
    on = importance_weighted_kl(kl_penalty(logp, ref_lp, "low_var_kl"), logp, logp.detach(), mask)
    assert on.detach()[0].tolist() == pytest.approx([0.106531, 0.718282], abs=1e-6)
    on.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([0.5, -1.0], abs=1e-9)
    # sequence level (GSPO): the row's exp(mean log ratio) over its masked tokens, broadcast
    seq = importance_weighted_kl(torch.ones(1, 3, dtype=torch.float64), torch.tensor([[0.3, 0.1, 9.0]]).double(),
                                 torch.zeros(1, 3, dtype=torch.float64), torch.tensor([[1.0, 1.0, 0.0]]).double(),
                                 "sequence")
    assert seq[0].tolist() == pytest.approx([math.exp(0.2)] * 3)


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(10.0, 100)
    assert fixed.value == 0.05
    # adaptive: error = clip(0.15/0.1 - 1, -0.2, 0.2) = 0.2; beta *= 1 + 0.2 * 10 / 100 = 1.02
    c = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    c.update(0.15, n_steps=10)
    assert c.value == pytest.approx(0.102)
    c.update(0.0, n_steps=10)  # error -0.2 -> * 0.98
    assert c.value == pytest.approx(0.102 * 0.98)
    assert isinstance(build_kl_controller("adaptive", 0.1, 0.1, 100), AdaptiveKLController)
    with pytest.raises(ConfigError, match="horizon"):
        AdaptiveKLController(0.1, 0.1, 0)
    with pytest.raises(ConfigError, match="fixed, adaptive"):
        build_kl_controller("pid", 0.1)


def test_apply_kl_in_reward_worked_numbers():
    # k1 per token: old - ref = [0.5, 0, -0.5, (pad)]; rewards = scores - 0.1 * kl
    scores = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=D)
    old = torch.tensor([[-1.0, -1.0, -1.0, -9.0]], dtype=D)
    refp = torch.tensor([[-1.5, -1.0, -0.5, 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1, 1, 0]], dtype=D)
    rewards, met = apply_kl_in_reward(scores, old, refp, mask, kl_coef=0.1, kind="kl")
    ref.assert_close(rewards, [[-0.05, 0.0, 1.05, 0.0]], atol=1e-12)
    assert met["kl"].item() == pytest.approx(0.0)  # mean of [0.5, 0, -0.5]
    _, met = apply_kl_in_reward(scores, old, refp, mask, kl_coef=0.1, kind="abs")
    assert met["kl"].item() == pytest.approx(1.0 / 3)


def test_value_loss_worked_numbers():
    # values 1.0, c 0.2. token 0: vpred 1.5, return 2.0: v_clip 1.2; (1.5-2)^2 = 0.25 < (1.2-2)^2 = 0.64
    #   -> 0.5 * 0.64 = 0.32, the clipped term wins (no gradient)
    # token 1: vpred 1.1 inside the clip -> 0.5 * 0.81 = 0.405, grad = vpred - return = -0.9
    vpreds = torch.tensor([[1.5, 1.1, 7.0]], dtype=D, requires_grad=True)
    returns = torch.tensor([[2.0, 2.0, 0.0]], dtype=D)
    values = torch.ones(1, 3, dtype=D)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=D)
    loss, met = value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    ref.assert_close(loss, [[0.32, 0.405, 0.0]], atol=1e-12)
    loss.sum().backward()
    ref.assert_close(vpreds.grad, [[0.0, -0.9, 0.0]], atol=1e-12)
    assert met["vf_clipfrac"].item() == 0.5


def test_explained_variance_worked_numbers():
    # values [1, 2, 3], returns [1, 2, 4]: Var[resid [0, 0, 1]] = 1/3, Var[returns] = 7/3 -> 1 - 1/7
    values = torch.tensor([[1.0, 2.0, 3.0, 50.0]], dtype=D)
    returns = torch.tensor([[1.0, 2.0, 4.0, -50.0]], dtype=D)
    mask = torch.tensor([[1.0, 1, 1, 0]], dtype=D)
    assert explained_variance(values, returns, mask).item() == pytest.approx(6 / 7)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)


def test_entropy_worked_numbers():
    # uniform over 4: ln 4 = 1.386294 ; probs [0.25, 0.75] (logits [0, ln 3]):
    #   H = 0.25 ln 4 + 0.75 ln(4/3) = 0.346574 + 0.215762 = 0.562335
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]], dtype=D)
    ref.assert_close(entropy_from_logits(logits), [1.386294, 0.562335], atol=1e-6)


def test_entropy_and_logprobs_chunked_equal_unchunked_with_grads():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g, dtype=D, requires_grad=True)
    labels = torch.randint(0, 11, (3, 7), generator=g)
    direct_h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    direct_lp = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    gh = torch.autograd.grad(direct_h.sum() + direct_lp.sum(), logits)[0]
    for chunk in (1, 4, 100):
        h = entropy_from_logits(logits, chunk_size=chunk)
        lp = logprobs_from_logits(logits, labels, chunk_size=chunk)
        ref.assert_close(h, direct_h, atol=1e-12)
        ref.assert_close(lp, direct_lp, atol=1e-12)
        ref.assert_close(torch.autograd.grad(h.sum() + lp.sum(), logits)[0], gh, atol=1e-12)
    # half precision in: float32 out, gradient in the logits' dtype and close to the float64 one
    half = logits.detach().bfloat16().requires_grad_(True)
    h = entropy_from_logits(half, chunk_size=5)
    assert h.dtype == torch.float32
    (h.sum() + logprobs_from_logits(half, labels, chunk_size=5).sum()).backward()
    assert half.grad.dtype == torch.bfloat16
    torch.testing.assert_close(half.grad.double(), gh, atol=0.05, rtol=0.05)
    with pytest.raises(ValueError, match="disagree"):
        logprobs_from_logits(logits, labels[:, :3])


def _direct(logits, labels, temperature):
    z = logits / temperature
    return (torch.log_softmax(z, -1).gather(-1, labels[:, None]).squeeze(-1),
            -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1))


def test_logprobs_and_entropy_in_one_pass_with_temperature_and_grads():
    """The update's fused log-prob + entropy of logits / T: the plain formulas' values and gradients (float64),
    the entropy's gradient only when asked; from bf16 logits it is bit for bit the unfused path's
    `logprobs_from_logits(logits.float() / T)` (values and gradient), with no fp32 [N, V] tensor kept."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(21, 11, generator=g, dtype=D, requires_grad=True)
    labels = torch.randint(0, 11, (21,), generator=g)
    a, b = torch.randn(21, generator=g, dtype=D), torch.randn(21, generator=g, dtype=D)
    lp0, h0 = _direct(logits, labels, 0.7)
    g_both = torch.autograd.grad((a * lp0 + b * h0).sum(), logits, retain_graph=True)[0]
    g_lp = torch.autograd.grad((a * lp0).sum(), logits)[0]
    for chunk in (1, 4, 100):
        lp, h = logprobs_and_entropy(logits, labels, 0.7, want_entropy=True, entropy_grad=True, chunk_size=chunk)
        ref.assert_close(lp, lp0, atol=1e-12)
        ref.assert_close(h, h0, atol=1e-12)
        ref.assert_close(torch.autograd.grad((a * lp + b * h).sum(), logits)[0], g_both, atol=1e-12)
        lp, h = logprobs_and_entropy(logits, labels, 0.7, want_entropy=True, chunk_size=chunk)
        assert not h.requires_grad
        ref.assert_close(torch.autograd.grad((a * lp).sum(), logits)[0], g_lp, atol=1e-12)
        h_only = logprobs_and_entropy(logits, labels, 0.7, want_entropy=True, entropy_grad=True, chunk_size=chunk)[1]
        ref.assert_close(torch.autograd.grad((b * h_only).sum(), logits)[0], g_both - g_lp, atol=1e-12)
    assert logprobs_and_entropy(logits, labels)[1] is None
    half = logits.detach().bfloat16().requires_grad_(True)
    lp, _ = logprobs_and_entropy(half, labels, 0.7, chunk_size=8)
    (lp * a.float()).sum().backward()
    old = half.detach().clone().requires_grad_(True)
    lp_old = logprobs_from_logits(old.float() / 0.7, labels)
    (lp_old * a.float()).sum().backward()
    assert lp.dtype == torch.float32 and half.grad.dtype == torch.bfloat16
    assert torch.equal(lp, lp_old) and torch.equal(half.grad, old.grad)
    with pytest.raises(ValueError, match="labels"):
        logprobs_and_entropy(logits, labels[:3])
    with pytest.raises(ValueError, match="temperature"):
        logprobs_and_entropy(logits, labels, 0.0)


def test_the_lm_head_run_with_the_logprobs_gives_the_logits_path_numbers():
    """`head_logprobs_and_entropy` (model.use_fused_kernels): the LM head's matmul run chunk by chunk with the
    log-probs and entropy gives `logprobs_and_entropy(F.linear(hidden, weight, bias))`'s values and the gradients of
    hidden, weight and bias (float64 to 1e-12, any chunking; the entropy's gradient only when asked); under bf16
    autocast the matmul runs in bf16 as F.linear does (values equal; the weight's gradient summed over chunks in fp32
    where the unfused path rounds it once to bf16: within bf16's precision); `fp32` runs it in float32 under
    autocast (a Float32Head: the fp32 path's numbers)."""
    from tiller.algos.entropy import head_logprobs_and_entropy

    g = torch.Generator().manual_seed(0)
    n, e, v = 23, 6, 13
    hidden = torch.randn(n, e, generator=g, dtype=D, requires_grad=True)
    weight = torch.randn(v, e, generator=g, dtype=D, requires_grad=True)
    bias = torch.randn(v, generator=g, dtype=D, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    a, b = torch.randn(n, generator=g, dtype=D), torch.randn(n, generator=g, dtype=D)
    params = (hidden, weight, bias)

    def grads(lp, h):
        return torch.autograd.grad((a.to(lp.dtype) * lp + b.to(lp.dtype) * h).sum(), params)

    lp0, h0 = logprobs_and_entropy(torch.nn.functional.linear(hidden, weight, bias), labels, 0.7, True, True)
    want = grads(lp0, h0)
    for chunk in (1, 5, 100):
        lp, h = head_logprobs_and_entropy(hidden, weight, bias, labels, 0.7, True, True, chunk_size=chunk)
        ref.assert_close(lp, lp0, atol=1e-12)
        ref.assert_close(h, h0, atol=1e-12)
        for x, y in zip(grads(lp, h), want):
            ref.assert_close(x, y, atol=1e-12)
    lp, h = head_logprobs_and_entropy(hidden, weight, None, labels, 0.7, want_entropy=True, chunk_size=5)
    assert not h.requires_grad and head_logprobs_and_entropy(hidden, weight, None, labels)[1] is None
    lp_nb = logprobs_and_entropy(torch.nn.functional.linear(hidden, weight), labels, 0.7)[0]
    ref.assert_close(lp, lp_nb, atol=1e-12)
    h32, w32, b32 = (x.detach().float().requires_grad_(True) for x in params)
    outs = []
    for fused in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                lp, h = head_logprobs_and_entropy(h32, w32, b32, labels, 0.7, True, True, chunk_size=8)
            else:
                lp, h = logprobs_and_entropy(torch.nn.functional.linear(h32, w32, b32), labels, 0.7, True, True)
        outs.append((lp, h, torch.autograd.grad((a.float() * lp + b.float() * h).sum(), (h32, w32, b32))))
    (lp_a, h_a, g_a), (lp_b, h_b, g_b) = outs
    assert torch.equal(lp_a, lp_b) and torch.equal(h_a, h_b) and torch.equal(g_a[0], g_b[0])
    for x, y in zip(g_b[1:], g_a[1:]):
        assert x.dtype == torch.float32 and float((x - y).abs().max() / y.abs().max()) < 2 ** -6
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp_fp32, _ = head_logprobs_and_entropy(h32, w32, b32, labels, 0.7, fp32=True)
    torch.testing.assert_close(lp_fp32, logprobs_and_entropy(torch.nn.functional.linear(h32, w32, b32), labels,
                                                             0.7)[0], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="hidden"):
        head_logprobs_and_entropy(hidden, weight[:, :3], None, labels)


def test_compiled_logprobs_and_entropy_equal_eager_and_a_failed_compile_runs_eagerly(monkeypatch):
    """On CUDA the chunks run compiled by Inductor: traced by Dynamo and AOTAutograd here (the "aot_eager" backend;
    Inductor's CPU code and its cache are not what users run, and its cache returned garbage across an
    ATEN_CPU_CAPABILITY switch), they give the eager chunks' values and gradients, one trace serving every chunk
    length; a compile that fails warns and the call still returns the eager numbers. (Inductor's CUDA code is
    checked on the GPU: gpu_check.py's packed_update.)"""
    from torch._dynamo.utils import counters

    from tiller.algos import entropy as ent_mod

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(37, 50, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    w = torch.randn(37, generator=g)

    def run(**kw):
        logits.grad = None
        lp, h = logprobs_and_entropy(logits, labels, 0.9, want_entropy=True, entropy_grad=True, chunk_size=16, **kw)
        (w * lp + h).sum().backward()
        return lp.detach(), h.detach(), logits.grad.clone()

    eager = run(compiled=False)
    assert ent_mod.compile_logprobs(torch.device("cpu")) is False
    monkeypatch.setattr(ent_mod, "_COMPILED", {})
    monkeypatch.setattr(ent_mod, "COMPILE_BACKEND", "aot_eager")
    graphs = counters["stats"]["unique_graphs"]
    for x, y in zip(run(compiled=True), eager):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    assert set(ent_mod._COMPILED) == {ent_mod._lp_ent_forward, ent_mod._lp_ent_backward}
    assert counters["stats"]["unique_graphs"] - graphs <= 4  # chunks of 16 and 5 rows: not one graph per chunk

    def broken(fn, **kw):
        def fail(*a, **k):
            raise RuntimeError("no compiler here")
        return fail

    monkeypatch.setattr(ent_mod, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(UserWarning, match="runs eagerly"):
        again = run(compiled=True)
    for x, y in zip(again, eager):
        assert torch.equal(x, y)


def test_adaptive_entropy_controller():
    # c0 = 0, target 0.2, delta 0.005, cap 0.008
    c = AdaptiveEntropyController(init_coeff=0.0, target_entropy=0.2, delta=0.005, max_coeff=0.008)
    assert c.effective_coeff(0.1) == 0.0  # below target but c is still 0
    assert c.update(0.1) == pytest.approx(0.005)  # below target: raise
    assert c.effective_coeff(0.1) == pytest.approx(0.005)
    assert c.update(0.1) == pytest.approx(0.008)  # clipped at c_max
    assert c.effective_coeff(0.3) == 0.0  # above target: the bonus is off...
    assert c.update(0.3) == pytest.approx(0.003)  # ...and c decreases
    assert c.update(0.3) == 0.0 and c.update(0.3) == 0.0  # clipped at 0
    assert c.update(0.2) == 0.0  # at target: no move



def _trl_adaptive_entropy(coef, entropies, target, delta, lo, hi):
    """TRL 1.16 grpo_trainer.py's controller, one optimizer step per entry: the coefficient applied (gated by the
    previous step's entropy, inf at first) and the coefficient after the step's update."""
    applied, after, last = [], [], float("inf")
    for h in entropies:
        applied.append(coef if last <= target else 0.0)
        coef = min(coef + delta, hi) if h <= target else max(coef - delta, lo)
        after.append(coef)
        last = h
    return applied, after


def test_inclusive_controller_with_a_floor_is_trls():
    # equality with the target raises (TRL, the paper's text) instead of holding; the floor is min_coeff
    entropies = [0.1, 0.2, 0.2, 0.3, 0.3, 0.3, 0.3, 0.2, 0.05]
    c = AdaptiveEntropyController(init_coeff=0.004, target_entropy=0.2, delta=0.003, max_coeff=0.009, min_coeff=0.002,
                                  inclusive=True)
    last, applied, after = float("inf"), [], []
    for h in entropies:  # tiller's trainer: effective_coeff(previous entropy), then update(this step's)
        applied.append(c.effective_coeff(last))
        after.append(c.update(h))
        last = h
    want_applied, want_after = _trl_adaptive_entropy(0.004, entropies, 0.2, 0.003, 0.002, 0.009)
    assert applied == pytest.approx(want_applied) and after == pytest.approx(want_after)
    assert after == pytest.approx([0.007, 0.009, 0.009, 0.006, 0.003, 0.002, 0.002, 0.005, 0.008])  # worked
    with pytest.raises(ConfigError, match=r"min_coeff \(0.5\) must be <= max_coeff"):
        AdaptiveEntropyController(0.0, 0.2, 0.1, 0.1, min_coeff=0.5)
