"""perf/mfu/actor: verl's FLOPs formula with worked numbers, its device table, and the MFU it gives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tiller.trainer.flops import actor_mfu, device_peak_flops, update_flops

# Qwen2.5-0.5B's body with a 512-token vocabulary (shared/GPU.md): h 896, m 4864, 24 layers, 14 heads of 64, 2 kv heads
QWEN = SimpleNamespace(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, head_dim=64, vocab_size=512)


def test_update_flops_worked_numbers():
    # per layer: MLP 3 x 896 x 4864 = 13,074,432; attention 896 x (896 + 2 x 128 + 896) = 1,835,008
    # N = 24 x 14,909,440 + 2 x 512 x 896 = 357,826,560 + 917,504 = 358,744,064
    # two sequences of 100 and 300 tokens: dense 6 x N x 400; attention 6 x (100^2 + 300^2) x 64 x 14 x 24
    dense = 6 * 358_744_064 * 400
    attention = 6 * 100_000 * 64 * 14 * 24
    assert update_flops(QWEN, [100, 300]) == pytest.approx(dense + attention, rel=1e-12)
    assert update_flops(SimpleNamespace(hidden_size=8), [4]) is None  # not a decoder the formula knows


def test_mfu_against_verls_device_table():
    assert device_peak_flops("NVIDIA H100 80GB HBM3") == device_peak_flops("NVIDIA H200") == 989e12
    assert device_peak_flops("NVIDIA L40S") == 362.05e12 and device_peak_flops("NVIDIA L40") == 181.05e12
    assert device_peak_flops("cpu") is None and device_peak_flops(None) is None
    flops = update_flops(QWEN, [256] * 128)
    # an update of that batch in flops / 989e12 / 0.35 seconds is 35% MFU; two ppo epochs in the same time 70%;
    # two workers sharing it (each timed on its half) 17.5%
    seconds = flops / 989e12 / 0.35
    assert actor_mfu(QWEN, [256] * 128, seconds, 989e12) == pytest.approx(0.35)
    assert actor_mfu(QWEN, [256] * 128, seconds, 989e12, ppo_epochs=2) == pytest.approx(0.70)
    assert actor_mfu(QWEN, [256] * 128, seconds, 989e12, world_size=2) == pytest.approx(0.175)
    assert actor_mfu(QWEN, [256] * 128, seconds, None) is None and actor_mfu(QWEN, [256], 0.0, 989e12) is None
