"""Regex-constrained rollouts (`SamplingParams.regex`, `rollout.structured_outputs_regex`, TRL's
vllm_structured_outputs_regex): every response matches in full, the logprobs are those of the masked distribution
(checked by replaying each row's matcher over a teacher-forced forward), on the native engine's eager loop, its
static step's fallback and the continuous batcher."""

from __future__ import annotations

import re

import pytest
import torch

from tests.rollout.conftest import prompt_ids
from tiller.errors import UserError
from tiller.rollout import SamplingParams, build_rollout_engine
from tiller.rollout.constrained import allowed_tokens

PATTERN = r"[0-9]{1,3}\+[0-9]{1,3}"


def masked_reference_logprobs(model, grammar, prompt, response, temperature):
    """Teacher-forced logprobs of `response` under the grammar's mask, a fresh matcher walking the response."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    matcher, out = grammar.matcher(), []
    for t, token in enumerate(response):
        row = logits[len(prompt) - 1 + t : len(prompt) + t]
        allowed = allowed_tokens([(matcher, grammar)], row.shape[-1])
        row = row.masked_fill(~allowed, float("-inf")) / temperature
        out.append(torch.log_softmax(row, dim=-1)[0, token].item())
        matcher.consume_token(token)
    return torch.tensor(out)


@pytest.mark.parametrize("kw", [{}, {"static_decode": True}])
def test_every_response_matches_and_logprobs_are_the_masked_distributions(kw, qwen):
    model, tok = qwen
    engine = build_rollout_engine("native", model, tok, **kw)
    prompts = prompt_ids(tok)
    out = engine.generate(prompts, SamplingParams(n=3, temperature=0.9, max_new_tokens=12, seed=4, regex=PATTERN,
                                                  ignore_eos=True))
    grammar = engine.grammar_for(PATTERN)
    for prompt, response, logprobs, reason in zip(out.prompt_ids, out.response_ids, out.logprobs, out.finish_reason):
        assert reason == "stop" and response[-1] in grammar.eos_ids  # the grammar's eos ends it, ignore_eos or not
        assert re.fullmatch(PATTERN, tok.decode(response[:-1])), tok.decode(response)
        ref = masked_reference_logprobs(model, grammar, prompt, response, 0.9)
        torch.testing.assert_close(torch.tensor(logprobs), ref, atol=1e-4, rtol=0)
    unconstrained = engine.generate(prompts, SamplingParams(n=3, temperature=0.9, max_new_tokens=12, seed=4))
    assert not all(re.fullmatch(PATTERN, tok.decode(r, skip_special_tokens=True)) for r in unconstrained.response_ids)


def test_the_batcher_constrains_a_regex_request_like_the_engine(tiny_model_dir):
    from tiller.evaluation.runner import load_policy
    from tiller.rollout.continuous import ContinuousBatcher

    policy = load_policy(str(tiny_model_dir), dtype="float32")
    prompts = prompt_ids(policy.tokenizer)
    greedy = SamplingParams(do_sample=False, max_new_tokens=10, regex=PATTERN)
    want = policy.engine.generate(prompts, greedy)
    batcher = ContinuousBatcher(policy.engine, max_rows=8)
    try:
        got = [batcher.submit([p], greedy).result(timeout=120) for p in prompts]
        with pytest.raises(ValueError, match="one constraint"):
            batcher.submit([prompts[0]], greedy, grammar=policy.engine.grammar_for(PATTERN))
    finally:
        batcher.close()
    assert [g.response_ids[0] for g in got] == want.response_ids
    assert all(re.fullmatch(PATTERN, policy.tokenizer.decode(r, skip_special_tokens=True)) for r in want.response_ids)


def test_the_hf_engine_refuses_a_regex(qwen):
    model, tok = qwen
    with pytest.raises(UserError, match="native or vllm"):
        build_rollout_engine("hf", model, tok).generate(prompt_ids(tok), SamplingParams(regex="a+"))
