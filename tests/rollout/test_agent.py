"""Multi-turn tool rollouts (tiller.rollout.agent) and tools (tiller.rollout.tools).

Loop logic with a scripted engine (exact tokens, masks, logprobs); one run on the real tiny model checks
that the engine continues after tool tokens and that its logprobs are those of the full sequence.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from tiller.errors import ConfigError
from tiller.rollout import RolloutOutput, SamplingParams
from tiller.rollout.agent import (
    ToolResponseEncoder,
    build_agent_loop,
    parse_tool_calls,
    render_prompt_with_tools,
    run_agent_loop,
    truncate_tool_response,
)
from tiller.rollout.tools import CalculatorTool, load_tools, safe_eval

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from tiller.models.loading import load_tokenizer

    return load_tokenizer(tiny_model_dir, padding_side="left")


class ScriptedEngine:
    """Replies by looking at the conversation so far: `script(context_text, row) -> reply text`.

    Logprobs are -0.5 per token so tests can tell model tokens from tool tokens.
    """

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, prompt_ids, sampling):
        self.calls.append((len(prompt_ids), sampling.max_new_tokens, sampling.n))
        out = RolloutOutput()
        for row, p in enumerate(prompt_ids):
            text = self.script(self.tok.decode(p), row)
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            reason = "stop" if len(ids) <= sampling.max_new_tokens else "length"
            ids = ids[:sampling.max_new_tokens]
            out.prompt_ids.append(p)
            out.response_ids.append(ids)
            out.logprobs.append([-0.5] * len(ids))
            out.finish_reason.append(reason)
        return out


def _prompt(tok, content="What is 6*7?"):
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_two_turn_conversation_tokens_mask_and_logprobs(tok):
    def script(context, row):
        return "The answer is 42<|im_end|>" if "<|im_start|>tool" in context else CALL + "<|im_end|>"

    prompt = _prompt(tok)
    out = run_agent_loop(ScriptedEngine(tok, script), tok, [prompt], SamplingParams(max_new_tokens=100),
                         [CalculatorTool()], max_assistant_turns=4, max_response_length=400)
    assert len(out) == 1 and out.num_turns == [2] and out.num_tool_calls == [1] and out.tool_errors == [0]
    ids, mask, lps = out.response_ids[0], out.response_mask[0], out.logprobs[0]
    assert len(ids) == len(mask) == len(lps)
    # the full sequence is exactly the chat template's rendering of the conversation
    messages = [{"role": "user", "content": "What is 6*7?"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "42"}, {"role": "assistant", "content": "The answer is 42"}]
    expected = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(prompt + ids) == expected.rstrip("\n")
    # model tokens: mask 1, logprob -0.5; tool + template tokens: mask 0, logprob 0
    tool_ids = [t for t, m in zip(ids, mask) if m == 0]
    assert tok.decode(tool_ids) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert all((lp == -0.5) == (m == 1) for lp, m in zip(lps, mask))
    n_call = len(tok(CALL + "<|im_end|>", add_special_tokens=False)["input_ids"])
    n_answer = len(tok("The answer is 42<|im_end|>", add_special_tokens=False)["input_ids"])
    assert mask == [1] * n_call + [0] * len(tool_ids) + [1] * n_answer
    assert out.finish_reason == ["stop"]


def test_n_samples_rows_contiguous_and_only_live_rows_continue(tok):
    def script(context, row):
        # prompt "a": calls the tool once; prompt "b": answers at once
        if "<|im_start|>tool" in context or "b?" in context:
            return "done<|im_end|>"
        return CALL + "<|im_end|>"

    engine = ScriptedEngine(tok, script)
    out = run_agent_loop(engine, tok, [_prompt(tok, "a?"), _prompt(tok, "b?")], SamplingParams(n=3, max_new_tokens=100),
                         {"calculator": CalculatorTool()}, max_response_length=400)
    assert len(out) == 6
    assert out.num_turns == [2, 2, 2, 1, 1, 1]
    assert out.num_tool_calls == [3 * [1] + 3 * [0]][0]
    assert out.prompt_ids[0] == out.prompt_ids[2] != out.prompt_ids[3]
    assert [c[0] for c in engine.calls] == [6, 3]  # turn 2 only for the rows that called a tool
    assert all(c[2] == 1 for c in engine.calls)  # rows are sampled one each


def test_errors_are_shown_to_the_model(tok):
    replies = iter(['<tool_call>{"name": "calculator", "arguments": </tool_call><|im_end|>',
                    '<tool_call>{"name": "search", "arguments": {}}</tool_call><|im_end|>',
                    '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call><|im_end|>',
                    "ok<|im_end|>"])
    out = run_agent_loop(ScriptedEngine(tok, lambda c, r: next(replies)), tok, [_prompt(tok)],
                         SamplingParams(max_new_tokens=100), [CalculatorTool()], max_assistant_turns=4,
                         max_response_length=1000)
    text = tok.decode([t for t, m in zip(out.response_ids[0], out.response_mask[0]) if m == 0])
    assert "Error: invalid tool call" in text
    assert "Error: unknown tool 'search'; available: calculator" in text
    assert "Error: division by zero" in text
    assert out.tool_errors == [3] and out.num_turns == [4]


def test_max_turns_and_budget_bound_the_conversation(tok):
    always_call = lambda c, r: CALL + "<|im_end|>"  # noqa: E731
    out = run_agent_loop(ScriptedEngine(tok, always_call), tok, [_prompt(tok)], SamplingParams(max_new_tokens=100),
                         [CalculatorTool()], max_assistant_turns=3, max_response_length=1000)
    assert out.num_turns == [3] and out.num_tool_calls == [2]  # the last turn's call is not run
    assert out.response_mask[0][-1] == 1  # ends on a model token
    tight = run_agent_loop(ScriptedEngine(tok, always_call), tok, [_prompt(tok)], SamplingParams(max_new_tokens=100),
                           [CalculatorTool()], max_assistant_turns=5, max_response_length=50)
    assert len(tight.response_ids[0]) == 50 and tight.finish_reason == ["length"]
    assert len(tight.response_mask[0]) == len(tight.logprobs[0]) == 50


def test_truncate_tool_response_is_verls_cut():
    text = "0123456789" * 3
    assert truncate_tool_response(text, 30) == text  # not longer: unchanged
    assert truncate_tool_response(text, 8, "middle") == "0123...(truncated)...6789"
    assert truncate_tool_response(text, 8, "left") == "(truncated)...23456789"
    assert truncate_tool_response(text, 8, "right") == "01234567...(truncated)"


class EchoTool:
    """A tool whose response is long: `x` repeated `n` times, then its call number."""

    name = "echo"
    schema = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object", "properties": {}}}}

    def __call__(self, args):
        return "x" * int(args["n"]) + str(args["id"])


def _echo(n, i):
    return '<tool_call>{"name": "echo", "arguments": {"n": %d, "id": %d}}</tool_call>' % (n, i)


def test_verls_multi_turn_limits_calls_truncation_and_user_turns(tok):
    """multi_turn.max_parallel_calls (a turn's first N calls run), max_tool_response_length +
    tool_response_truncate_side (verl's marked cut), max_user_turns (then the next assistant turn is the last)."""
    two_calls = lambda c, r: _echo(300, 1) + _echo(5, 2) + "<|im_end|>"  # noqa: E731

    def tool_text(out):
        return tok.decode([t for t, m in zip(out.response_ids[0], out.response_mask[0]) if m == 0])

    kw = dict(max_assistant_turns=2, max_response_length=2000)
    one = run_agent_loop(ScriptedEngine(tok, two_calls), tok, [_prompt(tok)], SamplingParams(max_new_tokens=200),
                         [EchoTool()], **kw)  # verl's defaults: 1 call a turn, 256 characters, middle
    assert one.num_tool_calls == [1]
    assert "x" * 128 + "...(truncated)..." + "x" * 127 + "1" in tool_text(one) and "xxxxx2" not in tool_text(one)
    both = run_agent_loop(ScriptedEngine(tok, two_calls), tok, [_prompt(tok)], SamplingParams(max_new_tokens=200),
                          [EchoTool()], max_calls_per_turn=2, max_tool_response_chars=10, truncate_side="right", **kw)
    assert both.num_tool_calls == [2]
    assert "xxxxxxxxxx...(truncated)" in tool_text(both) and "xxxxx2" in tool_text(both)
    always_call = lambda c, r: CALL + "<|im_end|>"  # noqa: E731
    capped = run_agent_loop(ScriptedEngine(tok, always_call), tok, [_prompt(tok)], SamplingParams(max_new_tokens=100),
                            [CalculatorTool()], max_assistant_turns=5, max_user_turns=1, max_response_length=1000)
    assert capped.num_turns == [2] and capped.num_tool_calls == [1]


def test_turn_cut_by_stop_string_gets_a_masked_eos(tok):
    def script(context, row):
        return "fine<|im_end|>" if "<|im_start|>tool" in context else CALL  # no eos: stop string ended the turn

    out = run_agent_loop(ScriptedEngine(tok, script), tok, [_prompt(tok)],
                         SamplingParams(max_new_tokens=100, stop=("</tool_call>",)), [CalculatorTool()],
                         max_response_length=400)
    tool_text = tok.decode([t for t, m in zip(out.response_ids[0], out.response_mask[0]) if m == 0])
    assert tool_text.startswith("<|im_end|>\n<|im_start|>tool\n42")


def test_tool_response_encoder_falls_back_when_template_has_no_tool_role(tok):
    class NoToolRole:
        eos_token_id = tok.eos_token_id

        def decode(self, ids, **kw):
            return tok.decode(ids, **kw)

        def __call__(self, text, **kw):
            return tok(text, **kw)

        def apply_chat_template(self, messages, **kw):
            if any(m["role"] == "tool" for m in messages):
                raise ValueError("roles must alternate user/assistant")
            return tok.apply_chat_template(messages, **kw)

    text = ToolResponseEncoder(NoToolRole()).text(["7"])
    assert text == "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_parse_tool_calls_forms():
    calls = parse_tool_calls('a <tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call> b '
                             '<tool_call>{"name": "g"}</tool_call> <tool_call>not json</tool_call>')
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [("f", {"x": 1}, True), ("g", {}, True),
                                                                        ("", {}, False)]
    assert parse_tool_calls("no calls here") == []


@pytest.mark.parametrize("expr, want", [("3 * (4 + 5) / 2", "13.5"), ("2**10 - sqrt(16)", "1020"), ("-7 // 2", "-4"),
                                        ("max(3, 9) % 4", "1"), ("0.1 + 0.2", "0.3")])
def test_calculator_values(expr, want):
    assert CalculatorTool()({"expression": expr}) == want


@pytest.mark.parametrize("expr", ["__import__('os').system('echo hi')", "().__class__", "9**9**9", "10**400",
                                  "2^3", "(-8)**0.5", "x + 1", "'a' * 3", "1" * 600, "exp(1000)"])
def test_calculator_refuses_unsafe_or_huge(expr):
    out = CalculatorTool()({"expression": expr})
    assert out.startswith("Error:"), out
    with pytest.raises((ValueError, OverflowError)):
        safe_eval(expr)


def test_load_tools_yaml(tmp_path):
    mod = tmp_path / "my_tools_mod.py"
    mod.write_text(textwrap.dedent('''
        def lookup(city):
            """Capital lookup."""
            return {"France": "Paris"}.get(city, "unknown")

        class Echo:
            name = "echo"
            def __init__(self, config, tool_schema):
                self.prefix = config.get("prefix", "")
                self.schema = tool_schema
            def __call__(self, arguments):
                return self.prefix + str(arguments.get("text"))
    '''))
    cfg = tmp_path / "tools.yaml"
    cfg.write_text(textwrap.dedent('''
        tools:
          - name: calculator
          - function: my_tools_mod:lookup
          - class_name: my_tools_mod.Echo
            config: {type: native, prefix: ">"}
            tool_schema: {type: function, function: {name: echo, description: echo, parameters: {}}}
    '''))
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        tools = load_tools(cfg)
    finally:
        sys.path.remove(str(tmp_path))
    assert sorted(tools) == ["calculator", "echo", "lookup"]
    assert tools["lookup"]({"city": "France"}) == "Paris"
    assert tools["lookup"]({"town": "x"}).startswith("Error: TypeError")
    assert tools["echo"]({"text": "hi"}) == ">hi"
    assert tools["lookup"].schema["function"]["parameters"]["required"] == ["city"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools:\n  - name: teleport\n")
    with pytest.raises(ConfigError, match=r"bad.yaml tools\[0\]"):
        load_tools(bad)
    bad.write_text("tools:\n  - function: nope_mod:f\n")
    with pytest.raises(ConfigError, match="cannot import"):
        load_tools(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_tools(tmp_path / "missing.yaml")


def test_build_agent_loop_from_config(tmp_path):
    from tiller.config import load_config

    assert build_agent_loop(load_config([]).actor_rollout_ref.rollout) is None
    cfg = load_config(["actor_rollout_ref.rollout.multi_turn.enable=True",
                       "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2"])
    loop = build_agent_loop(cfg.actor_rollout_ref.rollout)
    assert loop.max_assistant_turns == 2 and list(loop.tools) == ["calculator"]
    assert (loop.max_calls_per_turn, loop.max_tool_response_chars, loop.truncate_side, loop.max_user_turns) == (
        1, 256, "middle", None)  # verl's defaults
    mt = "actor_rollout_ref.rollout.multi_turn"
    cfg = load_config([f"{mt}.enable=True", f"{mt}.max_parallel_calls=3", f"{mt}.max_tool_response_length=64",
                       f"{mt}.tool_response_truncate_side=left", f"{mt}.max_user_turns=2"])
    loop = build_agent_loop(cfg.actor_rollout_ref.rollout)
    assert (loop.max_calls_per_turn, loop.max_tool_response_chars, loop.truncate_side, loop.max_user_turns) == (
        3, 64, "left", 2)
    for bad, named in (("max_parallel_calls=0", "max_parallel_calls"), ("max_tool_response_length=0", "max_tool_resp"),
                       ("tool_response_truncate_side=top", "tool_response_truncate_side"),
                       ("max_user_turns=-1", "max_user_turns")):
        with pytest.raises(ConfigError, match=f"multi_turn.{named}"):
            build_agent_loop(load_config([f"{mt}.enable=True", f"{mt}.{bad}"]).actor_rollout_ref.rollout)


def test_python_tool_runs_in_the_sandbox():
    from tiller.rollout.tools import PythonTool

    tool = PythonTool({"timeout_s": 5})
    assert tool({"code": "print(sum(range(10)))"}) == "45"
    assert "ZeroDivisionError" in tool({"code": "1/0"})


def test_real_tiny_model_continues_after_tool_tokens(tiny_model_dir, tok):
    """Turn 1 is a scripted tool call; turn 2 is the real engine (greedy) continuing after the tool tokens.
    Its logprobs must equal a teacher-forced forward over the whole sequence at the model's positions."""
    from tiller.models.loading import load_causal_lm
    from tiller.rollout import build_rollout_engine

    model = load_causal_lm(tiny_model_dir)
    real = build_rollout_engine("native", model, tok, dtype=None, seed=0)
    call_ids = tok(CALL + "<|im_end|>", add_special_tokens=False)["input_ids"]

    class FirstTurnScripted:
        def __init__(self):
            self.turn = 0

        def generate(self, prompt_ids, sampling):
            self.turn += 1
            if self.turn == 1:
                return RolloutOutput(list(prompt_ids), [list(call_ids)] * len(prompt_ids),
                                     [[0.0] * len(call_ids)] * len(prompt_ids), ["stop"] * len(prompt_ids))
            return real.generate(prompt_ids, sampling)

    prompts = [_prompt(tok, "6*7?"), _prompt(tok, "hi")]
    out = run_agent_loop(FirstTurnScripted(), tok, prompts, SamplingParams(max_new_tokens=8, do_sample=False),
                         [CalculatorTool()], max_assistant_turns=2, max_response_length=120)
    assert out.num_turns == [2, 2] and out.num_tool_calls == [1, 1]
    for p, ids, mask, lps in zip(out.prompt_ids, out.response_ids, out.response_mask, out.logprobs):
        assert len(ids) == len(mask) == len(lps)
        seq = torch.tensor([p + ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(seq).logits.float(), -1)[0]
        turn2 = [i for i in range(len(call_ids), len(ids)) if mask[i] == 1]
        assert turn2, "the real engine generated nothing"
        forced = [logp[len(p) + i - 1, ids[i]].item() for i in turn2]
        assert forced == pytest.approx([lps[i] for i in turn2], abs=1e-4)


def test_render_prompt_with_tools_keeps_the_template(tok):
    text = render_prompt_with_tools(tok, [{"role": "user", "content": "x"}], [CalculatorTool()])
    assert text.endswith("<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")
    # the tiny ChatML template ignores `tools=`, so the schemas go into a system message
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "calculator"' in text
    assert json.dumps(CalculatorTool().schema)  # schemas are JSON-serialisable for templates


def test_tool_messages_follow_the_templates_layout_of_tool_call_turns(tok):
    """A template may lay out a tool-call turn differently from a text turn (examples/agent_calculator.py's: no
    newline after it); the tool message after a parsed call is the template's own rendering of the conversation
    with that turn as `tool_calls`, so a model trained on rendered transcripts sees the same text."""
    import copy

    from examples.agent_calculator import CHAT_TEMPLATE
    from tiller.rollout.function_tools import FunctionTool, infer_schema

    t = copy.deepcopy(tok)
    t.chat_template = CHAT_TEMPLATE

    def calc(x: str) -> str:
        """evaluate

        Args:
            x: the expression
        """
        return "42"

    tools = {"calc": FunctionTool(calc, "calc", infer_schema(calc, "calc"))}
    call = '<tool_call>{"name": "calc", "arguments": {"x": "6*7"}}</tool_call><|im_end|>'
    user = [{"role": "user", "content": "What is 6*7?"}]
    prompt = t(t.apply_chat_template(user, tools=[tools["calc"].schema], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"]
    out = run_agent_loop(ScriptedEngine(t, lambda c, r: "42<|im_end|>" if "<|im_start|>tool" in c else call), t,
                         [prompt], SamplingParams(max_new_tokens=60), tools, max_response_length=200)
    rendered = t.apply_chat_template(user + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": {"x": "6*7"}}}]},
        {"role": "tool", "content": "42"}], tools=[tools["calc"].schema], add_generation_prompt=True, tokenize=False)
    assert "</tool_call><|im_end|><|im_start|>tool" in rendered  # (the template's layout: no newline)
    assert t.decode(prompt + out.response_ids[0]) == rendered + "42<|im_end|>"
