"""Behaviour every in-process engine must show: logprobs, seeds, limits, stops, n distinct samples, weights."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.conftest import prompt_ids, reference_logprobs
from tiller.errors import ConfigError, UserError
from tiller.rollout import RolloutEngine, SamplingParams, build_rollout_engine
from tiller.rollout.base import cpu_bf16_is_fast

ENGINES = ["hf", "native"]


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, 20)])
def test_logprobs_equal_teacher_forced(engine_name, temperature, top_k, qwen):
    model, tok = qwen
    engine = build_rollout_engine(engine_name, model, tok)
    assert isinstance(engine, RolloutEngine)
    prompts = prompt_ids(tok)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=temperature, top_k=top_k,
                                                  max_new_tokens=12, seed=3))
    assert len(out) == 8 and out.prompt_ids[0] == out.prompt_ids[1] == prompts[0]
    for prompt, response, logprobs in zip(out.prompt_ids, out.response_ids, out.logprobs):
        assert len(response) == len(logprobs) >= 1
        ref = reference_logprobs(model, prompt, response, temperature, top_k)
        torch.testing.assert_close(torch.tensor(logprobs), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("engine_name", ENGINES)
def test_same_seed_same_samples_and_n_distinct(engine_name, qwen):
    model, tok = qwen
    engine = build_rollout_engine(engine_name, model, tok)
    prompts = prompt_ids(tok)[:2]
    sp = SamplingParams(n=4, max_new_tokens=16, seed=7, ignore_eos=True)
    a, b = engine.generate(prompts, sp), engine.generate(prompts, sp)
    assert a.response_ids == b.response_ids and a.logprobs == b.logprobs
    c = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=16, seed=8, ignore_eos=True))
    assert c.response_ids != a.response_ids
    # the n samples of one prompt are distinct draws (512-token vocab, 16 tokens: a collision is ~impossible)
    for g in range(2):
        group = [tuple(r) for r in a.response_ids[4 * g : 4 * g + 4]]
        assert len(set(group)) == 4


@pytest.mark.parametrize("engine_name", ENGINES)
def test_max_new_tokens_and_ignore_eos(engine_name, qwen):
    model, tok = qwen
    engine = build_rollout_engine(engine_name, model, tok)
    out = engine.generate(prompt_ids(tok), SamplingParams(n=3, max_new_tokens=9, seed=0, ignore_eos=True))
    assert [len(r) for r in out.response_ids] == [9] * 12
    assert out.finish_reason == ["length"] * 12 and out.num_tokens == 108


@pytest.mark.parametrize("engine_name", ENGINES)
def test_stop_token_id_ends_response(engine_name, qwen):
    model, tok = qwen
    engine = build_rollout_engine(engine_name, model, tok)
    prompts = prompt_ids(tok)[:1]
    free = engine.generate(prompts, SamplingParams(max_new_tokens=20, seed=5, ignore_eos=True))
    stop_tok = free.response_ids[0][6]
    first = free.response_ids[0].index(stop_tok)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=20, seed=5, ignore_eos=True,
                                                  stop_token_ids=[stop_tok]))
    assert out.response_ids[0] == free.response_ids[0][: first + 1]  # stop token kept, nothing after it
    assert out.finish_reason == ["stop"] and len(out.logprobs[0]) == first + 1


@pytest.mark.parametrize("engine_name", ENGINES)
def test_stop_string_truncates_after_string(engine_name, qwen):
    model, tok = qwen
    engine = build_rollout_engine(engine_name, model, tok)
    prompts = prompt_ids(tok)[1:2]
    free = engine.generate(prompts, SamplingParams(max_new_tokens=24, seed=11, ignore_eos=True))
    text = tok.decode(free.response_ids[0])
    # a stop string spelled by the text from the 8th token's decoded piece on (2 characters)
    start = len(tok.decode(free.response_ids[0][:8]))
    stop = text[start : start + 2]
    assert len(stop) == 2
    out = engine.generate(prompts, SamplingParams(max_new_tokens=24, seed=11, ignore_eos=True, stop=[stop]))
    resp = out.response_ids[0]
    assert out.finish_reason == ["stop"]
    assert resp == free.response_ids[0][: len(resp)]
    assert stop in tok.decode(resp) and stop not in tok.decode(resp[:-1])


@pytest.mark.parametrize("engine_name", ENGINES)
def test_bad_input_is_user_error(engine_name, qwen):
    model, tok = qwen
    engine = build_rollout_engine(engine_name, model, tok)
    with pytest.raises(UserError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], SamplingParams())
    with pytest.raises(ConfigError, match="temperature"):
        engine.generate([[1, 2]], SamplingParams(temperature=0.0))
    with pytest.raises(ConfigError, match="did you mean 'native'"):
        build_rollout_engine("nativ", model, tok)


@pytest.mark.parametrize("engine_name", ENGINES)
def test_cast_copy_follows_actor_weights(engine_name, qwen):
    """A dtype-cast copy (bf16 where this CPU has fast bf16, else float64: the same code path) must be
    refreshed by update_weights() after the actor's parameters change."""
    model, tok = qwen
    actor = type(model)(model.config)
    actor.load_state_dict(model.state_dict())
    copy_dtype = torch.bfloat16 if cpu_bf16_is_fast() else torch.float64
    engine = build_rollout_engine(engine_name, actor, tok, dtype=copy_dtype)
    assert engine.weights.is_copy and next(engine.weights.module.parameters()).dtype == copy_dtype
    prompts = prompt_ids(tok)[:2]
    greedy = SamplingParams(do_sample=False, max_new_tokens=8, ignore_eos=True)
    before = engine.generate(prompts, greedy)
    with torch.no_grad():  # what an optimizer step does: change the actor's parameters in place
        for p in actor.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    # the copy follows the in-place change by itself (version counters), and update_weights() is harmless
    after = engine.generate(prompts, greedy)
    engine.update_weights()
    assert engine.generate(prompts, greedy).response_ids == after.response_ids
    assert after.response_ids != before.response_ids
    reference = build_rollout_engine(engine_name, actor, tok, dtype=copy_dtype).generate(prompts, greedy)
    assert after.response_ids == reference.response_ids


def test_bf16_on_a_cpu_without_fast_bf16_falls_back_to_fp32(qwen, monkeypatch):
    import tiller.rollout.base as base

    model, tok = qwen
    monkeypatch.setitem(base._BF16_FAST, "cpu", False)
    with pytest.warns(UserWarning, match="no fast bf16"):
        engine = build_rollout_engine("native", model, tok, dtype="bfloat16")
    assert engine.weights.module is model and not engine.weights.is_copy
    monkeypatch.setitem(base._BF16_FAST, "cpu", True)
    engine = build_rollout_engine("native", model, tok, dtype="bfloat16")
    assert next(engine.weights.module.parameters()).dtype == torch.bfloat16
