"""verl's tool-call formats (`multi_turn.format`): each parser on what its models write, verl's value
conversions, malformed calls dropped; the loop with a Qwen3.5-style XML call; GLM's observation stop token."""

from __future__ import annotations

import pytest

from tests.rollout.test_agent import _prompt, ScriptedEngine
from tiller.rollout import SamplingParams
from tiller.rollout.agent import run_agent_loop
from tiller.rollout.tool_parsers import (
    parse_glm,
    parse_gpt_oss,
    parse_minimax,
    parse_qwen3_coder,
    parse_seed,
    stop_token_ids,
)
from tiller.rollout.tools import CalculatorTool, function_schema

SCHEMA = function_schema("lookup", "d", {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "ratio": {"type": "number"}, "exact": {"type": "boolean"},
                                         "opts": {"type": "object"}, "tags": {"type": "array"}}, ["city"])


def _calls(parsed):
    return [(c.name, c.arguments) for c in parsed]


def test_qwen3_coder_converts_values_by_the_schema_as_verl():
    text = ("let me look <tool_call>\n<function=lookup>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=ratio>\n2.0\n</parameter>\n<parameter=exact>\nTrue\n"
            "</parameter>\n<parameter=opts>\n{\"a\": 1}\n</parameter>\n<parameter=tags>\n['x', 'y']\n</parameter>\n"
            "<parameter=extra>\nnull\n</parameter>\n</function>\n</tool_call>")
    assert _calls(parse_qwen3_coder(text, [SCHEMA])) == [("lookup", {
        "city": "New York", "days": 3, "ratio": 2, "exact": True, "opts": {"a": 1}, "tags": ["x", "y"],
        "extra": None})]  # (2.0 -> 2 and "True" -> true as verl's convert_param_value)
    assert _calls(parse_qwen3_coder("<tool_call><function=lookup><parameter=days>many</parameter></function>",
                                    [SCHEMA])) == [("lookup", {"days": "many"})]  # truncated, bad int: the text
    assert parse_qwen3_coder("no call here", [SCHEMA]) == []
    assert parse_qwen3_coder("<tool_call><function=broken", [SCHEMA]) == []  # a header without '>': dropped


def test_glm_seed_minimax_and_gpt_oss():
    assert _calls(parse_glm("<tool_call>lookup\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                            "<arg_key>days</arg_key><arg_value>2</arg_value>\n</tool_call>")) == [
        ("lookup", {"city": "Paris", "days": 2})]
    assert _calls(parse_seed("<seed:tool_call><function=lookup><parameter=city>Rome</parameter>"
                             "<parameter=days>[1, 2]</parameter></function></seed:tool_call>")) == [
        ("lookup", {"city": "Rome", "days": [1, 2]})]
    assert _calls(parse_minimax('<minimax:tool_call><invoke name="a"><parameter name="x">1</parameter></invoke>'
                                '<invoke name="b"><parameter name="y">z</parameter></invoke></minimax:tool_call>')) == [
        ("a", {"x": 1}), ("b", {"y": "z"})]
    oss = ("<|start|>assistant<|channel|>analysis<|message|>maybe to=functions.bad <|end|>"
           "<|start|>assistant<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>"
           '{"city": "Oslo"}<|call|>')
    assert _calls(parse_gpt_oss(oss)) == [("lookup", {"city": "Oslo"})]  # the reasoning channel's mention ignored
    (bad,) = parse_gpt_oss(oss.replace('{"city": "Oslo"}', "[1]"))
    assert bad.error and "invalid arguments for 'lookup'" in bad.error


class _Tok:
    unk_token_id = 0

    def convert_tokens_to_ids(self, token):
        return {"<|observation|>": 151338}.get(token, 0)


def test_glm_stops_at_its_observation_token():
    assert stop_token_ids("glm", _Tok()) == [151338]
    assert stop_token_ids("qwen3_coder", _Tok()) == [] and stop_token_ids("glm", type("T", (), {
        "unk_token_id": 0, "convert_tokens_to_ids": lambda self, t: 0})()) == []


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from tiller.models.loading import load_tokenizer

    return load_tokenizer(tiny_model_dir, padding_side="left")


def test_the_loop_runs_qwen35_style_calls(tok):
    call = "<tool_call>\n<function=calculator>\n<parameter=expression>\n6*7\n</parameter>\n</function>\n</tool_call>"

    def script(context, row):
        return "42<|im_end|>" if "<|im_start|>tool" in context else call + "<|im_end|>"

    out = run_agent_loop(ScriptedEngine(tok, script), tok, [_prompt(tok)], SamplingParams(max_new_tokens=100),
                         [CalculatorTool()], max_response_length=400, tool_format="qwen3_coder")
    assert out.num_tool_calls == [1] and out.tool_errors == [0] and out.num_turns == [2]
    assert "<|im_start|>tool\n42<|im_end|>" in tok.decode(out.response_ids[0])
    plain = run_agent_loop(ScriptedEngine(tok, script), tok, [_prompt(tok)], SamplingParams(max_new_tokens=100),
                           [CalculatorTool()], max_response_length=400)  # hermes: not JSON, an error back
    assert plain.tool_errors == [1] and "invalid tool call" in tok.decode(plain.response_ids[0])
