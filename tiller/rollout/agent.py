"""Multi-turn, tool-using rollouts: an agent loop over any rollout engine.

Each sample is a conversation grown token by token (the ReAct pattern, Yao et al. 2023, arXiv 2210.03629,
in the Qwen / Hermes tool-call format that verl's `ToolAgentLoop` also uses):

1. the engine generates one assistant turn for every live conversation (one batched `generate` call per
   turn, n=1 per row; the n samples of a prompt are n rows);
2. the turn's text is searched for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks;
   none -> the conversation is finished;
3. otherwise the turn's first `max_parallel_calls` calls run (`tiller.rollout.tools`; errors come back as text),
   each result cut to `max_tool_response_length` characters (verl's marked left / right / middle cut), and the
   results are appended as `tool` messages, rendered by the tokenizer's own chat template, plus the generation
   prompt of the next assistant turn;
4. repeat until no tool call, `max_assistant_turns` turns, `max_user_turns` tool turns, or the response budget is
   spent (verl's multi_turn settings, with verl's defaults: 1 call a turn, 256 characters, middle).

The response of a sample is everything after its prompt: model tokens (response_mask 1, with the
engine's sampling logprobs) and template + tool-result tokens (response_mask 0, logprob 0). Tokens are
never re-tokenized: what the model generated is kept id for id, so the trainer's log-probabilities are of
exactly the sequence that was sampled.

How tool messages become tokens: the chat template renders `[user, assistant, tool...]` with
`add_generation_prompt=True` and `[user, assistant]` without; the difference, taken from just after the
assistant turn's end-of-turn token (eos), is the text between the model's eos and the next assistant
turn (e.g. `\\n<|im_start|>tool\\n...<|im_end|>\\n<|im_start|>assistant\\n`). When a turn did not end with an
eos (a stop string like `</tool_call>` cut it), the eos is inserted first (masked). Templates that
reject the `tool` role get the result as a `user` message wrapped in `<tool_response>...</tool_response>`.

Deviations from verl's agent loop: one batched engine call per turn (not per-request async);
no interaction agents; the total response length `max_response_length` (default
`sampling.max_new_tokens`) bounds model + tool tokens together, as verl's `response_length` does.
"""

from __future__ import annotations

import json
import re
from uuid import uuid4
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from tiller.data.rl_dataset import (  # noqa: F401 (with_tools_system_message: tiller.serve's import)
    HERMES_SYSTEM,
    render_prompt_with_schemas,
    with_tools_system_message,
)
from tiller.errors import ConfigError
from tiller.rollout.base import RolloutOutput, SamplingParams, eos_token_ids
from tiller.rollout.function_tools import load_function_tools, ToolResult
from tiller.rollout import tool_parsers
from tiller.rollout.tools import CalculatorTool, load_tools, Tool
from tiller.rollout.verl_tools import AgentData, TOOL_LOOP

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None  # set when the block could not be parsed


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Tool calls in a turn's text; a malformed block gives a ToolCall with `error` set.

    >>> parse_tool_calls('x <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>')
    [ToolCall(name='calculator', arguments={'expression': '1+1'}, error=None)]
    """
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            obj = json.loads(body)
            name, args = obj["name"], obj.get("arguments", {})
            if isinstance(args, str):  # OpenAI style: arguments as a JSON string
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be a string and arguments an object")
            calls.append(ToolCall(name, args))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            calls.append(ToolCall("", {}, error=f"invalid tool call {body[:200]!r}: {err}"))
    return calls


def turn_calls(tokenizer, ids: Sequence[int], tool_format: str = "hermes",
               schemas: Sequence[dict] = ()) -> list[ToolCall]:
    """The tool calls of one sampled turn in `tool_format` (`tiller.rollout.tool_parsers`)."""
    if tool_format == "hermes":
        return parse_tool_calls(tokenizer.decode(ids, skip_special_tokens=True))
    keep = tool_format in tool_parsers.KEEP_SPECIAL_TOKENS
    text = tokenizer.decode(ids, skip_special_tokens=not keep)
    return [ToolCall(c.name, c.arguments, c.error) for c in tool_parsers.PARSERS[tool_format](text, schemas)]


TRUNCATE_SIDES = ("left", "right", "middle")


def truncate_tool_response(text: str, max_chars: int, side: str = "middle") -> str:
    """verl's cut of a tool response longer than `max_chars` (multi_turn.max_tool_response_length /
    tool_response_truncate_side): left keeps the end, right the start, middle both halves, each marked.

    >>> truncate_tool_response("abcdefghij", 4, "middle")
    'ab...(truncated)...ij'
    >>> truncate_tool_response("abcdefghij", 4, "left"), truncate_tool_response("abcdefghij", 4, "right")
    ('(truncated)...ghij', 'abcd...(truncated)')
    """
    if len(text) <= max_chars:
        return text
    if side == "left":
        return "(truncated)..." + text[-max_chars:]
    if side == "right":
        return text[:max_chars] + "...(truncated)"
    half = max_chars // 2
    return text[:half] + "...(truncated)..." + (text[-half:] if half else "")


def execute_tool_calls(calls: Sequence[ToolCall], tools: dict[str, Tool], max_chars: int,
                       side: str = "middle", tools_kwargs: dict | None = None) -> list[ToolResult]:
    """Each call's result (errors as `Error: ...` text, reward 0.0), its text cut to `max_chars`
    (`truncate_tool_response`). A tool with a `run(arguments) -> ToolResult` method (function tools, verl `BaseTool`
    classes) gives its reward; the others' reward is 0.0 (verl: a tool without a reward). `tools_kwargs`: the
    sample's `extra_info.tools_kwargs` (verl `BaseTool` classes' `create_kwargs`)."""
    return execute_turn([calls], tools, max_chars, side, [tools_kwargs])[0]


def execute_turn(calls: Sequence[Sequence[ToolCall]], tools: dict[str, Tool], max_chars: int, side: str = "middle",
                 tools_kwargs: Sequence[dict | None] | None = None,
                 agent_data: Sequence[AgentData | None] | None = None) -> list[list[ToolResult]]:
    """`execute_tool_calls` for one turn of many samples (`calls[i]`: sample i's calls). The async tools' calls (verl
    `BaseTool` classes, `async def` function tools) of every sample run concurrently on the process's tool event loop
    (`tiller.rollout.verl_tools.TOOL_LOOP`; verl runs every sample's calls concurrently too); the others run in
    order, in this thread."""
    out: list[list[ToolResult | None]] = [[None] * len(c) for c in calls]
    slots, coros = [], []
    for i, sample_calls in enumerate(calls):
        kwargs = tools_kwargs[i] if tools_kwargs is not None else None
        data = agent_data[i] if agent_data is not None else None
        for j, call in enumerate(sample_calls):
            if call.error:
                out[i][j] = ToolResult(f"Error: {call.error}")
            elif call.name not in tools:
                out[i][j] = ToolResult(f"Error: unknown tool {call.name!r}; available: "
                                       f"{', '.join(sorted(tools)) or 'none'}")
            elif getattr(tools[call.name], "is_async", False) and hasattr(tools[call.name], "acall"):
                slots.append((i, j))
                coros.append(tools[call.name].acall(call.arguments, kwargs, data))
            else:
                tool = tools[call.name]
                try:
                    out[i][j] = (tool.run(call.arguments) if hasattr(tool, "run")
                                 else ToolResult(str(tool(call.arguments))))
                except Exception as err:  # noqa: BLE001 - a broken tool must not end the rollout
                    out[i][j] = ToolResult(f"Error: {type(err).__name__}: {err}")
    for (i, j), result in zip(slots, TOOL_LOOP.gather(coros)):
        out[i][j] = result if isinstance(result, ToolResult) else ToolResult(f"Error: {type(result).__name__}: {result}")
    for sample in out:
        for result in sample:
            result.text = truncate_tool_response(result.text, max_chars, side)
    return out  # type: ignore[return-value]


def run_tool_calls(calls: Sequence[ToolCall], tools: dict[str, Tool], max_chars: int,
                   side: str = "middle") -> list[str]:
    """The text result of every call (errors as `Error: ...`), each cut to `max_chars` (`truncate_tool_response`)."""
    return [r.text for r in execute_tool_calls(calls, tools, max_chars, side)]


class ToolResponseEncoder:
    """Token ids that follow a finished assistant turn: tool messages + the next generation prompt."""

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # data.apply_chat_template_kwargs
        self.eos_ids = set(eos_token_ids(None, tokenizer))
        eos_id = getattr(tokenizer, "eos_token_id", None)
        self.eos_text = tokenizer.decode([eos_id]) if eos_id is not None else ""

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                                  **self.chat_template_kwargs)

    def text(self, results: Sequence[str], calls: Sequence[ToolCall] | None = None) -> str:
        """The text between an assistant turn's eos and the next assistant turn's first token. With the turn's
        parsed `calls`, the assistant turn is rendered as a tool-call message (`tool_calls`), so a template that
        lays out tool-call turns differently from text turns (e.g. no newline after them) gives its own text."""
        if calls and not any(c.error for c in calls):
            message = {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
            try:
                found = self._after_eos(message, results)
            except Exception:  # noqa: BLE001 - a template that rejects tool_calls: the text-turn rendering below
                found = None
            if found is not None:
                return found
        base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "ASSISTANT_TURN"}]
        full = self._render_results(base, results)
        prefix = self._render(base, False)
        marker = "ASSISTANT_TURN" + self.eos_text
        end = prefix.rfind(marker)
        if end >= 0 and full.startswith(prefix[:end + len(marker)]):
            return full[end + len(marker):]
        common = len(prefix) if full.startswith(prefix) else 0
        return full[common:]

    def _render_results(self, base: list[dict], results: Sequence[str]) -> str:
        try:
            return self._render(base + [{"role": "tool", "content": r} for r in results], True)
        except Exception:  # noqa: BLE001 - templates without a tool role raise from jinja
            wrapped = "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)
            return self._render(base + [{"role": "user", "content": wrapped}], True)

    def _after_eos(self, message: dict, results: Sequence[str]) -> str | None:
        """The text after `message`'s eos in the rendering of [user, message, tool results...], or None when the
        rendering of [user, message] does not end its turn with the eos."""
        base = [{"role": "user", "content": "USER_TURN"}, message]
        prefix = self._render(base, False)
        end = prefix.rfind(self.eos_text) if self.eos_text else -1
        turn = prefix[prefix.find("USER_TURN") + len("USER_TURN"):end] if end >= 0 else ""
        if not turn or not all(c["function"]["name"] in turn for c in message["tool_calls"]):
            return None  # (a template that drops tool_calls, or ends the turn without the eos)
        full = self._render_results(base, results)
        cut = end + len(self.eos_text)
        return full[cut:] if full.startswith(prefix[:cut]) else None

    def encode(self, results: Sequence[str], turn_ended_with_eos: bool,
               calls: Sequence[ToolCall] | None = None) -> list[int]:
        text = self.text(results, calls)
        if not turn_ended_with_eos:
            text = self.eos_text + text
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class AgentRolloutOutput(RolloutOutput):
    """`RolloutOutput` of multi-turn samples (len(prompts) * n rows, a prompt's n samples contiguous).

    `response_ids` hold model and tool tokens; `response_mask` is 1 on model tokens, 0 on tool / template
    tokens; `logprobs` are the engine's sampling logprobs on model tokens and 0.0 elsewhere.
    """

    response_mask: list[list[int]] = field(default_factory=list)
    num_turns: list[int] = field(default_factory=list)
    """Assistant turns per sample."""
    num_tool_calls: list[int] = field(default_factory=list)
    tool_errors: list[int] = field(default_factory=list)
    """Tool calls whose result was an error (malformed call, unknown tool, failing tool)."""
    tool_rewards: list[list[float]] = field(default_factory=list)
    """Each tool call's reward, in call order (verl's `tool_rewards`; 0.0 for tools without one)."""
    messages: list[list[dict]] = field(default_factory=list)
    """Each sample's completion as chat messages (assistant turns and tool messages; TRL's tool loop fills it)."""
    states: list = field(default_factory=list)
    """Per sample, an object of the loop that made it handed on to an in-process reward function (TRL's tool loop:
    the completion's prompt and environment); empty for verl's loop."""


def tools_kwargs_of(extra_info: Any) -> dict:
    """A sample's `extra_info.tools_kwargs` ({tool name: {"create_kwargs": {...}, ...}}, verl's RLHFDataset field;
    {} when absent). A parquet struct column gives every row every tool's key, None where a row has none."""
    kwargs = (extra_info or {}).get("tools_kwargs") if isinstance(extra_info, dict) else None
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ConfigError(f"extra_info.tools_kwargs must be a mapping of tool name to {{'create_kwargs': {{...}}}}, "
                          f"got {type(kwargs).__name__}: {kwargs!r:.200}")
    return {name: value for name, value in kwargs.items() if value is not None}


def tool_means(num_turns, num_tool_calls, tool_errors, tool_rewards) -> dict[str, float]:
    """Means over samples of `AgentRolloutOutput`'s per-sample fields (assistant turns, tool calls, failed calls,
    summed tool rewards): tiller eval's `agent` report, and tiller rl's `agent/*` / `val-agent/*` metrics."""
    values = {"turns": num_turns, "tool_calls": num_tool_calls, "tool_errors": tool_errors,
              "tool_reward": [sum(r) for r in tool_rewards]}
    return {f"{name}/mean": float(np.mean(v)) for name, v in values.items()}


@dataclass
class _Row:
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    errors: int = 0
    tool_rewards: list[float] = field(default_factory=list)
    finish: str = ""
    agent_data: AgentData | None = None
    versions: list[int] = field(default_factory=list)
    multi_modal: dict | None = None
    single_turn: bool = False

    def add(self, ids: Sequence[int], logprobs: Sequence[float] | None, budget: int,
            versions: Sequence[int] | None = None) -> bool:
        """Append tokens (logprobs None = tool tokens); False when the budget cut them. `versions` (asynchronous
        RL): the policy version of each model token; tool tokens take the version of the token before them."""
        room = budget - len(self.ids)
        kept = list(ids)[:room]
        self.ids += kept
        self.mask += [1 if logprobs is not None else 0] * len(kept)
        self.logprobs += list(logprobs)[:room] if logprobs is not None else [0.0] * len(kept)
        if versions is not None:
            self.versions += list(versions)[:room]
        elif self.versions:
            self.versions += [self.versions[-1]] * len(kept)
        return len(kept) == len(ids)


def run_agent_loop(engine, tokenizer, prompt_ids: list[list[int]], sampling: SamplingParams,
                   tools: dict[str, Tool] | Sequence[Tool], *, max_assistant_turns: int = 4,
                   max_response_length: int | None = None, max_tool_response_chars: int = 256,
                   truncate_side: str = "middle", max_calls_per_turn: int = 1, max_user_turns: int | None = None,
                   chat_template_kwargs: dict | None = None,
                   tools_kwargs: Sequence[dict | None] | None = None, weights_hook=None,
                   multi_modal: Sequence[dict | None] | None = None, tool_format: str = "hermes",
                   single_turn: Sequence[bool] | None = None) -> AgentRolloutOutput:
    """Roll out `sampling.n` multi-turn conversations per prompt (see the module docstring).

    prompt_ids: the rendered prompts (with tool schemas in them when the template supports `tools=`; see
    `render_prompt_with_tools`). `sampling.max_new_tokens` caps each assistant turn;
    `max_response_length` (default `sampling.max_new_tokens`) caps the whole response.
    verl's multi_turn settings, with its defaults: a turn runs its first `max_calls_per_turn` tool calls
    (max_parallel_calls); each tool response is cut to `max_tool_response_chars` on `truncate_side`
    (max_tool_response_length, tool_response_truncate_side); after `max_user_turns` tool turns (None or 0: no limit)
    the next assistant turn is the last.
    `chat_template_kwargs`: extra template variables of the tool turns' rendering (data.apply_chat_template_kwargs).
    `tools_kwargs`: per prompt, its `extra_info.tools_kwargs` (verl `BaseTool` classes' `create_kwargs`).
    `weights_hook` (asynchronous RL): given to every turn's `engine.generate`; the output's `token_versions` then
    hold each response token's policy version (a tool message's tokens: the version of the turn before it).
    `multi_modal`: per prompt, a vision-language model's image inputs (None for a text prompt), sent with every turn
    of that prompt's conversations (the image tokens stay in the prompt part of the context).
    `tool_format`: how the model writes its calls (multi_turn.format, `tiller.rollout.tool_parsers`).
    `single_turn`: per prompt, True for verl's single_turn_agent rows: one turn, no tool runs.
    """
    tools = dict(tools) if isinstance(tools, dict) else {t.name: t for t in tools}
    for name, per_prompt in (("tools_kwargs", tools_kwargs), ("multi_modal", multi_modal),
                             ("single_turn", single_turn)):
        if per_prompt is not None and len(per_prompt) != len(prompt_ids):
            raise ValueError(f"{name} has {len(per_prompt)} entries for {len(prompt_ids)} prompts")
    images = multi_modal is not None and any(m is not None for m in multi_modal)
    if max_assistant_turns < 1:
        raise ValueError(f"max_assistant_turns must be >= 1, got {max_assistant_turns}")
    budget = max_response_length or sampling.max_new_tokens
    encoder = ToolResponseEncoder(tokenizer, chat_template_kwargs)
    if tool_format != "hermes" and tool_format not in tool_parsers.PARSERS:
        raise ValueError(f"tool_format={tool_format!r}: one of {', '.join(tool_parsers.FORMATS)}")
    schemas = [t.schema for t in tools.values()]
    extra_stops = tuple(tool_parsers.stop_token_ids(tool_format, tokenizer))
    rows = [_Row(list(p)) for p in prompt_ids for _ in range(sampling.n)]
    row_kwargs = [dict((tools_kwargs[i] if tools_kwargs is not None else None) or {})
                  for i in range(len(prompt_ids)) for _ in range(sampling.n)]
    for k, (row, kwargs) in enumerate(zip(rows, row_kwargs)):
        row.agent_data = AgentData(uuid4().hex, kwargs, tool_rewards=row.tool_rewards)
        row.multi_modal = multi_modal[k // sampling.n] if images else None
        row.single_turn = bool(single_turn[k // sampling.n]) if single_turn is not None else False
    for turn in range(max_assistant_turns):
        live = [r for r in rows if not r.finish]
        if not live:
            break
        step = min(sampling.max_new_tokens, max(budget - len(r.ids) for r in live))
        call = replace(sampling, n=1, max_new_tokens=step,
                       seed=None if sampling.seed is None else sampling.seed + 1_000_003 * turn,
                       stop_token_ids=tuple(sampling.stop_token_ids) + extra_stops)
        options = {"weights_hook": weights_hook} if weights_hook is not None else {}
        if images:
            options["multi_modal"] = [r.multi_modal for r in live]
        out = engine.generate([r.prompt + r.ids for r in live], call, **options)
        versions = out.token_versions if weights_hook is not None else []
        calling = []  # (row, its calls, whether the turn ended with an eos)
        for k, (row, ids, lps, reason) in enumerate(zip(live, out.response_ids, out.logprobs, out.finish_reason)):
            row.turns += 1
            if not row.add(ids, lps, budget, versions[k] if versions else None) or reason == "length":
                row.finish = "length"
                continue
            calls = [] if row.single_turn else turn_calls(tokenizer, ids, tool_format, schemas)[:max_calls_per_turn]
            # (verl: at max_user_turns tool turns, the turn just generated ends the conversation)
            if not calls or turn == max_assistant_turns - 1 or (max_user_turns and turn >= max_user_turns):
                row.finish = "stop"
                continue
            calling.append((row, calls, bool(ids) and ids[-1] in encoder.eos_ids))
        executed = execute_turn([c for _, c, _ in calling], tools, max_tool_response_chars, truncate_side,
                                [row.agent_data.tools_kwargs for row, _, _ in calling],
                                [row.agent_data for row, _, _ in calling])
        for (row, calls, ended), results in zip(calling, executed):
            texts = [r.text for r in results]
            row.calls += len(calls)
            row.errors += sum(t.startswith("Error:") for t in texts)
            row.tool_rewards += [r.reward for r in results]
            if not row.add(encoder.encode(texts, ended, calls), None, budget) or len(row.ids) >= budget:
                row.finish = "length"
    for r in rows:
        r.finish = r.finish or "stop"
    return AgentRolloutOutput(
        prompt_ids=[r.prompt for r in rows], response_ids=[r.ids for r in rows], logprobs=[r.logprobs for r in rows],
        finish_reason=[r.finish for r in rows], response_mask=[r.mask for r in rows],
        num_turns=[r.turns for r in rows], num_tool_calls=[r.calls for r in rows],
        tool_errors=[r.errors for r in rows], tool_rewards=[r.tool_rewards for r in rows],
        token_versions=[r.versions for r in rows] if weights_hook is not None else [])


def render_prompt_with_tools(tokenizer, messages: list[dict], tools: dict[str, Tool] | Sequence[Tool],
                             chat_template_kwargs: dict | None = None) -> str:
    """The prompt text with the tools' schemas, generation prompt on: passed as `tools=` when the chat template
    uses them (Qwen2.5, Hermes, Llama 3.1), else as a system message (`with_tools_system_message`).
    `chat_template_kwargs`: extra template variables (data.apply_chat_template_kwargs)."""
    schemas = [t.schema for t in (tools.values() if isinstance(tools, dict) else tools)]
    return render_prompt_with_schemas(tokenizer, messages, schemas, chat_template_kwargs)


@dataclass
class AgentLoop:
    """The multi-turn settings of `actor_rollout_ref.rollout.multi_turn`, ready to run."""

    tools: dict[str, Tool]
    max_assistant_turns: int = 4
    max_tool_response_chars: int = 256
    truncate_side: str = "middle"
    max_calls_per_turn: int = 1
    max_user_turns: int | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    """Extra chat-template variables (data.apply_chat_template_kwargs) of the tool turns."""
    tool_format: str = "hermes"
    """How the model writes its calls (multi_turn.format)."""

    def generate(self, engine, tokenizer, prompt_ids: list[list[int]], sampling: SamplingParams,
                 max_response_length: int | None = None, tools_kwargs: Sequence[dict | None] | None = None,
                 weights_hook=None, multi_modal: Sequence[dict | None] | None = None,
                 single_turn: Sequence[bool] | None = None) -> AgentRolloutOutput:
        return run_agent_loop(engine, tokenizer, prompt_ids, sampling, self.tools, tools_kwargs=tools_kwargs,
                              weights_hook=weights_hook, multi_modal=multi_modal, tool_format=self.tool_format,
                              single_turn=single_turn,
                              max_assistant_turns=self.max_assistant_turns, max_response_length=max_response_length,
                              max_tool_response_chars=self.max_tool_response_chars, truncate_side=self.truncate_side,
                              max_calls_per_turn=self.max_calls_per_turn, max_user_turns=self.max_user_turns,
                              chat_template_kwargs=self.chat_template_kwargs)


def load_all_tools(multi_turn: Any) -> dict[str, Tool]:
    """The tools of `actor_rollout_ref.rollout.multi_turn`: `tool_config_path`'s, then `function_tool_path`'s
    (verl's `load_all_tools`; a name in both is a ConfigError); neither set: the built-in calculator."""
    key = "actor_rollout_ref.rollout.multi_turn"
    declared = load_tools(multi_turn.tool_config_path) if multi_turn.tool_config_path else {}
    functions = load_function_tools(multi_turn.function_tool_path) if multi_turn.function_tool_path else {}
    clash = sorted(set(declared) & set(functions))
    if clash:
        raise ConfigError(f"{key}.function_tool_path={multi_turn.function_tool_path}: tool name(s) {clash} are also "
                          f"declared in {key}.tool_config_path={multi_turn.tool_config_path}; each tool name must be "
                          "unique across the two files: rename one of them")
    return {**declared, **functions} or {"calculator": CalculatorTool()}


def build_agent_loop(rollout_cfg: Any, chat_template_kwargs: dict | None = None) -> AgentLoop | None:
    """`AgentLoop` from `actor_rollout_ref.rollout` when `multi_turn.enable`, else None.
    `chat_template_kwargs`: data.apply_chat_template_kwargs. (With verl's custom agent loops the RL rollout's loop is
    `tiller.rollout.verl_agent_loop.build_rollout_loop`'s.)

    Tools: `load_all_tools`.
    """
    mt = rollout_cfg.multi_turn
    if not mt.enable:
        if mt.function_tool_path:  # (a tool file nothing would call: said, not ignored)
            raise ConfigError(f"actor_rollout_ref.rollout.multi_turn.function_tool_path={mt.function_tool_path}: its "
                              "tools run in the multi-turn tool loop; set actor_rollout_ref.rollout.multi_turn."
                              "enable=true")
        return None
    if mt.max_assistant_turns < 1:
        raise ConfigError(f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns must be >= 1, "
                          f"got {mt.max_assistant_turns}")
    key = "actor_rollout_ref.rollout.multi_turn"
    for name in ("max_parallel_calls", "max_tool_response_length"):
        value = getattr(mt, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}.{name} must be an integer >= 1, got {value!r}")
    if mt.tool_response_truncate_side not in TRUNCATE_SIDES:
        raise ConfigError(f"{key}.tool_response_truncate_side={mt.tool_response_truncate_side!r}: choose one of "
                          f"{', '.join(TRUNCATE_SIDES)}")
    if mt.max_user_turns is not None and (isinstance(mt.max_user_turns, bool) or mt.max_user_turns < 0):
        raise ConfigError(f"{key}.max_user_turns must be null, 0 (no limit) or >= 1, got {mt.max_user_turns!r}")
    tools = load_all_tools(mt)
    return AgentLoop(tools=tools, tool_format=mt.format, max_assistant_turns=mt.max_assistant_turns,
                     max_tool_response_chars=mt.max_tool_response_length, truncate_side=mt.tool_response_truncate_side,
                     max_calls_per_turn=mt.max_parallel_calls, max_user_turns=mt.max_user_turns or None,
                     chat_template_kwargs=dict(chat_template_kwargs or {}))
