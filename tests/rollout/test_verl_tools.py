"""verl `BaseTool` classes in tiller's multi-turn loop (tiller.rollout.verl_tools): a module written for verl loads
without verl, each call is create(create_kwargs from the sample's tools_kwargs) / execute / release as verl's tool
agent loop runs it, a turn's async calls run concurrently across samples, and verl's gsm8k multi-turn example
(`tiller data gsm8k --tool`: its parquet and tool config) runs unchanged."""

from __future__ import annotations

import json
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.rollout.test_agent import _prompt, ScriptedEngine
from tiller.errors import ConfigError, DataError
from tiller.rollout import SamplingParams
from tiller.rollout.agent import execute_tool_calls, parse_tool_calls, run_agent_loop, tools_kwargs_of
from tiller.rollout.tools import load_tools
from tiller.rollout.verl_tools import Gsm8kTool, OpenAIFunctionToolSchema, VerlTool

# a tool module as a verl user writes it (verl's BaseTool API; verl/tests/tools/_stub_search_tools.py's imports)
VERL_TOOL_MODULE = '''
import asyncio
from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op

LOG = []          # every lifecycle call, in order
INFLIGHT = [0, 0]  # [now, most at once]


class Lookup(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self.table = {}

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self.table[instance_id] = kwargs.get("create_kwargs", {}).get("secret")
        LOG.append(("create", self.table[instance_id]))
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        INFLIGHT[0] += 1
        INFLIGHT[1] = max(INFLIGHT)
        await asyncio.sleep(0.05)
        INFLIGHT[0] -= 1
        LOG.append(("execute", self.table[instance_id], parameters, kwargs["agent_data"].request_id != ""))
        if parameters.get("key") == "boom":
            raise RuntimeError("lookup failed")
        secret = self.table[instance_id]
        return ToolResponse(text=f"{self.config['prefix']}{secret}"), (1.0 if parameters.get("key") == secret else 0.0), {}

    async def release(self, instance_id: str, **kwargs) -> None:
        LOG.append(("release", self.table.pop(instance_id)))
'''

SCHEMA = {"type": "function", "function": {"name": "lookup", "description": "Look a key up.", "parameters": {
    "type": "object", "properties": {"key": {"type": "string", "description": "the key"}}, "required": ["key"]}}}


@pytest.fixture()
def verl_tool(tmp_path, monkeypatch):
    (tmp_path / "my_verl_tools.py").write_text(VERL_TOOL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tmp_path / "tools.yaml"
    cfg.write_text(json.dumps({"tools": [{"class_name": "my_verl_tools.Lookup",
                                          "config": {"type": "native", "prefix": "secret="},
                                          "tool_schema": SCHEMA}]}))
    tools = load_tools(cfg)
    yield tools, sys.modules["my_verl_tools"]
    sys.modules.pop("my_verl_tools", None)


def _call(key: str) -> str:
    return f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{key}"}}}}</tool_call>'


def test_a_module_written_for_verl_loads_without_verl_and_leaves_no_stand_in(verl_tool):
    tools, module = verl_tool
    tool = tools["lookup"]
    assert isinstance(tool, VerlTool) and "verl" not in sys.modules
    # the class got verl's arguments: the config as written (type included) and a schema model
    assert tool.tool.config == {"type": "native", "prefix": "secret="}
    assert isinstance(tool.tool.tool_schema, OpenAIFunctionToolSchema) and tool.tool.name == "lookup"
    assert tool.schema == SCHEMA  # what the chat template renders: verl's model_dump(exclude_unset, exclude_none)


def test_each_call_is_create_execute_release_with_the_samples_create_kwargs(verl_tool):
    tools, module = verl_tool
    kwargs = {"lookup": {"create_kwargs": {"secret": "k1"}}}
    good, bad, boom = execute_tool_calls(parse_tool_calls(_call("k1") + _call("zz") + _call("boom")), tools, 100,
                                         tools_kwargs=kwargs)
    assert (good.text, good.reward) == ("secret=k1", 1.0) and (bad.text, bad.reward) == ("secret=k1", 0.0)
    assert boom.text == "Error: RuntimeError: lookup failed" and boom.reward == 0.0
    # three instances, each created with the sample's create_kwargs and released (the failed one too)
    assert [e[0] for e in module.LOG].count("create") == 3 and [e[0] for e in module.LOG].count("release") == 3
    assert all(e[1] == "k1" for e in module.LOG) and all(e[3] for e in module.LOG if e[0] == "execute")
    # no tools_kwargs: create_kwargs is {} (verl's default), so the instance has no secret
    (none,) = execute_tool_calls(parse_tool_calls(_call("k1")), tools, 100)
    assert (none.text, none.reward) == ("secret=None", 0.0)


def test_agent_loop_gives_each_sample_its_own_tools_kwargs_and_runs_a_turn_concurrently(verl_tool, tok):
    tools, module = verl_tool
    secrets = ["a", "b", "c", "d"]

    def script(context, row):  # ask for key "a" everywhere, then end
        return "done<|im_end|>" if "<|im_start|>tool" in context else _call("a") + "<|im_end|>"

    prompts = [_prompt(tok, f"q{i}") for i in range(4)]
    out = run_agent_loop(ScriptedEngine(tok, script), tok, prompts, SamplingParams(max_new_tokens=60, n=2), tools,
                         max_response_length=300, max_tool_response_chars=100,
                         tools_kwargs=[{"lookup": {"create_kwargs": {"secret": s}}} for s in secrets])
    # rows are prompt-major: prompt i's two samples see secret i; only prompt 0's key matches
    texts = [tok.decode(ids) for ids in out.response_ids]
    for i, text in enumerate(texts):
        assert f"secret={secrets[i // 2]}" in text
    assert out.tool_rewards == [[1.0], [1.0], [0.0], [0.0], [0.0], [0.0], [0.0], [0.0]]
    assert module.INFLIGHT[1] == 8  # the 8 samples' calls of the turn were in flight together
    with pytest.raises(ValueError, match="tools_kwargs has 1 entries for 4 prompts"):
        run_agent_loop(ScriptedEngine(tok, script), tok, prompts, SamplingParams(max_new_tokens=60), tools,
                       tools_kwargs=[{}])


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from tiller.models.loading import load_tokenizer

    return load_tokenizer(tiny_model_dir, padding_side="left")


def test_verls_gsm8k_tool_as_its_example_configures_it(tmp_path):
    from tiller.data.preprocess.gsm8k import TOOL_CONFIG

    (tmp_path / "tool_config.yaml").write_text(TOOL_CONFIG)
    tools = load_tools(tmp_path / "tool_config.yaml")
    tool = tools["calc_gsm8k_reward"]
    assert isinstance(tool.tool, Gsm8kTool)
    assert tool.schema["function"]["parameters"]["required"] == ["answer"]
    kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}
    calls = parse_tool_calls('<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}</tool_call>'
                             '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "#### 71"}}'
                             '</tool_call><tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": 72}}'
                             '</tool_call>')
    right, wrong, number = execute_tool_calls(calls, tools, 1000, tools_kwargs=kwargs)
    # verl's reply text and rewards: 0.0 when the score improved on the instance's 0.0, else -0.05
    assert (right.text, right.reward) == ("Current parsed answer='72' reward=1.0", 0.0)
    assert (wrong.text, wrong.reward) == ("Current parsed answer='#### 71' reward=0.0", -0.05)
    assert (number.text, number.reward) == ("Current parsed answer='72' reward=1.0", 0.0)  # (a number is str()-ed)
    assert tool.tool._instances == {}  # every instance released


def test_tools_kwargs_problems_are_data_errors_naming_the_row(tmp_path, tiny_model_dir):
    from tiller.data.rl_dataset import RLDataset
    from tiller.models.loading import load_tokenizer

    tok = load_tokenizer(tiny_model_dir, padding_side="left")
    schema = {"type": "function", "function": {"name": "calc_gsm8k_reward", "description": "d"}}

    def rows(*extras, suffix=".parquet"):
        path = tmp_path / f"p{suffix}"
        table = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
                  "reward_model": {"ground_truth": "2"}, "extra_info": e} for e in extras]
        if suffix == ".parquet":
            pq.write_table(pa.Table.from_pylist(table), path)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in table))
        return RLDataset(path, tok, max_prompt_length=1024, tool_schemas=[schema])

    # a parquet struct gives every row every key (None where a row has none): that is no tools_kwargs
    ok = rows({"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "2"}}, "other": None}},
              {"tools_kwargs": {"calc_gsm8k_reward": None, "other": None}})
    assert tools_kwargs_of(ok.items[1].extra_info) == {}
    assert tools_kwargs_of(ok.items[0].extra_info) == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "2"}}}
    with pytest.raises(DataError, match=r"p.jsonl row 1: extra_info.need_tools_kwargs is true but"):
        rows({}, {"need_tools_kwargs": True, "tools_kwargs": {}}, suffix=".jsonl")
    with pytest.raises(DataError, match=r"row 0: extra_info.tools_kwargs names tool 'calc', which is not among"):
        rows({"tools_kwargs": {"calc": {"create_kwargs": {"ground_truth": "2"}}}})
    with pytest.raises(DataError, match=r"row 0: extra_info.tools_kwargs.calc_gsm8k_reward must be a mapping with"):
        rows({"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": "2"}}}, suffix=".jsonl")


def test_bad_verl_tool_entries_are_config_errors_naming_the_entry(tmp_path, monkeypatch):
    (tmp_path / "bad_verl_tools.py").write_text(VERL_TOOL_MODULE + textwrap.dedent('''
        class Broken(BaseTool):
            def __init__(self, config, tool_schema):
                raise KeyError("api_key")
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [({"class_name": "bad_verl_tools.Lookup", "config": {"type": "mcp"}, "tool_schema": SCHEMA},
              r"tools\[0\]: config.type='mcp': verl's only tool type is 'native'"),
             ({"class_name": "bad_verl_tools.Lookup", "tool_schema": {"type": "function", "function": {"name": "x"}}},
              r"tools\[0\]: cannot build bad_verl_tools.Lookup: ValidationError"),
             ({"class_name": "bad_verl_tools.Broken", "tool_schema": SCHEMA},
              r"tools\[0\]: cannot build bad_verl_tools.Broken: KeyError: 'api_key'"),
             ({"class_name": "bad_verl_tools.Lookup"}, r"no tool schema")]
    try:
        for entry, message in cases:
            (tmp_path / "t.yaml").write_text(json.dumps({"tools": [entry]}))
            with pytest.raises(ConfigError, match=message):
                load_tools(tmp_path / "t.yaml")
    finally:
        sys.modules.pop("bad_verl_tools", None)
