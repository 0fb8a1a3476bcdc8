"""PRIME (tiller.algos.prime): the implicit reward, the PRM's cross-entropy loss and the advantages, worked numbers."""

import math

import pytest
import torch

from tiller.algos import get_advantage_estimator
from tiller.algos.prime import implicit_log_ratio, prime_prm_loss, prime_token_rewards
from tiller.errors import DataError

D = torch.float64
LN2 = math.log(2.0)


def _close(actual, expected, rel=1e-9):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=rel, atol=1e-9)


def test_implicit_reward_and_prm_loss_worked_numbers():
    # pi_prm = (.5, .5), pi_ref = (.25, .5): q = (ln2, 0); beta = 0.5 -> r_phi(y) = 0.5 ln2 = 0.346574.
    # sigmoid(0.346574) = 1 / (1 + 2^-0.5) = 0.585786.
    # label 1: -log sigmoid = log(1 + 2^-0.5) = 0.534800; label 0: log(1 + 2^0.5) = 0.881374.
    # d loss(label 1) / d log pi_prm(y_t) = -(1 - 0.585786) * 0.5 = -0.207107 on each response token.
    prm = torch.tensor([[math.log(0.5), math.log(0.5), 0.0]] * 2, dtype=D, requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.5), -9.0]] * 2, dtype=D)
    mask = torch.tensor([[1, 1, 0]] * 2)
    q = implicit_log_ratio(prm.detach(), ref, mask)
    assert q[0].tolist() == pytest.approx([LN2, 0.0, 0.0])  # padding gives 0 whatever the log-probs
    loss, m = prime_prm_loss(prm, ref, mask, torch.tensor([1.0, 0.0]), beta=0.5)
    assert loss.tolist() == pytest.approx([0.534800, 0.881374], abs=1e-6)
    assert float(m["implicit_reward"]) == pytest.approx(0.5 * LN2)
    assert float(m["prm_acc"]) == pytest.approx(0.5)  # r > 0: right for label 1, wrong for label 0
    loss[0].backward()
    assert prm.grad[0].tolist() == pytest.approx([-0.207107, -0.207107, 0.0], abs=1e-6)


def test_dense_token_rewards_worked_numbers():
    # q = [[1, 2, pad], [-1, 1, 3]], beta 0.1 -> r = [[.1, .2, 0], [-.1, .1, .3]].
    # reverse cumulative sums: [.3, .2, 0], [.3, .4, .3]: max |.| = 0.4, so batch_norm gives r / 0.4.
    q = torch.tensor([[1.0, 2.0, 5.0], [-1.0, 1.0, 3.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    _close(prime_token_rewards(q, mask, 0.1, "token", "none"), [[0.1, 0.2, 0.0], [-0.1, 0.1, 0.3]])
    _close(prime_token_rewards(q, mask, 0.1, "token", "batch_norm"), [[0.25, 0.5, 0.0], [-0.25, 0.25, 0.75]], rel=1e-4)
    # whole: the sum on the last token (.3 at t=1, .3 at t=2); batch_norm: / 0.3
    _close(prime_token_rewards(q, mask, 0.1, "whole", "none"), [[0.0, 0.3, 0.0], [0.0, 0.0, 0.3]])
    _close(prime_token_rewards(q, mask, 0.1, "whole", "batch_norm"), [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], rel=1e-4)
    with pytest.raises(DataError, match="granularity"):
        prime_token_rewards(q, mask, 0.1, "step", "none")


def _group():
    # one prompt, K = 3 samples, T = 2; sample 1 has one token.
    dense = torch.tensor([[0.2, 0.4], [0.1, 0.0], [-0.3, 0.1]], dtype=D)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    outcome = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]], dtype=D)  # on the last token
    return dense, mask, outcome


def test_prime_advantage_worked_numbers():
    # per-token means of the dense rewards: 0.3, 0.1, -0.1. Leave-one-out baselines: (0.1 - 0.1)/2 = 0,
    # (0.3 - 0.1)/2 = 0.1, (0.3 + 0.1)/2 = 0.2 -> dense: [.2, .4], [0, -], [-.5, -.1].
    # outcomes 1, 0, 0 -> RLOO 1 - 0 = 1, 0 - 0.5 = -0.5, -0.5 (on each last token).
    # rewards with dpo_coef 1, gt_coef 2: [.2, 2.4], [-1, -], [-.5, -1.1]; returns (gamma 1): [2.6, 2.4], [-1, -],
    # [-1.6, -1.1]. Whitened over the 5 valid tokens: mean 0.26, unbiased var 16.952 / 4 = 4.238.
    dense, mask, outcome = _group()
    prime = get_advantage_estimator("prime")
    adv, ret = prime(outcome, mask, ["a", "a", "a"], None, prime_token_rewards=dense, reward_dpo_coef=1.0,
                     reward_gt_coef=2.0)
    _close(ret, [[2.6, 2.4], [-1.0, 0.0], [-1.6, -1.1]])
    std = math.sqrt(4.238)
    expect = [[(2.6 - .26) / std, (2.4 - .26) / std], [(-1 - .26) / std, 0.0], [(-1.6 - .26) / std, (-1.1 - .26) / std]]
    _close(adv, expect, rel=1e-6)
    # gamma 0.5: the first token's return is 0.2 + 0.5 * 2.4 = 1.4
    _, ret = prime(outcome, mask, ["a"] * 3, None, prime_token_rewards=dense, reward_dpo_coef=1.0,
                   reward_gt_coef=2.0, gamma=0.5)
    assert ret[0].tolist() == pytest.approx([1.4, 2.4])


def test_prime_advantage_groups_are_separate_and_singletons_keep_their_rewards():
    dense, mask, outcome = _group()
    prime = get_advantage_estimator("prime")
    both = torch.cat([dense, dense]), torch.cat([mask, mask]), torch.cat([outcome, outcome])
    _, ret2 = prime(both[2], both[1], ["a"] * 3 + ["b"] * 3, None, prime_token_rewards=both[0],
                    reward_dpo_coef=1.0, reward_gt_coef=2.0)
    _, ret1 = prime(outcome, mask, ["a"] * 3, None, prime_token_rewards=dense, reward_dpo_coef=1.0,
                    reward_gt_coef=2.0)
    assert torch.allclose(ret2[:3], ret1) and torch.allclose(ret2[3:], ret1)
    # a group of one: no baseline; default coefficients 5: rewards [5 * .2, 5 * .4 + 5 * 1] -> returns [8, 7]
    _, ret = prime(outcome[:1], mask[:1], ["x"], None, prime_token_rewards=dense[:1])
    _close(ret, [[1.0 + 2.0 + 5.0, 2.0 + 5.0]])
    with pytest.raises(DataError, match="prime_token_rewards"):
        prime(outcome, mask, ["a"] * 3, None)
