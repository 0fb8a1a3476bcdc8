"""The actor update's model FLOPs utilisation (`perf/mfu/actor`), with verl's formula and device table.

verl (`verl/utils/flops_counter.py`, `_estimate_qwen2_flops`, used for Qwen2 / Llama / Qwen3 / Mistral-style decoders)
counts, for one forward and backward over sequences of lengths s_i (attention-mask sums; tokens = sum s_i):

    dense   = 6 x N x tokens,   N = L x (3 h m + h (q + k + v + o)) + 2 V h      (embedding and LM head both counted)
    attn    = 6 x sum(s_i^2) x head_dim x heads x L                              (causal: half of QK^T and PV, fwd+bwd)

with h the hidden size, m the MLP width, q / k / v / o the projection widths (heads x head_dim, kv heads x head_dim),
V the vocabulary and L the layers. Its actor reports

    perf/mfu/actor = (dense + attn) / update seconds x ppo_epochs / device peak / world size

against a device's dense bf16 peak from a table by device name (H100 / H200: 989 TFLOP/s). The same here, from the
step's batch and the `update_actor` timer. On a CPU, or a device the table does not name, the metric is left out
(verl's CPU entry is a fixed 448 GFLOP/s, which says nothing about the host at hand); `perf/throughput` (tokens per
second per worker) is always logged.

Deviation: verl times its update per worker inside the worker; this is the driver's `update_actor` phase, which for
one worker is the same interval.
"""

from __future__ import annotations

DEVICE_PEAK_FLOPS = {
    "GB200": 2.5e15, "B200": 2.25e15, "MI300X": 1336e12, "H100": 989e12, "H800": 989e12, "H200": 989e12,
    "A100": 312e12, "A800": 312e12, "L40S": 362.05e12, "L40": 181.05e12, "A40": 149.7e12, "L20": 119.5e12,
    "H20": 148e12, "RTX 3070 Ti": 21.75e12,
}
"""Dense bf16 peak FLOP/s by (a substring of) the device name: verl's table, GPUs only."""


def device_peak_flops(device_name: str | None) -> float | None:
    """The table's peak for `device_name` (the longest key it contains, so "L40S" is not read as "L40"), or None.

    >>> device_peak_flops("NVIDIA H100 80GB HBM3"), device_peak_flops("NVIDIA L40S"), device_peak_flops("cpu")
    (989000000000000.0, 362050000000000.0, None)
    """
    if not device_name:
        return None
    hits = [key for key in DEVICE_PEAK_FLOPS if key in device_name]
    return DEVICE_PEAK_FLOPS[max(hits, key=len)] if hits else None


def update_flops(config, seqlens: list[int]) -> float | None:
    """verl's forward + backward FLOPs of a decoder with HF `config` over sequences of `seqlens` tokens, or None
    for a config without the fields the formula reads (hidden_size, intermediate_size, heads, layers, vocabulary)."""
    config = getattr(config, "text_config", None) or config
    try:
        h, m, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
        heads, vocab = config.num_attention_heads, config.vocab_size
    except AttributeError:
        return None
    if not isinstance(m, int):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q = o = heads * head_dim
    kv = kv_heads * head_dim
    n_dense = layers * (3 * h * m + h * (q + 2 * kv + o)) + 2 * vocab * h
    tokens = sum(seqlens)
    attention = 6 * sum(s * s for s in seqlens) * head_dim * heads * layers
    return 6.0 * n_dense * tokens + attention


def actor_mfu(config, seqlens: list[int], seconds: float, peak: float | None, ppo_epochs: int = 1,
              world_size: int = 1) -> float | None:
    """`perf/mfu/actor` as verl computes it; None when the peak, the model's shape or the time is unknown."""
    flops = update_flops(config, seqlens)
    if flops is None or not peak or seconds <= 0:
        return None
    return flops * ppo_epochs / seconds / peak / world_size
