"""tiller's Triton decode attention (`tiller.rollout.triton_decode`, `static_attention="triton"`): on a CPU, Triton's
interpreter runs the same kernels (a child process with TRITON_INTERPRET=1: triton reads it when its kernels are
defined). CI installs triton for this file only (.ci/run); without it the kernel tests skip and the refusal is
checked."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiller.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (CI installs it for this file: .ci/run)")


def interpret(code: str, timeout: int = 300) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@needs_triton
def test_kernel_equals_masked_sdpa_over_live_columns():
    """Each row attends over its own live columns [start, end] only: SDPA with that mask gives the same output for
    GQA groups (7 query heads a KV head, as Qwen2.5-0.5B), one query head, a head dim that is no power of two, one
    live column, rows ending on a split's edge, splits merged (a small grid splits the columns), and the cache's
    other rows and columns past `end` filled with garbage that must not be read."""
    out = interpret("""
        import torch
        from tiller.rollout import triton_decode as td
        g = torch.Generator().manual_seed(0)
        worst = 0.0
        for b, hk, group, dim, cols in [(3, 2, 7, 64, 200), (5, 1, 1, 32, 64), (2, 2, 4, 80, 300), (1, 1, 2, 16, 129)]:
            q = torch.randn(b, hk, group, dim, generator=g)
            k = torch.randn(b + 2, hk, cols, dim, generator=g)
            v = torch.randn(b + 2, hk, cols, dim, generator=g)
            start = torch.randint(0, cols // 2, (b,), generator=g)
            end = torch.minimum(start + torch.randint(0, cols, (b,), generator=g), torch.tensor(cols - 1))
            end[0] = start[0]  # one live column
            if b > 1:
                start[1], end[1] = 0, td.splits_for(b, hk, cols)[1] - 1  # ends on a split's edge
            want = td.reference(q, k, v, start, end, dim ** -0.5)
            for row in range(b):  # garbage past each row's end and in the rows below: never read
                k[row, :, end[row] + 1:] = float("nan")
                v[row, :, end[row] + 1:] = float("nan")
            got = torch.ops.tiller.decode_attention_live(q, k, v, start, end, dim ** -0.5)
            assert td.splits_for(b, hk, cols)[0] > 1 or cols <= 64
            worst = max(worst, float((got - want).abs().max()))
        singles = 0
        for target in (td.TARGET_PROGRAMS, 1):  # also every shape in one split (256 rows of 2 heads run so):
            td.TARGET_PROGRAMS = target  # the first kernel writes the output, no merge
            for b, hk, group, dim, cols in [(3, 2, 7, 64, 200), (4, 1, 3, 48, 64)]:
                # q a view as the step passes it: the query heads of a [b, Hq + Hk, D] rotary output
                q = torch.randn(b, hk * group + hk, dim, generator=g)[:, : hk * group].reshape(b, hk, group, dim)
                assert not q.is_contiguous()
                k, v = torch.randn(b, hk, cols, dim, generator=g), torch.randn(b, hk, cols, dim, generator=g)
                start = torch.randint(0, cols // 2, (b,), generator=g)
                end = torch.minimum(start + torch.randint(0, cols, (b,), generator=g), torch.tensor(cols - 1))
                want = td.reference(q, k, v, start, end, dim ** -0.5)
                got = torch.ops.tiller.decode_attention_live(q, k, v, start, end, dim ** -0.5)
                singles += td.splits_for(b, hk, cols)[0] == 1
                worst = max(worst, float((got - want).abs().max()))
        assert singles == 3, singles
        print(worst)
    """)
    assert float(out.split()[-1]) < 1e-5


@needs_triton
def test_static_step_with_the_triton_kernel_equals_the_eager_engine(tiny_model_dir):
    """The static decode step with static_attention="triton" (eager layers, and layers compiled by Inductor's C++
    backend with the kernel an opaque custom op inside, then with the step's inputs and tail compiled too) gives the
    eager engine's greedy rows and logprobs, with a prompt that starts past the first block and rows of different
    lengths."""
    out = interpret(f"""
        import torch
        from tests.rollout.conftest import load, prompt_ids, PROMPTS
        from tiller.rollout import build_rollout_engine, SamplingParams, compiled_decode
        from tiller.rollout.graphed_decode import GraphedDecoder
        model, tok = load({str(tiny_model_dir)!r}, sharpen=0.1)
        prompts = [prompt_ids(tok, ["The cat sat on the mat and " * 12])[0][:70], *prompt_ids(tok, PROMPTS[:2])]
        greedy = SamplingParams(n=1, do_sample=False, max_new_tokens=4, ignore_eos=True)
        eager = build_rollout_engine("native", model, tok).generate(prompts, greedy)
        for compiled in (False, True) if compiled_decode.available("cpu") else (False,):
            engine = build_rollout_engine("native", model, tok, static_decode=True, compile_decode=compiled,
                                          static_attention="triton")
            got = engine.generate(prompts, greedy)
            assert engine._graphed.attention == "triton" and engine._graphed.compile_error is None
            if compiled:  # and the step's edges compiled too, as CUDA runs it (inputs without a mask, the tail)
                engine._graphed = GraphedDecoder(engine._fused, engine._graphed.sizes, compile=True,
                                                 attention="triton", compile_edges=True)
                got = engine.generate(prompts, greedy)
                assert engine._graphed._inputs is not None and engine._graphed._tail is not None
            assert got.response_ids == eager.response_ids, (got.response_ids, eager.response_ids)
            err = max(abs(a - b) for x, y in zip(got.logprobs, eager.logprobs) for a, b in zip(x, y))
            print(compiled, err)
            assert err < 1e-4
    """, timeout=600)
    assert "False" in out


def test_triton_attention_is_refused_where_it_cannot_run(sharp_qwen):
    """Without Triton's interpreter on a CPU (and without a GPU), the option says what it needs."""
    from tiller.rollout import build_rollout_engine, triton_decode

    if triton_decode.available("cpu"):
        pytest.skip("Triton's interpreter is on in this process")
    model, tok = sharp_qwen
    with pytest.raises(UserError, match="static_attention='triton' needs Triton"):
        build_rollout_engine("native", model, tok, static_decode=True, static_attention="triton")
