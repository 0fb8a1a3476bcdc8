"""verl's function tools (`multi_turn.function_tool_path`, `@function_tool`): tiller.rollout.function_tools.

Schema facts are verl's own expectations (tests/tools/test_function_tool_on_cpu.py and
tests/experimental/agent_loop/function_tool_examples.py at verl 1dda039b), written afresh; so are the
return-value cases. Files use `from verl.tools.function_tool import function_tool` with verl not installed.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from types import SimpleNamespace

import pytest

from tiller.errors import ConfigError
from tiller.rollout.agent import build_agent_loop, execute_tool_calls, load_all_tools, parse_tool_calls
from tiller.rollout.function_tools import (
    FunctionTool,
    load_function_tools,
    normalize_return,
    ToolResponse,
    ToolResult,
)

KEY = "actor_rollout_ref.rollout.multi_turn.function_tool_path"

# verl's tests/experimental/agent_loop/function_tool_examples.py, as a user writes it for verl
VERL_EXAMPLES = '''
import asyncio

from verl.tools.function_tool import function_tool


@function_tool
def get_weather(city: str) -> dict:
    """Get the current weather for a city.

    Args:
        city: The city to look up, e.g. "Tokyo" or "San Francisco".
    """
    table = {"tokyo": {"temperature_c": 17.3, "condition": "drizzle"}}
    return table.get(city.lower(), {"temperature_c": -273.15, "condition": "unknown"})


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: A Python-style arithmetic expression, e.g. "(3+4)*5".
    """
    return str(eval(expression, {"__builtins__": {}}))


@function_tool
async def fetch_url(url: str) -> str:
    """Fetch the contents of a URL (async).

    Args:
        url: The URL to fetch.
    """
    await asyncio.sleep(0)
    return f"<stub body for {url}>"
'''


def _file(tmp_path, body: str, name: str = "my_tools.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _mt(**kw) -> SimpleNamespace:
    base = dict(enable=True, tool_config_path=None, function_tool_path=None, max_assistant_turns=4,
                max_parallel_calls=1, max_tool_response_length=256, tool_response_truncate_side="middle",
                max_user_turns=None, format="hermes")
    return SimpleNamespace(**{**base, **kw})


# ------------------------------------------------------------------------------------------- schemas
def test_verls_example_file_loads_without_verl_and_leaves_no_stand_in(tmp_path):
    assert "verl" not in sys.modules
    tools = load_function_tools(_file(tmp_path, VERL_EXAMPLES))
    assert "verl" not in sys.modules and "verl.tools.function_tool" not in sys.modules
    assert list(tools) == ["get_weather", "calculator", "fetch_url"]
    assert tools["get_weather"].schema == {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {
            "type": "string", "description": 'The city to look up, e.g. "Tokyo" or "San Francisco".'}},
            "required": ["city"]}}}
    assert tools["fetch_url"].is_async and not tools["calculator"].is_async
    # dict -> JSON text; async awaited; sync called
    assert tools["get_weather"]({"city": "Tokyo"}) == '{"temperature_c": 17.3, "condition": "drizzle"}'
    assert tools["fetch_url"]({"url": "http://x"}) == "<stub body for http://x>"
    assert tools["calculator"]({"expression": "(3+4)*5"}) == "35"


def test_schema_inference_matches_verls_expectations(tmp_path):
    tools = load_function_tools(_file(tmp_path, '''
        from typing import Literal

        from verl.tools.function_tool import function_tool

        @function_tool("greet")
        def greet(name: str, excited: bool = False) -> str:
            """Greet someone.

            Args:
                name: Person to greet.
                excited: Whether to add an exclamation mark.
            """
            return name

        @function_tool("num")
        def num(x: int | float) -> str:
            """Numeric.

            Args:
                x: a numeric value.
            """
            return str(x)

        @function_tool("pick")
        def pick(x: Literal[1, 2, 3]) -> str:
            """Pick.

            Args:
                x: pick one.
            """
            return str(x)

        @function_tool()
        def my_special_tool(x: int) -> int:
            """Doc.

            Args:
                x: A number.
            """
            return x

        @function_tool
        def bare_tool(x: int) -> int:
            """Doc.

            Args:
                x: A number.
            """
            return x
        '''))
    made = {name: t.schema["function"] for name, t in tools.items()}
    assert list(made) == ["greet", "num", "pick", "my_special_tool", "bare_tool"]
    assert made["greet"]["name"] == "greet" and made["greet"]["description"].startswith("Greet someone.")
    assert made["greet"]["parameters"]["properties"] == {
        "name": {"type": "string", "description": "Person to greet."},
        "excited": {"type": "boolean", "description": "Whether to add an exclamation mark."}}
    assert made["greet"]["parameters"]["required"] == ["name"]
    assert "number" in made["num"]["parameters"]["properties"]["x"]["type"]
    assert made["pick"]["parameters"]["properties"]["x"]["enum"] == [1, 2, 3]
    assert made["bare_tool"]["name"] == "bare_tool"
    assert made["bare_tool"]["parameters"]["properties"]["x"]["type"] == "integer"
    assert "return" not in made["greet"]  # verl's OpenAIFunctionSchema keeps no return type


def test_explicit_schema_skips_inference_and_a_renamed_tool_keeps_its_name(tmp_path):
    tools = load_function_tools(_file(tmp_path, '''
        from tiller.rollout.function_tools import function_tool
        from verl.tools.schemas import OpenAIFunctionToolSchema

        CUSTOM = {"type": "function", "function": {"name": "x", "description": "custom desc",
                  "parameters": {"type": "object", "properties": {}, "required": []}}}

        @function_tool("x", schema=CUSTOM)
        def x() -> str:
            """This docstring should be ignored.

            Args:
                ignored: ignored.
            """
            return ""

        @function_tool("y", schema=OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
            "name": "y", "description": "obj desc",
            "parameters": {"type": "object", "properties": {}, "required": []}}}))
        def y() -> str:
            return ""

        @function_tool("web_search")
        def search(query: str) -> str:
            """Search.

            Args:
                query: what to look for.
            """
            return query
        '''))
    assert tools["x"].schema["function"] == {"name": "x", "description": "custom desc",
                                             "parameters": {"type": "object", "properties": {}, "required": []}}
    assert tools["y"].schema["function"]["description"] == "obj desc"
    assert tools["web_search"].schema["function"]["name"] == "web_search"
    assert tools["web_search"]({"query": "q"}) == "q"


@pytest.mark.parametrize("body, phrase", [
    ("def nodoc(x: str) -> str:\n    return x\n", "no docstring"),
    ('def untyped(x) -> str:\n    """Doc.\n\n    Args:\n        x: a thing.\n    """\n    return x\n',
     "missing a type hint"),
    ('def partial(x: int, y: int) -> int:\n    """Add.\n\n    Args:\n        x: only x described.\n    """\n'
     '    return x + y\n', "no description for the argument"),
    ('def varargs(x: int, *args: int) -> int:\n    """Sum.\n\n    Args:\n        x: x.\n    """\n    return x\n',
     "variadic parameter"),
])
def test_bad_function_is_a_config_error_naming_key_file_and_function(tmp_path, body, phrase):
    path = _file(tmp_path, "from verl.tools.function_tool import function_tool\n\n@function_tool\n" + body)
    with pytest.raises(ConfigError, match=phrase) as err:
        load_function_tools(path)
    fn_name = body.split("(")[0].removeprefix("def ")
    assert str(err.value).startswith(f"{KEY}={path}: @function_tool '{fn_name}'"), err.value


# ------------------------------------------------------------------------------------ return values
class Foo:
    def __str__(self) -> str:
        return "FOO"


@pytest.mark.parametrize("ret, want", [
    ("hello", ToolResult("hello", 0.0, {})),
    (ToolResponse(text="x"), ToolResult("x", 0.0, {})),
    ({"a": 1, "b": "two"}, ToolResult('{"a": 1, "b": "two"}', 0.0, {})),
    (("text", 1.5), ToolResult("text", 1.5, {})),
    (("text", 2.0, {"k": "v"}), ToolResult("text", 2.0, {"k": "v"})),
    (("text", None), ToolResult("text", 0.0, {})),
    (("text", None, None), ToolResult("text", 0.0, {})),
    (("t", 0), ToolResult("t", 0.0, {})),
    (("t", False), ToolResult("t", 0.0, {})),
    (({"a": 1}, 1), ToolResult('{"a": 1}', 1.0, {})),
    ((ToolResponse(text="r"),), ToolResult("r", 0.0, {})),
    (Foo(), ToolResult("FOO", 0.0, {})),
    (7, ToolResult("7", 0.0, {})),
])
def test_return_values_normalise_as_verls(ret, want):
    got = normalize_return(ret)
    assert got == want and isinstance(got.reward, float)


@pytest.mark.parametrize("ret", [(), ("a", 1, {}, "extra")])
def test_tuples_of_other_lengths_are_errors(ret):
    with pytest.raises(TypeError, match=r"length 1, 2, or 3"):
        normalize_return(ret)


def test_errors_and_rewards_through_the_tool_call_path(tmp_path):
    """Function tools run through tiller's tool-call execution: rewards come back per call (0.0 for failures and
    for tools without one), exceptions and bad returns as `Error:` text, long texts cut as verl's."""
    tools = load_function_tools(_file(tmp_path, '''
        from verl.tools.function_tool import function_tool

        @function_tool
        async def score(answer: str) -> tuple:
            """Check an answer.

            Args:
                answer: the answer.
            """
            return ("right" if answer == "42" else "wrong"), (1.0 if answer == "42" else -0.5), {"checked": 1}

        @function_tool
        def boom(x: int) -> str:
            """Fails.

            Args:
                x: x.
            """
            raise RuntimeError(f"no {x}")

        @function_tool
        def four(x: int) -> tuple:
            """Bad return.

            Args:
                x: x.
            """
            return ("a", 1, {}, "extra")

        @function_tool
        def long(x: int) -> str:
            """Long.

            Args:
                x: x.
            """
            return "a" * 10 + "b" * 10
        '''))
    text = "".join(f'<tool_call>{{"name": "{n}", "arguments": {a}}}</tool_call>' for n, a in [
        ("score", '{"answer": "42"}'), ("score", '{"answer": "7"}'), ("boom", '{"x": 3}'), ("four", '{"x": 1}'),
        ("nope", "{}"), ("long", '{"x": 1}')])
    results = execute_tool_calls(parse_tool_calls(text), tools, max_chars=200)
    assert [r.reward for r in results] == [1.0, -0.5, 0.0, 0.0, 0.0, 0.0]
    assert results[0].metrics == {"checked": 1}
    assert [r.text for r in results[:3]] == ["right", "wrong", "Error: RuntimeError: no 3"]
    assert results[3].text.startswith("Error: TypeError: @function_tool return tuple must have length 1, 2, or 3")
    assert results[4].text.startswith("Error: unknown tool 'nope'")
    assert results[5].text == "a" * 10 + "b" * 10
    cut = execute_tool_calls(parse_tool_calls(text), tools, max_chars=8, side="middle")[5]
    assert cut.text == "aaaa...(truncated)...bbbb"


def test_async_tool_called_from_inside_a_running_event_loop(tmp_path):
    """The environment loop (tiller.rollout.environments) runs in asyncio: an async tool still completes."""
    tool = load_function_tools(_file(tmp_path, VERL_EXAMPLES))["fetch_url"]

    async def inside():
        return tool({"url": "u"})

    assert asyncio.run(inside()) == "<stub body for u>"


# ------------------------------------------------------------------------------------- files, merging
def test_file_problems_name_the_key_and_file(tmp_path):
    with pytest.raises(ConfigError, match=rf"{KEY}=.*missing.py: file not found"):
        load_function_tools(tmp_path / "missing.py")
    (tmp_path / "tools.yaml").write_text("tools: []\n")
    with pytest.raises(ConfigError, match=r"tools.yaml: not a Python file"):
        load_function_tools(tmp_path / "tools.yaml")
    with pytest.raises(ConfigError, match=r"plain.py: no @function_tool function in the file"):
        load_function_tools(_file(tmp_path, "def f(x: int) -> int:\n    return x\n", "plain.py"))
    with pytest.raises(ConfigError, match=r"broken.py: cannot import it: ZeroDivisionError"):
        load_function_tools(_file(tmp_path, "1 / 0\n", "broken.py"))
    dup = '''
        from verl.tools.function_tool import function_tool

        @function_tool("same")
        def a(x: int) -> int:
            """A.

            Args:
                x: x.
            """
            return x

        @function_tool("same")
        def b(x: int) -> int:
            """B.

            Args:
                x: x.
            """
            return x
        '''
    with pytest.raises(ConfigError, match=r"dup.py: two @function_tool functions are named 'same'"):
        load_function_tools(_file(tmp_path, dup, "dup.py"))


def test_both_paths_merge_and_a_shared_name_is_an_error(tmp_path):
    fn_path = _file(tmp_path, VERL_EXAMPLES)
    (tmp_path / "tools.yaml").write_text("tools:\n  - name: python\n")
    tools = load_all_tools(_mt(tool_config_path=str(tmp_path / "tools.yaml"), function_tool_path=fn_path))
    assert list(tools) == ["python", "get_weather", "calculator", "fetch_url"]
    assert list(load_all_tools(_mt(function_tool_path=fn_path))) == ["get_weather", "calculator", "fetch_url"]
    (tmp_path / "clash.yaml").write_text("tools:\n  - name: calculator\n")
    with pytest.raises(ConfigError, match=r"function_tool_path=.*tool name\(s\) \['calculator'\] are also declared "
                                          r"in actor_rollout_ref.rollout.multi_turn.tool_config_path=.*clash.yaml"):
        load_all_tools(_mt(tool_config_path=str(tmp_path / "clash.yaml"), function_tool_path=fn_path))
    rollout = SimpleNamespace(multi_turn=_mt(enable=False, function_tool_path=fn_path))
    with pytest.raises(ConfigError, match=r"set actor_rollout_ref.rollout.multi_turn.enable=true"):
        build_agent_loop(rollout)
    loop = build_agent_loop(SimpleNamespace(multi_turn=_mt(function_tool_path=fn_path)))
    assert isinstance(loop.tools["calculator"], FunctionTool)


def test_the_length_filter_sees_the_function_tools_schemas(tmp_path, tiny_model_dir):
    """verl's data.function_tool_path: the dataset renders each prompt with the tools' schemas, so a prompt that fits
    alone but not with the schemas is filtered (and the kept prompts carry the schemas the rollout sends)."""
    from tiller.data.rl_dataset import build_rl_dataset, write_rows
    from tiller.config.schema import DataConfig
    from tiller.models.loading import load_tokenizer

    tok = load_tokenizer(tiny_model_dir, padding_side="left")
    rows = [{"prompt": [{"role": "user", "content": "What is the weather in Tokyo?"}], "data_source": "d",
             "reward_model": {"ground_truth": "17.3"}}]
    write_rows(rows, tmp_path / "p.jsonl")
    schemas = [t.schema for t in load_function_tools(_file(tmp_path, VERL_EXAMPLES)).values()]
    plain = build_rl_dataset(DataConfig(max_prompt_length=4096), tok, [str(tmp_path / "p.jsonl")],
                             what="data.val_files")
    with_tools = build_rl_dataset(DataConfig(max_prompt_length=4096), tok, [str(tmp_path / "p.jsonl")],
                                  what="data.val_files", tool_schemas=schemas)
    n_plain, n_tools = len(plain.items[0].prompt_ids), len(with_tools.items[0].prompt_ids)
    assert '"name": "get_weather"' in with_tools.items[0].prompt_text and n_tools > n_plain + 50
    cfg = DataConfig(max_prompt_length=n_plain + 10, filter_overlong_prompts=True)
    assert len(build_rl_dataset(cfg, tok, [str(tmp_path / "p.jsonl")], what="data.val_files").items) == 1
    with pytest.raises(Exception, match="no prompts left .all 1 prompts are longer"):
        build_rl_dataset(cfg, tok, [str(tmp_path / "p.jsonl")], what="data.val_files", tool_schemas=schemas)


def test_tool_env_step_reward_is_the_calls_tool_rewards(tmp_path, tiny_model_dir):
    """On the environment interface (tiller.rollout.environments.ToolEnv) a function tool's reward is the step's
    reward, so it adds to the episode's return (the sum of step rewards)."""
    from tiller.models.loading import load_tokenizer
    from tiller.rollout.environments import ToolEnv

    tools = load_function_tools(_file(tmp_path, '''
        from verl.tools.function_tool import function_tool

        @function_tool
        def check(answer: str) -> tuple:
            """Check an answer.

            Args:
                answer: the answer.
            """
            return ("right", 1.0) if answer == "42" else ("wrong", -0.25)
        '''))
    env = ToolEnv(tools, load_tokenizer(tiny_model_dir, padding_side="left"))
    env.reset({"prompt_text": "x"})
    call = '<tool_call>{{"name": "check", "arguments": {{"answer": "{}"}}}}</tool_call>'
    obs, reward, done, info = env.step(call.format("42") + call.format("7"))
    assert "right" in obs and "wrong" in obs and reward == 0.75 and not done and info == {"tool_calls": 2}
