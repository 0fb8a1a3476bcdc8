"""The decode step compiled with torch.compile (opt-in: rollout.enforce_eager=False, tiller serve --compile): the
same tokens as eager decoding and HF generate, with the packed weights re-read after a weight change and the
continuous batcher's slot cache; refused with a clear error where it cannot run."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.rollout.conftest import PROMPTS, assert_reads_new_weights, prompt_ids, staggered_greedy
from tiller.errors import UserError
from tiller.rollout import compiled_decode, SamplingParams, build_rollout_engine

pytestmark = pytest.mark.skipif(not compiled_decode.available(), reason="no C++ compiler for Inductor")

GREEDY = SamplingParams(n=2, do_sample=False, max_new_tokens=12, ignore_eos=True)


def test_compiled_decode_equals_eager_and_hf(sharp_qwen):
    model, tok = sharp_qwen
    model = copy.deepcopy(model)  # Qwen2: q / k / v biases go through the opaque matmul op
    prompts = prompt_ids(tok, PROMPTS)
    hf = build_rollout_engine("hf", model, tok).generate(prompts, GREEDY)
    engine = build_rollout_engine("native", model, tok, compile_decode=True)
    out = engine.generate(prompts, GREEDY)
    assert engine._fused.compiled is not None
    assert out.response_ids == hf.response_ids
    for a, b in zip(out.logprobs, hf.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    # one row is a second (specialised) graph
    one = engine.generate(prompts[:1], SamplingParams(do_sample=False, max_new_tokens=12, ignore_eos=True))
    assert one.response_ids[0] == hf.response_ids[0]
    # weights changed in place (an optimizer step): the compiled step reads the re-packed weights, no stale copy
    assert_reads_new_weights(engine, model, tok, prompts, GREEDY, out, reference="hf")


def test_continuous_batcher_with_the_compiled_step(qwen):
    """Rows joining at different steps (the slot cache's per-row write columns) give eager decoding's tokens."""
    model, tok = qwen
    prompts = prompt_ids(tok, PROMPTS)
    eager = build_rollout_engine("native", model, tok)
    compiled = build_rollout_engine("native", model, tok, compile_decode=True)
    results = [staggered_greedy(engine, prompts, 8, max_rows=3, timeout=300)[0] for engine in (eager, compiled)]
    assert compiled._fused.compiled is not None
    for a, b in zip(*results):
        assert a.response_ids == b.response_ids
        assert a.logprobs[0] == pytest.approx(b.logprobs[0], abs=1e-4)


def test_compile_refused_without_a_compiler(qwen, monkeypatch):
    model, tok = qwen
    monkeypatch.setattr(compiled_decode, "available", lambda device_type="cpu": False)
    with pytest.raises(UserError, match="C\\+\\+ compiler"):
        build_rollout_engine("native", model, tok, compile_decode=True)


def test_each_compiled_step_has_its_own_dynamo_cache():
    """Dynamo keeps at most `recompile_limit` graphs per code object: steps compiled for 9 engines on one code object
    fail on the ninth under fullgraph=True; `own_code` gives each its own (backend "eager": Dynamo's caching alone)."""
    import torch._dynamo

    class Step:
        def __init__(self, k: int):
            self.kind = f"kind{k}"  # a string the graph branches on: each instance is another graph

        def graph(self, x):
            return x + 1 if self.kind == "kind0" else x * len(self.kind)

    limit = torch._dynamo.config.recompile_limit
    x = torch.ones(2)
    torch._dynamo.reset()
    try:
        shared = [torch.compile(Step(k).graph, backend="eager", fullgraph=True) for k in range(limit + 1)]
        for fn in shared[:limit]:
            fn(x)
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            shared[limit](x)
        own = [torch.compile(compiled_decode.own_code(Step(k).graph), backend="eager", fullgraph=True)
               for k in range(limit + 1)]
        assert [fn(x)[0].item() for fn in own] == [2.0] + [float(len(f"kind{k}")) for k in range(1, limit + 1)]
    finally:
        torch._dynamo.reset()
