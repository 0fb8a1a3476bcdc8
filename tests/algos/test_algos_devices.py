"""Device consistency: every function keeps its outputs on the inputs' device.

The `meta` device has no data but refuses to mix with CPU tensors (except 0-dim scalars), exactly
like CUDA, so these checks catch a stray CPU tensor without a GPU. On a machine with CUDA the same
checks also run there, with real numbers compared against the CPU result.
"""

import pytest
import torch

from tiller.algos import (
    ADV_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    apply_kl_in_reward,
    dpo_loss,
    entropy_from_logits,
    explained_variance,
    fuse_diversity,
    get_advantage_estimator,
    get_policy_loss,
    kl_penalty,
    kto_loss,
    logprobs_from_logits,
    pairwise_rm_loss,
    value_loss,
)

from tiller.algos.policy_losses import bypass_loss_mask, rollout_is_weights_for

DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


def _inputs(device, B=4, T=5):
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(B, T, generator=g)).to(device).requires_grad_(True)
    old = (-torch.rand(B, T, generator=g)).to(device)
    adv = torch.randn(B, T, generator=g).to(device)
    mask = torch.ones(B, T).to(device)
    return logp, old, adv, mask


@pytest.mark.parametrize("device", DEVICES)
def test_policy_losses_and_aggregation_stay_on_device(device):
    logp, old, adv, mask = _inputs(device)
    for name in POLICY_LOSSES.names():
        loss, metrics = get_policy_loss(name)(logp, old, adv, mask)
        assert loss.device.type == device and all(v.device.type == device for v in metrics.values()), name
        for mode in LOSS_AGG_MODES:
            total = aggregate_loss(loss, mask, mode, global_tokens=torch.tensor(20.0, device=device), global_seqs=4)
            assert total.device.type == device
        total.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_advantages_stay_on_device(device):
    _, old, adv, mask = _inputs(device)
    for name in ADV_ESTIMATORS.names():
        a, r = get_advantage_estimator(name)(
            adv, mask, ["a", "a", "b", "b"], old, baseline_rewards=torch.zeros(4, device=device),
            old_logp=old, sum_pi_squared=old.exp(), **({"prime_token_rewards": adv} if name == "prime" else {}),
        )
        assert a.device.type == device and r.device.type == device, name


@pytest.mark.parametrize("device", DEVICES)
def test_other_functions_stay_on_device(device):
    logp, old, adv, mask = _inputs(device)
    outs = [
        kl_penalty(logp, old, "k3+"),
        value_loss(logp, old, adv, mask, 0.2)[0],
        explained_variance(old, adv, mask),
        apply_kl_in_reward(adv, old, logp.detach(), mask, 0.1)[0],
        entropy_from_logits(adv.reshape(2, 2, 5), chunk_size=1),
        logprobs_from_logits(adv.reshape(2, 2, 5), torch.zeros(2, 2, dtype=torch.long, device=device)),
        dpo_loss(adv[:, 0], adv[:, 1], adv[:, 2], adv[:, 3], beta=0.1)[0],
        kto_loss(adv[:, 0], adv[:, 1], adv[:, 2] > 0, adv[0, 0], beta=0.1)[0],
        pairwise_rm_loss(adv[:, 0], adv[:, 1], adv[:, 2]),
        fuse_diversity(adv[:, 0], adv[:, 1], [0, 0, 1, 1], normalization="group_max"),
        rollout_is_weights_for("geo_mean", old.exp(), mask),
        bypass_loss_mask(logp, old, mask, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"),
    ]
    assert all(o.device.type == device for o in outs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    logp, old, adv, mask = _inputs("cpu")
    for name in POLICY_LOSSES.names():
        if name == "clip_cov":
            continue  # random selection
        cpu, _ = get_policy_loss(name)(logp, old, adv, mask)
        gpu, _ = get_policy_loss(name)(logp.detach().cuda(), old.cuda(), adv.cuda(), mask.cuda())
        torch.testing.assert_close(gpu.cpu(), cpu.detach(), atol=1e-5, rtol=1e-5)
    for name in ADV_ESTIMATORS.names():
        kw = dict(baseline_rewards=torch.zeros(4), old_logp=old, sum_pi_squared=old.exp(),
                  **({"prime_token_rewards": adv} if name == "prime" else {}))
        cpu, _ = get_advantage_estimator(name)(adv, mask, [0, 0, 1, 1], old, **kw)
        kw = dict(baseline_rewards=torch.zeros(4, device="cuda"), old_logp=old.cuda(), sum_pi_squared=old.exp().cuda(),
                  **({"prime_token_rewards": adv.cuda()} if name == "prime" else {}))
        gpu, _ = get_advantage_estimator(name)(adv.cuda(), mask.cuda(), [0, 0, 1, 1], old.cuda(), **kw)
        torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-5, rtol=1e-5)
