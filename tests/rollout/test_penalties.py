"""Repetition, presence and frequency penalties: the math with worked numbers, and every engine path (native eager,
the static step's fallback, hf, the continuous batcher) sampling from the same penalised distribution, with
logprobs checked against an independent teacher-forced reference."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from tests.rollout.conftest import prompt_ids
from tiller.errors import ConfigError
from tiller.rollout import SamplingParams, build_rollout_engine
from tiller.rollout.sampling import PenaltyState, apply_penalties, token_counts

PENALTIES = dict(repetition_penalty=1.6, presence_penalty=0.4, frequency_penalty=0.3)


def test_apply_penalties_worked_numbers():
    # token 0 is in the prompt, token 1 twice in the response, token 2 nowhere.
    # repetition 2: 2.0 -> 2.0 / 2 = 1.0 (positive: divided); -1.0 -> -1.0 * 2 = -2.0 (negative: multiplied);
    # then frequency 0.25 x count 2 = 0.5 and presence 0.1 come off token 1 only (prompt tokens do not count):
    # [1.0, -2.0 - 0.5 - 0.1, 0.5] = [1.0, -2.6, 0.5]
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    seen = token_counts([[0]], 3, "cpu") > 0
    counts = token_counts([[1, 1]], 3, "cpu")
    assert counts.tolist() == [[0.0, 2.0, 0.0]]
    out = apply_penalties(logits, seen, counts, 2.0, 0.1, 0.25)
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.6, 0.5]]))
    assert logits.tolist() == [[2.0, -1.0, 0.5]]  # the input is left alone
    # neutral settings change nothing; -inf (a suppressed token) stays -inf
    inf = torch.tensor([[float("-inf"), 1.0, 0.5]])
    assert apply_penalties(inf, seen, counts, 1.0, 0.0, 0.0).tolist() == inf.tolist()
    assert apply_penalties(inf, seen, counts, 3.0, 1.0, 1.0)[0, 0].item() == float("-inf")


def test_repetition_penalty_equals_transformers_processor():
    """HF's RepetitionPenaltyLogitsProcessor over prompt + response ids (no padding) is the same function."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((3, 50), generator=gen)
    prompts, responses = [[1, 2, 3], [4], [5, 5, 9]], [[7, 1], [4, 4, 8], []]
    for pen in (1.3, 0.7):
        want = torch.stack([RepetitionPenaltyLogitsProcessor(pen)(torch.tensor([p + r]), logits[i:i + 1].clone())[0]
                            for i, (p, r) in enumerate(zip(prompts, responses))])
        got = apply_penalties(logits, token_counts(prompts, 50, "cpu") > 0, token_counts(responses, 50, "cpu"), pen)
        torch.testing.assert_close(got, want)
        assert (got != logits).sum() == 4 + 2 + 2  # each row's distinct seen tokens changed, nothing else


def test_penalty_state_follows_its_rows():
    state = PenaltyState([[1], [2], [3]], 4, "cpu", 2.0, 0.0, 1.0)
    state.record(torch.tensor([0, 0, 3]))
    state.select(torch.tensor([0, 2]))  # the middle row left the batch
    state.record(torch.tensor([0, 1]))
    assert state.output_counts.tolist() == [[2.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 1.0]]
    assert state.prompt_seen.tolist() == [[False, True, False, False], [False, False, False, True]]


def reference_penalised_logprobs(model, prompt, response, temperature, repetition_penalty, presence_penalty,
                                 frequency_penalty):
    """Teacher-forced logprobs of `response` with the penalties applied position by position in plain Python
    (independent of `apply_penalties`): vLLM's rules, then temperature, then log_softmax."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    out = []
    for t, token in enumerate(response):
        row = logits[len(prompt) - 1 + t].clone()
        so_far = list(response[:t])
        for tok in set(prompt) | set(so_far):
            row[tok] = row[tok] / repetition_penalty if row[tok] > 0 else row[tok] * repetition_penalty
        for tok in set(so_far):
            row[tok] -= frequency_penalty * so_far.count(tok) + presence_penalty
        out.append(torch.log_softmax(row / temperature, dim=-1)[token].item())
    return torch.tensor(out)


@pytest.mark.parametrize("engine_name,kw", [("native", {}), ("hf", {}), ("native", {"static_decode": True})])
def test_sampled_logprobs_are_those_of_the_penalised_distribution(engine_name, kw, qwen):
    model, tok = qwen
    engine = build_rollout_engine(engine_name, model, tok, **kw)
    prompts = prompt_ids(tok)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=0.8, max_new_tokens=12, seed=3, ignore_eos=True,
                                                  **PENALTIES))
    for prompt, response, logprobs in zip(out.prompt_ids, out.response_ids, out.logprobs):
        ref = reference_penalised_logprobs(model, prompt, response, 0.8, **PENALTIES)
        torch.testing.assert_close(torch.tensor(logprobs), ref, atol=1e-4, rtol=0)


def test_greedy_with_penalties_native_equals_hf_and_breaks_repeats(qwen, sharp_qwen):
    model, tok = qwen  # the kit's fresh init: greedy repeats one token
    prompts = prompt_ids(tok)
    plain = build_rollout_engine("native", model, tok).generate(
        prompts, SamplingParams(do_sample=False, max_new_tokens=16, ignore_eos=True))
    greedy = SamplingParams(do_sample=False, max_new_tokens=16, ignore_eos=True, repetition_penalty=3.0,
                            frequency_penalty=1.0)
    native = build_rollout_engine("native", model, tok).generate(prompts, greedy)
    hf = build_rollout_engine("hf", model, tok).generate(prompts, greedy)
    assert native.response_ids == hf.response_ids
    for a, b in zip(native.logprobs, hf.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    distinct = [len(set(r)) for r in plain.response_ids], [len(set(r)) for r in native.response_ids]
    assert all(d <= 3 for d in distinct[0]), distinct  # without penalties: one or two tokens on repeat
    assert all(d >= 8 for d in distinct[1]), distinct
    # rows leaving the batch early (stop ids; compaction after every stop) keep their own counts
    model, tok = sharp_qwen
    prompts = prompt_ids(tok) * 2
    free = build_rollout_engine("hf", model, tok).generate(prompts, greedy)
    stops = sorted({r[k] for r, k in zip(free.response_ids, [3, 6, 9, 12])})
    stopping = SamplingParams(**{**vars(greedy), "stop_token_ids": stops})
    hf = build_rollout_engine("hf", model, tok).generate(prompts, stopping)
    native = build_rollout_engine("native", model, tok, compact_fraction=0.01).generate(prompts, stopping)
    assert native.response_ids == hf.response_ids and "stop" in native.finish_reason
    assert len({len(r) for r in native.response_ids}) >= 2


def test_continuous_batcher_applies_each_requests_penalties(tiny_model_dir):
    from tiller.evaluation.runner import load_policy
    from tiller.rollout.continuous import ContinuousBatcher

    policy = load_policy(str(tiny_model_dir), dtype="float32")
    prompts = prompt_ids(policy.tokenizer)
    penalised = SamplingParams(do_sample=False, max_new_tokens=10, ignore_eos=True, **PENALTIES)
    plain = SamplingParams(do_sample=False, max_new_tokens=10, ignore_eos=True)
    want_pen, want_plain = policy.engine.generate(prompts, penalised), policy.engine.generate(prompts, plain)
    assert want_pen.response_ids != want_plain.response_ids
    batcher = ContinuousBatcher(policy.engine, max_rows=8)
    try:  # both kinds of request share the running batch
        futures = [(batcher.submit([p], penalised), batcher.submit([p], plain)) for p in prompts]
        for k, (fp, fq) in enumerate(futures):
            pen, pl = fp.result(timeout=120), fq.result(timeout=120)
            assert pen.response_ids[0] == want_pen.response_ids[k] and pl.response_ids[0] == want_plain.response_ids[k]
            assert pen.logprobs[0] == pytest.approx(want_pen.logprobs[k], abs=1e-5)
    finally:
        batcher.close()


def test_bad_penalties_name_the_field():
    for kw, name in (({"repetition_penalty": 0.0}, "repetition_penalty"),
                     ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3.0}, "frequency_penalty")):
        with pytest.raises(ConfigError, match=name):
            SamplingParams(**kw).validate()
    assert not SamplingParams().penalized and SamplingParams(presence_penalty=0.1).penalized
