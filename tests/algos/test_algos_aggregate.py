"""Loss aggregation: worked numbers and micro-batch gradient invariance for every mode x loss."""

import pytest
import torch

import algos_reference as ref
from tiller.algos import LOSS_AGG_MODES, POLICY_LOSSES, aggregate_loss, get_policy_loss, value_loss
from tiller.errors import ConfigError

D = torch.float64


def test_worked_numbers():
    # row 0: losses [1, 2, 3] all valid (n=3); row 1: [4, 5, pad] (n=2); row 2: empty
    loss = torch.tensor([[1.0, 2, 3], [4, 5, 99], [7, 7, 7]], dtype=D)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=D)
    # token-mean: (1+2+3+4+5) / 5 = 3
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(3.0)
    # token-sum: 1+2+3+4+5 = 15
    assert aggregate_loss(loss, mask, "token-sum").item() == pytest.approx(15.0)
    # the seq-mean modes count the 2 rows with a valid token (verl excludes fully masked rows)
    # seq-mean-token-sum: (6 + 9) / 2 rows = 7.5
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(7.5)
    # seq-mean-token-mean: (6/3 + 9/2) / 2 = (2 + 4.5) / 2 = 3.25
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.25)
    # seq-mean-token-sum-norm: (6 + 9) / (2 rows * T=3) = 2.5 ; with max_len 5: 15 / 10 = 1.5
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(2.5)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", max_len=5).item() == pytest.approx(1.5)
    # global counts replace the local ones: token-mean over 10 global tokens = 15 / 10
    assert aggregate_loss(loss, mask, "token-mean", global_tokens=10).item() == pytest.approx(1.5)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum", global_seqs=torch.tensor(5)).item() == pytest.approx(3.0)
    # a fully masked batch gives 0, not NaN
    assert aggregate_loss(loss, torch.zeros_like(mask), "token-mean").item() == 0.0
    with pytest.raises(ConfigError, match="valid: token-mean"):
        aggregate_loss(loss, mask, "token_mean")


def _batch(seed, B=8, T=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[2] = 0  # an empty response
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(D)
    logp = (-torch.rand(B, T, generator=g, dtype=D) * 2).requires_grad_(True)
    old = (logp + 0.3 * torch.randn(B, T, generator=g, dtype=D)).detach()
    adv = torch.randn(B, 1, generator=g, dtype=D).expand(B, T).contiguous()  # sequence-level advantage
    adv = adv + 0.2 * torch.randn(B, T, generator=g, dtype=D)  # plus token-level noise
    return logp, old, adv, mask


# selections that depend on the batch (clip_cov / kl_cov) are neutralised so the surrogate is row-local
HYPER = dict(clip_ratio=0.2, clip_ratio_high=0.28, clip_cov_lb=1e9, clip_cov_ub=2e9, ppo_kl_coef=0.0)


def _grad(name, logp, old, adv, mask, mode, rows, counts):
    logp.grad = None
    for idx in rows:
        loss, _ = get_policy_loss(name)(logp[idx], old[idx], adv[idx], mask[idx], **HYPER)
        aggregate_loss(loss, mask[idx], mode, **counts).backward()
    return logp.grad.clone()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", sorted(["vanilla", "gspo", "gpg", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov",
                                         "dppo_tv", "dppo_kl", "dro", "vespo", "bypass_mode"]))
def test_micro_batch_gradients_sum_to_mini_batch_gradient(name, mode):
    logp, old, adv, mask = _batch(0)
    counts = dict(global_tokens=mask.sum(), global_seqs=mask.shape[0], max_len=mask.shape[1])
    whole = _grad(name, logp, old, adv, mask, mode, [slice(0, 8)], counts)
    micro = _grad(name, logp, old, adv, mask, mode, [slice(0, 3), slice(3, 4), slice(4, 8)], counts)
    assert whole.abs().sum() > 0
    ref.assert_close(micro, whole, atol=1e-12)


def test_local_counts_break_token_mean_invariance():
    # the bug tiller avoids: normalising each micro-batch by its own token count and averaging
    logp, old, adv, mask = _batch(1)
    counts = dict(global_tokens=mask.sum())
    whole = _grad("vanilla", logp, old, adv, mask, "token-mean", [slice(0, 8)], counts)
    logp.grad = None
    for idx in (slice(0, 3), slice(3, 4), slice(4, 8)):
        loss, _ = get_policy_loss("vanilla")(logp[idx], old[idx], adv[idx], mask[idx], **HYPER)
        (aggregate_loss(loss, mask[idx], "token-mean") / 3).backward()
    assert (logp.grad - whole).abs().max() > 1e-3


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_micro_batch_invariance(mode):
    logp, old, adv, mask = _batch(2)
    vpreds = logp  # any leaf with grad
    returns, values = adv.detach(), old
    counts = dict(global_tokens=mask.sum(), global_seqs=mask.shape[0])
    grads = []
    for rows in ([slice(0, 8)], [slice(0, 5), slice(5, 8)]):
        vpreds.grad = None
        for idx in rows:
            loss, _ = value_loss(vpreds[idx], returns[idx], values[idx], mask[idx], cliprange_value=0.2)
            aggregate_loss(loss, mask[idx], mode, **counts).backward()
        grads.append(vpreds.grad.clone())
    ref.assert_close(grads[1], grads[0], atol=1e-12)


def test_all_policy_losses_covered():
    assert len(POLICY_LOSSES.names()) == 13
