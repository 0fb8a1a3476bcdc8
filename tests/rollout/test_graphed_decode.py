"""The static-shape decode step (`tiller.rollout.graphed_decode`), run eagerly on CPU: it must equal the eager
engine (greedy tokens, logprobs), padding rows must change nothing, seeded sampling must repeat and not depend on
the batch, and a weight sync must land in the tensors a CUDA graph would have captured."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.device_reads import DEVICE, DeviceReads
from tests.layer_kinds import MOE
from tests.rollout.conftest import (PROMPTS, assert_reads_new_weights, assert_same_rows, load_family, prompt_ids,
                                    reference_logprobs, staggered_greedy)
from tiller.errors import UserError
from tiller.rollout import compiled_decode, SamplingParams, build_rollout_engine
from tiller.rollout.graphed_decode import (bucket_for, capture_sizes, native_decode_options, row_keys,
                                           row_uniforms)

MORE_PROMPTS = PROMPTS + ["x", "Once upon a time there was a little"]


def static_engine(model, tok, **kw):
    return build_rollout_engine("native", model, tok, static_decode=True, **kw)


def edged_engine(model, tok):
    """A static engine with the layers and the step's edges compiled (inputs, tail), as CUDA runs it by default."""
    from tiller.rollout.graphed_decode import GraphedDecoder

    engine = static_engine(model, tok, compile_decode=True)
    engine.generate([[1, 2]], SamplingParams(do_sample=False, max_new_tokens=2))  # (makes its decoder)
    engine._graphed = GraphedDecoder(engine._fused, engine._graphed.sizes, compile=True, compile_edges=True)
    assert engine._graphed._inputs is not None and engine._graphed._tail is not None
    return engine


def test_buckets_are_vllms_sizes():
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(256, [32, 1, 32]) == [1, 32]
    assert [bucket_for(n, [1, 2, 4, 8, 16]) for n in (1, 3, 5, 16, 17)] == [1, 4, 8, 16, None]
    with pytest.raises(UserError, match="cudagraph_capture_sizes"):
        capture_sizes(8, [0, 4])


def test_enforce_eager_false_chooses_graphs_on_cuda_and_compile_on_cpu():
    assert native_decode_options(None, "cuda")["cuda_graphs"] is True  # vLLM's default on a GPU
    assert native_decode_options(False, "cuda", [8]) == {"static_decode": True, "cuda_graphs": True,
                                                        "capture_sizes": [8],
                                                        "compile_decode": compiled_decode.available("cuda")}
    assert native_decode_options(False, "cuda")["cuda_graphs"] is True
    assert native_decode_options(True, "cuda") == {}
    assert native_decode_options(False, "cpu") == {"compile_decode": True}
    assert native_decode_options(None, "cpu") == native_decode_options(True, "cpu") == {}


def test_row_uniforms_are_uniform_repeatable_and_per_row():
    keys = row_keys(7, 200).repeat_interleave(100)
    counters = torch.arange(100).repeat(200)
    u = row_uniforms(keys, counters).squeeze(-1)
    assert u.dtype == torch.float64 and 0 <= u.min() and u.max() < 1
    # 20,000 fixed (not random) values: Kolmogorov-Smirnov distance to U[0, 1) (1% critical value ~0.0115)
    ks = (torch.arange(1, len(u) + 1, dtype=torch.float64) / len(u) - u.sort().values).abs().max()
    assert ks < 0.0115 and abs(float(u.mean()) - 0.5) < 0.005
    assert torch.equal(row_uniforms(keys[1234:1235], counters[1234:1235]).squeeze(-1), u[1234:1235])
    assert torch.equal(row_keys(7, 5), row_keys(7, 200)[:5]) and not torch.equal(row_keys(7, 5), row_keys(8, 5))
    assert len(set(u.tolist())) == len(u)


@pytest.mark.parametrize("arch", ["sharp_qwen", "sharp_llama"])
def test_static_step_equals_the_eager_engine(arch, request):
    model, tok = request.getfixturevalue(arch)
    prompts = prompt_ids(tok, MORE_PROMPTS)  # lengths 1..8 tokens: real left padding
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=20, ignore_eos=True)
    eager = build_rollout_engine("native", model, tok).generate(prompts, greedy)
    engine = static_engine(model, tok)
    static = engine.generate(prompts, greedy)
    assert static.response_ids == eager.response_ids
    assert len(set(map(tuple, static.response_ids))) == len(prompts)
    for a, b in zip(static.logprobs, eager.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    graphed = engine._graphed
    assert graphed.eager_steps == 19 and graphed.captures == 0  # CPU: the step runs eagerly, nothing captured
    assert graphed.cap[0] == 16  # 12 rows run in the bucket of 16


@pytest.mark.parametrize("model_type", ["qwen3", "glm4", *MOE])
def test_static_step_runs_qwen3_glm4_and_experts_layers(model_type, layer_kind_dir):
    """Qwen3's per-head q / k norms, GLM-4's post norms, fused gate-up and half-head paired rotary, and the experts
    blocks of Qwen3-MoE / Qwen2-MoE / Mixtral (the model's module after the layer body) in the static step, eager and
    with the layer body compiled (what a GPU captures; of the experts families Qwen2-MoE): greedy rows equal HF
    `generate`."""
    model, tok = load_family(layer_kind_dir, model_type)
    prompts = prompt_ids(tok, MORE_PROMPTS)
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=12, ignore_eos=True)
    hf = build_rollout_engine("hf", model, tok).generate(prompts, greedy)
    engines = [static_engine(model, tok)]
    if compiled_decode.available() and model_type not in ("qwen3_moe", "mixtral"):  # (one experts family compiled)
        engines.append(edged_engine(model, tok))  # (its rotary tables: GLM-4's paired halves)
    for engine in engines:
        out = engine.generate(prompts, greedy)
        assert engine._graphed is not None and engine._graphed.eager_steps == 11
        assert_same_rows(out, hf, atol=1e-4)
    if len(engines) > 1:
        graphed = engines[1]._graphed
        assert graphed._layer is not None and graphed.compile_error is None
        assert graphed._inputs is not None and graphed._tail is not None  # (no compile fell back to eager)


def test_experts_not_in_bf16_are_not_captured(layer_kind_dir, tiny_model_dir):
    """torch's grouped matmul copies expert offsets to the host unless the experts are bf16 (an H200 refused the
    capture of an fp32 Qwen3-MoE step): such a step is not captured, with the reason naming the layer and dtype; a
    bf16 experts model and a dense one are."""
    from transformers import AutoModelForCausalLM

    from tiller.rollout.fused_decode import FusedDecoder
    from tiller.rollout.graphed_decode import uncapturable_experts

    model, _ = load_family(layer_kind_dir, "qwen3_moe")
    reason = uncapturable_experts(FusedDecoder(model))
    assert reason is not None and reason.startswith("layer 1's experts are torch.float32")  # (layer 0 dense)
    assert uncapturable_experts(FusedDecoder(copy.deepcopy(model).to(torch.bfloat16))) is None
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert uncapturable_experts(FusedDecoder(dense)) is None


def test_stop_tokens_and_compaction_equal_hf(sharp_qwen):
    """Rows stop at different steps (on the device), the host learns it every few steps and compacts the batch
    into smaller buckets; every row still equals HF generate's."""
    model, tok = sharp_qwen
    prompts = prompt_ids(tok, MORE_PROMPTS)
    free = build_rollout_engine("hf", model, tok).generate(
        prompts, SamplingParams(do_sample=False, max_new_tokens=30, ignore_eos=True))
    stops = sorted({r[k] for r, k in zip(free.response_ids, [3, 7, 12, 20, 25, 29])})
    greedy = SamplingParams(do_sample=False, max_new_tokens=30, ignore_eos=True, stop_token_ids=stops)
    hf = build_rollout_engine("hf", model, tok).generate(prompts, greedy)
    engine = static_engine(model, tok, compact_fraction=0.01)
    out = engine.generate(prompts, greedy)
    assert out.response_ids == hf.response_ids and out.finish_reason == hf.finish_reason
    assert len({len(r) for r in out.response_ids}) >= 3 and "stop" in out.finish_reason
    for a, b in zip(out.logprobs, hf.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


def test_padding_rows_change_nothing(sharp_qwen):
    """The same rows at their own size, padded into a bucket of 64, and past every bucket (run at their count)."""
    model, tok = sharp_qwen
    prompts = prompt_ids(tok, MORE_PROMPTS)
    sampled = SamplingParams(n=2, max_new_tokens=12, ignore_eos=True, seed=5, temperature=0.8, top_p=0.95)
    runs = [static_engine(model, tok, capture_sizes=sizes).generate(prompts, sampled) for sizes in ([12], [64], [1])]
    for other in runs[1:]:
        assert other.response_ids == runs[0].response_ids
        for a, b in zip(other.logprobs, runs[0].logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=0)


def test_steps_warmed_before_each_wave_change_nothing(sharp_qwen, monkeypatch):
    """A wave's graphs are captured before it starts (on CUDA): one step of every (bucket, KV width) it can reach,
    on padding rows, before its prefill. Run eagerly here (precapture=True), those steps leave every row unchanged:
    sampled, stopped at different steps and compacted down the buckets, in both waves of a call."""
    from tiller.rollout.graphed_decode import GraphedDecoder

    model, tok = sharp_qwen
    prompts = prompt_ids(tok, MORE_PROMPTS)  # 6 prompts x 3 samples: two waves of at most 16 rows
    sampled = dict(n=3, max_new_tokens=30, seed=5, temperature=0.8, top_p=0.95, ignore_eos=True)
    free = static_engine(model, tok).generate(prompts, SamplingParams(**sampled))
    stops = sorted({r[k] for r, k in zip(free.response_ids, [3, 7, 12, 20, 25])})
    params = SamplingParams(**sampled, stop_token_ids=stops)
    want = static_engine(model, tok, max_num_seqs=16, compact_fraction=0.01).generate(prompts, params)
    warmed, real_warm, real_init = [], GraphedDecoder.warm, GraphedDecoder.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.precapture = True

    monkeypatch.setattr(GraphedDecoder, "__init__", init)
    monkeypatch.setattr(GraphedDecoder, "warm", lambda self, keys, sampler: warmed.append(keys) or real_warm(
        self, keys, sampler))
    got = static_engine(model, tok, max_num_seqs=16, compact_fraction=0.01).generate(prompts, params)
    assert len(warmed) == 2 and max(b for b, _ in warmed[0]) == 16 and (1, 256) in warmed[0]
    assert len({len(r) for r in got.response_ids}) >= 3 and "stop" in got.finish_reason
    assert got.response_ids == want.response_ids and got.finish_reason == want.finish_reason
    for a, b in zip(got.logprobs, want.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=0)


@pytest.mark.parametrize("packed_prefill", [False, True])
def test_the_static_decode_loop_never_reads_the_device(sharp_qwen, monkeypatch, packed_prefill):
    """No host sync per step (`tests.device_reads`: on a CPU, the host's reads of device values and blocking copies
    to the device, each a sync on a GPU). The static-shape decode loop (what CUDA graphs replay) keeps stop flags,
    lengths and tokens on the device, the prefill's inputs (padded chunks or packed prompts) go there without blocking
    copies: a generate's reads are its results' one copy back, the same for 8 and for 40 new tokens (rows stopping at
    different steps, the batch compacted)."""
    from tiller.rollout.graphed_decode import GraphedDecoder

    real_init = GraphedDecoder.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.device = DEVICE  # its buffers are made there

    monkeypatch.setattr(GraphedDecoder, "__init__", init)
    model, tok = sharp_qwen
    prompts = prompt_ids(tok, MORE_PROMPTS)
    counts, lengths = [], set()
    for new in (8, 40):
        engine = static_engine(model, tok, compact_fraction=0.01, packed_prefill=packed_prefill, prefill_tokens=16)
        with DeviceReads(model) as reads:
            free = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=new, seed=1, ignore_eos=True))
            stops = sorted({r[k] for r, k in zip(free.response_ids, [2, 4, 6])})
            reads.reads.clear()
            out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=new, seed=1, ignore_eos=True,
                                                          stop_token_ids=stops))
        assert engine._graphed is not None and engine._graphed.device == DEVICE
        lengths |= {len(r) for r in out.response_ids}
        counts.append(reads.reads)
    assert len(lengths) >= 4 and "stop" in out.finish_reason  # rows stopped at different steps
    assert counts[0] == counts[1] == {("cpu", "rollout/graphed_decode.py:results"): 1}, counts  # its results, once


def test_seeded_sampling_repeats_is_batch_independent_and_reports_its_logprobs(sharp_qwen):
    model, tok = sharp_qwen
    prompts = prompt_ids(tok, MORE_PROMPTS)
    engine = static_engine(model, tok)
    sampled = SamplingParams(n=3, max_new_tokens=10, ignore_eos=True, seed=11, temperature=0.7, top_k=20)
    first, again = engine.generate(prompts, sampled), engine.generate(prompts, sampled)
    assert first.response_ids == again.response_ids
    alone = static_engine(model, tok).generate(prompts[:2], sampled)  # other rows, other bucket
    assert alone.response_ids == first.response_ids[:6]
    other_seed = engine.generate(prompts, SamplingParams(**{**sampled.__dict__, "seed": 12}))
    assert other_seed.response_ids != first.response_ids
    assert len(set(map(tuple, first.response_ids[:3]))) > 1  # the n samples of a prompt differ
    for i, (resp, lps) in enumerate(zip(first.response_ids, first.logprobs)):
        ref = reference_logprobs(model, prompts[i // 3], resp, temperature=0.7, top_k=20)
        torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-4, rtol=0)


@pytest.mark.skipif(not compiled_decode.available(), reason="needs Inductor's C++ backend (a C++ compiler)")
def test_compiled_sampler_draws_the_eager_samplers_tokens():
    """The sampler compiled by Inductor (what the graphed step's tail runs on CUDA) draws the eager sampler's tokens
    with its logprobs (temperature, top-k, top-p and min-p)."""
    from tiller.rollout.graphed_decode import Sampler, _sample

    compiled = torch.compile(_sample, dynamic=True, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 97, generator=gen) * 3
    keys, counters = row_keys(5, 6), torch.arange(6, dtype=torch.long) * 7 + 1
    sampler = Sampler(True, 0.7, 20, 0.9, 0.05)  # every filter in one (each sampler setting compiles: ~10 s)
    with torch.no_grad():  # (as the engine runs it: grad mode is part of what a compiled graph is for)
        want, got = sampler(logits, keys, counters), compiled(sampler, logits, keys, counters)
    assert got[0].tolist() == want[0].tolist()
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)


@pytest.mark.skipif(not compiled_decode.available(), reason="needs Inductor's C++ backend (a C++ compiler)")
def test_compiled_step_edges_equal_the_eager_static_step(sharp_qwen):
    """The step's edges compiled with its layers (what CUDA runs by default: the inputs with their rotary tables and
    mask, and the tail: last residual add, final norm, head, sampler, bookkeeping): seeded samples with every filter,
    their logprobs, and greedy rows ended by stop tokens (lengths set on the device by the compiled tail) equal the
    eager static step's."""
    model, tok = sharp_qwen
    prompts = prompt_ids(tok, MORE_PROMPTS)
    sampled = SamplingParams(n=3, max_new_tokens=10, ignore_eos=True, seed=11, temperature=0.7, top_k=20, top_p=0.9,
                             min_p=0.05)
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=12, ignore_eos=True)
    eager = static_engine(model, tok)
    want_sampled, want_greedy = eager.generate(prompts, sampled), eager.generate(prompts, greedy)
    stops = sorted({want_greedy.response_ids[0][4], want_greedy.response_ids[3][6]})
    stopped = SamplingParams(n=2, do_sample=False, max_new_tokens=12, ignore_eos=True, stop_token_ids=stops)
    want_stopped = eager.generate(prompts, stopped)
    assert any(len(r) < 12 for r in want_stopped.response_ids)  # (the stop ids end rows early)
    engine = edged_engine(model, tok)
    edged = engine._graphed
    assert edged.table_rope
    for params, want in ((sampled, want_sampled), (greedy, want_greedy), (stopped, want_stopped)):
        got = engine.generate(prompts, params)
        assert got.response_ids == want.response_ids
        for a, b in zip(got.logprobs, want.logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    assert engine._graphed is edged and edged.compile_error is None  # (no failed compile fell back to eager)
    assert edged._tail is not None and edged._inputs is not None and edged.replays == 0 and edged.eager_steps > 0


def test_weight_sync_lands_in_the_captured_tensors(sharp_qwen):
    """After an in-place update (an optimizer step), the step reads the new weights from the same tensors (the
    addresses a CUDA graph captured): output equals a fresh engine's on the updated model."""
    model, tok = sharp_qwen
    model = copy.deepcopy(model)
    prompts = prompt_ids(tok, MORE_PROMPTS)
    greedy = SamplingParams(do_sample=False, max_new_tokens=12, ignore_eos=True)
    engine = static_engine(model, tok, fused_decode=True)
    before = engine.generate(prompts, greedy)
    engine._fused.pack = False  # CPU prepacking rebuilds its packed copies; unpacked tensors keep their addresses
    engine._fused._seen = None
    engine._fused.sync()
    addresses = [t[0].data_ptr() for t in engine._fused.qkv + engine._fused.gate_up]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    after = engine.generate(prompts, greedy)
    assert [t[0].data_ptr() for t in engine._fused.qkv + engine._fused.gate_up] == addresses
    fresh = build_rollout_engine("native", model, tok).generate(prompts, greedy)
    assert after.response_ids == fresh.response_ids != before.response_ids


@pytest.mark.skipif(not compiled_decode.available(), reason="no C++ compiler for Inductor")
@pytest.mark.parametrize("arch", ["sharp_qwen", pytest.param("sharp_llama", marks=pytest.mark.slow)])
def test_compiled_layer_step_equals_the_eager_engine(arch, request):
    """The static step with each layer's body compiled by Inductor (what a GPU captures in its graphs, with Triton
    there and C++ here): greedy rows equal the eager engine's, logprobs close, seeded samples equal the uncompiled
    static step's; one compiled function serves every layer and every batch size (one row, checked in the slow
    variant: a specialised second graph); in-place weight updates are read without recompiling."""
    from torch._dynamo.utils import counters

    model, tok = request.getfixturevalue(arch)
    model = copy.deepcopy(model)
    prompts = prompt_ids(tok, MORE_PROMPTS)
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=12, ignore_eos=True)
    graphs_before = counters["stats"]["unique_graphs"]
    eager = build_rollout_engine("native", model, tok)
    engine = static_engine(model, tok, compile_decode=True)
    out = engine.generate(prompts, greedy)
    graphed = engine._graphed
    assert graphed._layer is not None and graphed.compile_error is None
    assert out.response_ids == eager.generate(prompts, greedy).response_ids
    for a, b in zip(out.logprobs, eager.generate(prompts, greedy).logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    if arch == "sharp_llama":  # (slow: one row is a second compile, ~10 s here; the GPU check runs it too)
        one = engine.generate(prompts[:1], SamplingParams(do_sample=False, max_new_tokens=12, ignore_eos=True))
        assert one.response_ids[0] == out.response_ids[0]
    sampled = SamplingParams(n=2, max_new_tokens=10, ignore_eos=True, seed=3, temperature=0.9, top_p=0.9)
    assert engine.generate(prompts, sampled).response_ids == static_engine(model, tok).generate(
        prompts, sampled).response_ids
    assert_reads_new_weights(engine, model, tok, prompts, greedy, out, reference="native")
    assert graphed.compile_error is None
    # one function for every layer, batch size >= 2 and weight version, a second for one row (not one per layer:
    # 24 on a 0.5B model)
    assert counters["stats"]["unique_graphs"] - graphs_before <= 2


def test_a_failing_compile_warns_and_decodes_eagerly(sharp_qwen, monkeypatch):
    model, tok = sharp_qwen
    prompts = prompt_ids(tok, MORE_PROMPTS)
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=8, ignore_eos=True)

    def broken(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("no backend here")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    engine = static_engine(model, tok, compile_decode=True)
    with pytest.warns(UserWarning, match="compiling the decode step's layer failed .*no backend here"):
        out = engine.generate(prompts, greedy)
    assert engine._graphed._layer is None and "no backend here" in engine._graphed.compile_error
    assert out.response_ids == build_rollout_engine("native", model, tok).generate(prompts, greedy).response_ids


def test_continuous_batcher_on_the_static_step(sharp_qwen):
    """The serving batcher (and so the agent endpoint) decodes on the same static step: rows joining and leaving
    at different steps, padded into buckets, give the fused step's tokens and logprobs."""
    model, tok = sharp_qwen
    prompts = prompt_ids(tok, MORE_PROMPTS)
    plain, plain_stats = staggered_greedy(build_rollout_engine("native", model, tok), prompts, 10, max_rows=4)
    outs, stats = staggered_greedy(static_engine(model, tok), prompts, 10, max_rows=4)
    assert plain_stats["static_steps"] == 0 and stats["static_steps"] >= 9
    for a, b in zip(plain, outs):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(torch.tensor(a.logprobs[0]), torch.tensor(b.logprobs[0]), atol=1e-5, rtol=0)


@pytest.mark.skipif(not compiled_decode.available(), reason="no C++ compiler for Inductor")
def test_flex_attention_step_reads_live_blocks_and_equals_the_eager_engine(sharp_qwen):
    """static_attention="flex": FlexAttention over each row's live 128-column blocks gives the eager engine's greedy
    rows and logprobs. Prompts right-aligned at column 150: the long one spans blocks 0-1, the short ones start in
    block 1 (block 0 is never theirs), and the rows write on past column 256 (a 512-column step)."""
    model, tok = sharp_qwen
    long = (prompt_ids(tok, ["The cat sat on the mat and " * 40])[0])[:150]
    prompts = [long, *prompt_ids(tok, MORE_PROMPTS[:3])]
    greedy = SamplingParams(n=1, do_sample=False, max_new_tokens=110, ignore_eos=True)
    engine = static_engine(model, tok, compile_decode=True, static_attention="flex")
    out = engine.generate(prompts, greedy)
    assert engine._graphed.attention == "flex" and engine._graphed.compile_error is None
    assert len(long) == 150 and max(map(len, out.response_ids)) == 110
    eager = build_rollout_engine("native", model, tok).generate(prompts, greedy)
    assert out.response_ids == eager.response_ids
    for a, b in zip(out.logprobs, eager.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    with pytest.raises(UserError, match="static_attention='flex'.*compiled static step only"):
        static_engine(model, tok, static_attention="flex")
    with pytest.raises(UserError, match="static_attention='paged'"):
        static_engine(model, tok, compile_decode=True, static_attention="paged")
