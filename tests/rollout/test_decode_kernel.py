"""The C one-token attention kernel (tiller.rollout.decode_kernel) against PyTorch's SDPA, and its fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.rollout.conftest import PROMPTS, prompt_ids
from tiller.rollout import build_rollout_engine, SamplingParams
from tiller.rollout import decode_kernel

needs_cc = pytest.mark.skipif(decode_kernel.compiler() is None, reason="no C compiler on PATH")


def _inputs(b, hk, group, d, length, dtype, seed=0):
    """q [B, Hk, G, D]; k / v as column views of a wider cache (as the engine's); a bool mask with left padding
    and one row masked further."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hk, group, d, generator=g).to(dtype)
    k = torch.randn(b, hk, length + 7, d, generator=g).to(dtype)[:, :, 3:3 + length]
    v = torch.randn(b, hk, length + 7, d, generator=g).to(dtype)[:, :, 3:3 + length]
    valid = torch.ones(b, length, dtype=torch.bool)
    valid[:, :2] = False
    valid[1, : length // 2] = False
    return q, k, v, valid[:, None, None, :]


@needs_cc
@pytest.mark.parametrize("group,d", [(1, 32), (4, 64), (2, 128), (6, 32), (8, 16)])  # 6: four + two heads
def test_kernel_equals_sdpa_fp32(group, d):
    q, k, v, mask = _inputs(5, 2, group, d, 37, torch.float32)
    kernel = decode_kernel.attention_kernel(2 * group, 2, d, d ** -0.5, torch.device("cpu"), torch.float32)
    assert kernel is not None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d ** -0.5)
    torch.testing.assert_close(kernel(q, k, v, mask), ref, atol=2e-6, rtol=1e-5)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    torch.testing.assert_close(kernel(q, k, v, additive), ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(kernel(q, k, v, None),
                               F.scaled_dot_product_attention(q, k, v, scale=d ** -0.5), atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="built for group"):  # another shape would read the wrong memory
        kernel(q[:, :, :1].expand(-1, -1, group + 1, -1), k, v, mask)
    with pytest.raises(ValueError, match="one dtype"):
        kernel(q, k.to(torch.bfloat16), v, mask)
    # rows split over two threads: the same numbers
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.testing.assert_close(kernel(q, k, v, mask), ref, atol=2e-6, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


@needs_cc
def test_fully_masked_row_stays_finite():
    """A row with every column masked (never sampled from) averages its values instead of producing NaN."""
    q, k, v, mask = _inputs(3, 2, 4, 64, 9, torch.float32)
    mask = mask.clone()
    mask[2] = False
    kernel = decode_kernel.attention_kernel(8, 2, 64, 0.125, torch.device("cpu"), torch.float32)
    out = kernel(q, k, v, mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[2], v[2].mean(1, keepdim=True).expand(2, 4, 64), atol=1e-5, rtol=1e-5)
    ref = F.scaled_dot_product_attention(q[:2], k[:2], v[:2], attn_mask=mask[:2], scale=0.125)
    torch.testing.assert_close(out[:2], ref, atol=2e-6, rtol=1e-5)


@needs_cc
def test_kernel_bf16_is_fp32_math_rounded_once():
    q, k, v, mask = _inputs(4, 2, 4, 64, 50, torch.bfloat16, seed=1)
    kernel = decode_kernel.attention_kernel(8, 2, 64, 0.125, torch.device("cpu"), torch.bfloat16)
    out = kernel(q, k, v, mask)
    assert out.dtype == torch.bfloat16
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125)
    # fp32 math on the bf16 inputs, rounded to bf16 once: within half a bf16 ulp (2^-9 relative) of the exact
    torch.testing.assert_close(out.float(), exact, atol=1e-3, rtol=2 ** -8)
    assert (out.float() - exact).abs().max() <= (F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.125).float() - exact).abs().max() + 1e-3


def test_kernel_does_not_apply_everywhere(monkeypatch):
    cpu = torch.device("cpu")
    assert decode_kernel.attention_kernel(4, 2, 24, 1.0, cpu, torch.float32) is None  # head dim not 16k
    assert decode_kernel.attention_kernel(4, 2, 64, 1.0, cpu, torch.float16) is None
    assert decode_kernel.attention_kernel(4, 2, 64, 1.0, torch.device("meta"), torch.float32) is None
    monkeypatch.setenv("TILLER_DECODE_KERNEL", "0")
    assert decode_kernel.attention_kernel(4, 2, 64, 1.0, cpu, torch.float32) is None
    monkeypatch.delenv("TILLER_DECODE_KERNEL")
    monkeypatch.setattr(decode_kernel, "_LIBS", {})
    monkeypatch.setattr(decode_kernel, "compiler", lambda: None)
    assert decode_kernel.attention_kernel(4, 2, 64, 1.0, cpu, torch.float32) is None


@needs_cc
def test_failed_build_warns_and_falls_back(monkeypatch, tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(decode_kernel, "_LIBS", {})
    monkeypatch.setattr(decode_kernel, "_SOURCE", bad)
    monkeypatch.setenv("TILLER_CACHE", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="building the decode-attention kernel failed"):
        assert decode_kernel.attention_kernel(4, 2, 64, 1.0, torch.device("cpu"), torch.float32) is None
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []  # no half-written library left behind


@needs_cc
@pytest.mark.parametrize("fixture", ["sharp_qwen", "sharp_llama"])
def test_engine_with_the_kernel_equals_sdpa_decoding(fixture, request):
    model, tok = request.getfixturevalue(fixture)
    prompts = prompt_ids(tok, PROMPTS)
    outs = []
    for use in (False, True):
        engine = build_rollout_engine("native", model, tok, decode_kernel=use)
        outs.append(engine.generate(prompts, SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=5)))
        assert any(kern is not None for kern in engine._fused._kernels.values()) == use
    assert outs[0].response_ids == outs[1].response_ids
    for a, b in zip(outs[0].logprobs, outs[1].logprobs):
        assert a == pytest.approx(b, abs=1e-5)


@needs_cc
def test_loading_the_kernel_keeps_denormals_in_the_loading_thread(tmp_path):
    # -ffast-math at link time would add crtfastmath.o, whose constructor sets flush-to-zero / denormals-are-zero
    # in the thread that loads the library: every later float op of that thread (training) would change
    import os
    import subprocess
    import sys

    code = ("import torch\nfrom tiller.rollout import decode_kernel\n"
            "assert decode_kernel.attention_kernel(8, 2, 32, 0.1, torch.device('cpu'), torch.float32) is not None\n"
            "print(float(torch.tensor([1e-39]) * torch.tensor([1.0])))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "TILLER"))}
    env["TILLER_CACHE"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip()) == pytest.approx(1e-39, rel=1e-3, abs=0)  # a denormal, not flushed to 0
    assert [p.suffix for p in (tmp_path / "kernels").iterdir()] == [".so"]  # no object file left behind


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_prefix_is_never_read(dtype):
    """Each row's keys / values before its first unmasked column (a right-aligned prompt's padding) are not read:
    NaN there leaves the output equal to SDPA's on clean inputs (a read would turn the row into NaN), and a mask
    with a hole after the first unmasked column still masks the hole."""
    q, k, v, mask = _inputs(4, 2, 4, 64, 40, dtype, seed=2)
    mask = mask.clone()
    mask[3, ..., 20:23] = False  # a hole: masked, but after the row's first unmasked column
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125)
    first = mask[:, 0, 0].to(torch.uint8).argmax(-1)
    k, v = k.clone(), v.clone()
    for row, col in enumerate(first.tolist()):
        k[row, :, :col] = float("nan")
        v[row, :, :col] = float("nan")
    kernel = decode_kernel.attention_kernel(8, 2, 64, 0.125, torch.device("cpu"), dtype)
    out = kernel(q, k, v, mask).float()
    assert torch.isfinite(out).all()
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=2 ** -8)
    torch.testing.assert_close(out, ref, **tol)
