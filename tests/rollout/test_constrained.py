"""Constrained decoding (`tiller.rollout.constrained`) in the continuous batcher: masks are llguidance's, each row
keeps its own matcher, a constrained row ends at the grammar's eos, and unconstrained rows sharing its steps give
exactly what they give alone."""

from __future__ import annotations

import json

import pytest

from tiller.rollout import SamplingParams
from tiller.rollout.constrained import GrammarCompiler, GrammarError, allowed_tokens

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from tiller.evaluation.runner import load_policy

    return load_policy(str(tiny_model_dir), dtype="float32")


@pytest.fixture(scope="module")
def compiler(policy):
    return GrammarCompiler(policy.tokenizer, policy.engine.weights.module.config.vocab_size)


def _ids(policy, text):
    return policy.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_masks_follow_the_grammar_and_cover_the_logits_width(policy, compiler):
    """`{"type": "object"}`: the first token must be `{`; after `{}` only eos; ids past the tokenizer never."""
    tok = policy.tokenizer
    grammar = compiler.json_schema({"type": "object"})
    matcher = grammar.matcher()
    width = len(tok) + 40  # a model whose logits are wider than the tokenizer (padded vocabularies)
    first = allowed_tokens([(matcher, grammar)], width)
    assert first.shape == (1, width) and first[0, len(tok):].sum() == 0
    assert [tok.decode([t]) for t in first[0].nonzero().flatten().tolist()] == ["{"]
    for t in _ids(policy, "{}"):
        assert matcher.consume_token(t)
    assert allowed_tokens([(matcher, grammar)], width)[0].nonzero().flatten().tolist() == [tok.eos_token_id]
    assert list(grammar.eos_ids) == [tok.eos_token_id]
    fresh = grammar.matcher()  # the prototype was not advanced by the other row's tokens
    assert allowed_tokens([(fresh, grammar)], width)[0].nonzero().flatten().tolist() == \
        first[0].nonzero().flatten().tolist()


def test_bad_schema_is_a_grammar_error_with_llguidance_message(compiler):
    with pytest.raises(GrammarError, match="objectx"):
        compiler.json_schema({"type": "objectx"})
    with pytest.raises(GrammarError, match="nope"):
        compiler.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nope"}}})


def test_constrained_rows_parse_and_do_not_leak_into_unconstrained_rows(policy, compiler):
    """A constrained request (n=3, sampled, seeded) shares decode steps with a seeded sampled request and a
    greedy one; those two give the same tokens and logprobs as when they run alone."""
    from tiller.rollout.continuous import ContinuousBatcher

    prompt = _ids(policy, "<|im_start|>user\nJSON please<|im_end|>\n<|im_start|>assistant\n")
    seeded = SamplingParams(n=2, max_new_tokens=24, temperature=1.0, seed=4, ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=24, do_sample=False, ignore_eos=True)
    constrained = SamplingParams(n=3, max_new_tokens=200, temperature=1.0, seed=1)
    grammar = compiler.json_schema(SCHEMA)
    batcher = ContinuousBatcher(policy.engine, max_rows=16)
    try:
        alone_seeded = batcher.generate([prompt], seeded)
        alone_greedy = batcher.generate([prompt], greedy)
        jobs = [batcher.submit([prompt], constrained, grammar=grammar), batcher.submit([prompt], seeded),
                batcher.submit([prompt], greedy)]
        json_out, mixed_seeded, mixed_greedy = [f.result(timeout=120) for f in jobs]
        peak = batcher.stats["peak_rows"]
        greedy_json = batcher.generate([prompt], SamplingParams(max_new_tokens=40, do_sample=False), grammar=grammar)
        past_eos = batcher.generate([prompt], SamplingParams(max_new_tokens=200, seed=2, ignore_eos=True),
                                    grammar=grammar)
    finally:
        batcher.close()
    assert peak == 3 + 2 + 1  # all six rows were live together
    assert mixed_seeded.response_ids == alone_seeded.response_ids
    assert mixed_greedy.response_ids == alone_greedy.response_ids
    for got, want in zip(mixed_seeded.logprobs + mixed_greedy.logprobs, alone_seeded.logprobs + alone_greedy.logprobs):
        assert got == pytest.approx(want, abs=1e-5)
    eos = policy.tokenizer.eos_token_id
    for ids, reason in zip(json_out.response_ids, json_out.finish_reason):
        value = json.loads(policy.tokenizer.decode(ids, skip_special_tokens=True))
        assert reason == "stop" and ids[-1] == eos
        assert set(value) == {"a", "b"} and isinstance(value["a"], int) and value["b"] in ("x", "y")
    assert len({tuple(ids) for ids in json_out.response_ids}) > 1  # each row has its own matcher and draws
    assert past_eos.finish_reason == ["stop"] and past_eos.response_ids[0][-1] == eos  # ignore_eos: still ends
    text = policy.tokenizer.decode(greedy_json.response_ids[0], skip_special_tokens=True)
    assert text.startswith('{"a": ') and greedy_json.finish_reason in (["stop"], ["length"])


@pytest.mark.parametrize("schema, accepted", [
    ({"type": "object"}, ['{"a": 1, "b": [2, 3]}']),
    ({"type": "object", "x-guidance": {"whitespace_flexible": True}},
     ['{"a": 1, "b": [2, 3]}', '{"a":1,"b":[2,3]}', '{ "a" : 1 ,\n "b": [2, 3]}']),
])
def test_json_layout_is_one_line_unless_the_schema_asks(policy, compiler, schema, accepted):
    texts = ['{"a": 1, "b": [2, 3]}', '{"a":1,"b":[2,3]}', '{ "a" : 1 ,\n "b": [2, 3]}']
    grammar = compiler.json_schema(schema)
    for text in texts:
        matcher = grammar.matcher()
        ok = all(matcher.consume_token(t) for t in _ids(policy, text)) and matcher.is_accepting()
        assert ok == (text in accepted), text


def test_a_matcher_in_error_fails_its_request_only(policy, compiler):
    """A row whose matcher breaks (here: a prototype already past an invalid token) fails its own request with
    llguidance's message; the batcher keeps serving the next requests."""
    from tiller.rollout.constrained import Grammar
    from tiller.rollout.continuous import ContinuousBatcher

    good = compiler.json_schema(SCHEMA)
    broken = good.matcher()
    assert not broken.consume_token(_ids(policy, "x")[0]) and broken.is_error()
    prompt = _ids(policy, "JSON:")
    batcher = ContinuousBatcher(policy.engine, max_rows=8)
    try:
        bad = batcher.submit([prompt], SamplingParams(max_new_tokens=20, seed=0),
                             grammar=Grammar(broken, good.eos_ids, good.mask_vocab))
        plain = batcher.submit([prompt], SamplingParams(max_new_tokens=5, do_sample=False, ignore_eos=True))
        with pytest.raises(RuntimeError, match="constrained decoding failed"):
            bad.result(timeout=60)
        assert plain.result(timeout=60).finish_reason == ["length"]
        after = batcher.generate([prompt], SamplingParams(max_new_tokens=60, seed=0), grammar=good)
    finally:
        batcher.close()
    assert set(json.loads(policy.tokenizer.decode(after.response_ids[0], skip_special_tokens=True))) == {"a", "b"}
