"""PF-PPO's reweighting (verl's compute_pf_ppo_reweight_data): worked weights, draws in proportion to them."""

from __future__ import annotations

import pytest
import torch

from tiller.algos.pf_ppo import pf_ppo_resample, pf_ppo_weights

SCORES = torch.tensor([1.0, -2.0, 0.5, 0.0])


@pytest.mark.parametrize("method, power, expected", [
    ("pow", 2.0, [1.0, 4.0, 0.25, 1e-8]),  # |s| ** 2 (+ 1e-8)
    ("pow", 1.0, [1.0, 2.0, 0.5, 1e-8]),
    ("max_min", 2.0, [1.0, 1.0, 1e-8, 1e-8]),  # the max 1.0 and the min -2.0
    ("max_random", 2.0, [0.4, 0.1, 0.1, 0.1]),
])
def test_weights_worked_numbers(method, power, expected):
    torch.testing.assert_close(pf_ppo_weights(SCORES, method, power), torch.tensor(expected), rtol=1e-6, atol=1e-9)


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="choose one of"):
        pf_ppo_weights(SCORES, "median")


def test_draws_follow_the_weights_and_repeat_with_the_seed():
    scores = torch.tensor([1.0, -2.0, 0.5, 0.0] * 2500)  # 10,000 draws of a batch of 10,000
    idx = pf_ppo_resample(scores, "pow", 2.0, generator=torch.Generator().manual_seed(0))
    assert idx.shape == (10_000,) and int(idx.min()) >= 0 and int(idx.max()) < 10_000
    share = torch.bincount(idx % 4, minlength=4).double() / 10_000
    # P = [1, 4, 0.25, ~0] / 5.25; binomial sd <= 0.005 at n = 10,000: 0.02 is 4 sd
    torch.testing.assert_close(share, torch.tensor([1, 4, 0.25, 0], dtype=torch.double) / 5.25, atol=0.02, rtol=0)
    assert int((idx % 4 == 3).sum()) == 0  # weight 1e-8: never drawn here
    again = pf_ppo_resample(scores, "pow", 2.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(idx, again)
