"""OpenAI function calling on top of the Hermes / Qwen `<tool_call>` format (the one `tiller.rollout.agent`
parses), so agent frameworks can drive a served model.

In: `tools` (OpenAI function schemas) go to the chat template's `tools=` argument; a template that does not
use them (no `tools` variable in its source) gets them as a system message in Qwen2.5's wording instead.
Assistant messages with `tool_calls` are passed on with `arguments` as objects (what Qwen2.5's template
expects), or, for templates that do not render `tool_calls`, written into the content as `<tool_call>` blocks;
`tool` messages keep their role.
Out: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in the completion become
`message.tool_calls` (arguments as a JSON string, ids `call_<hex>`), the remaining text the `content`
(None when empty), and `finish_reason` "tool_calls". Malformed blocks stay in the content. `--tool-call-parser`
(vLLM's flag) reads Qwen3-Coder / Qwen3.5's XML calls (`qwen3_coder`), GLM-4.5's, Seed-OSS's or MiniMax-M2's
instead (`tiller.rollout.tool_parsers`; their tags read with the special tokens kept).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from tiller.rollout import tool_parsers
from tiller.rollout.agent import TOOL_CALL, parse_tool_calls, with_tools_system_message
from tiller.serve.protocol import RequestError

def _arguments(value: Any, where: str) -> dict:
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise RequestError(f"{where}: arguments must be a JSON object (or its JSON string)", where)
    return parsed


def prepare_messages(messages: list[dict], tools: list[dict] | None, template: str) -> tuple[list[dict], list | None]:
    """Messages and `tools=` value for `apply_chat_template` (see the module docstring)."""
    renders_calls = "tool_calls" in template
    out: list[dict] = []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls and m["role"] == "assistant":
            parsed = []
            for j, c in enumerate(calls):
                fn = c.get("function", c) if isinstance(c, dict) else {}
                if not isinstance(fn.get("name"), str):
                    raise RequestError(f"messages[{i}].tool_calls[{j}].function.name is required",
                                       f"messages[{i}].tool_calls[{j}]")
                parsed.append({"name": fn["name"],
                               "arguments": _arguments(fn.get("arguments", {}), f"messages[{i}].tool_calls[{j}]")})
            if renders_calls:
                m["tool_calls"] = [{"type": "function", "function": p} for p in parsed]
            else:
                blocks = "".join(f"<tool_call>\n{json.dumps(p)}\n</tool_call>" for p in parsed)
                m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + blocks
        out.append(m)
    if not tools:
        return out, None
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("function", {}).get("name"), str):
            raise RequestError(f"tools[{j}] must be {{'type': 'function', 'function': {{'name': ...}}}}", f"tools[{j}]")
    if "tools" in template:
        return out, tools
    return with_tools_system_message(out, tools), None


SERVE_PARSERS = tool_parsers.SERVE_FORMATS


def extract_tool_calls(text: str, parser: str = "hermes",
                       tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
    """(content without the well-formed tool-call blocks or None, OpenAI `tool_calls`). `parser`: the format the
    model writes calls in (`tiller serve --tool-call-parser`, vLLM's flag; `tiller.rollout.tool_parsers`): for
    the non-Hermes formats the content is the text before the first call, as verl's and vLLM's parsers cut it."""
    if parser != "hermes":
        found = [c for c in tool_parsers.PARSERS[parser](text, tools or []) if not c.error]
        if not found:
            return text, []
        start = text.find(tool_parsers.CALL_STARTS[parser])
        content = text[:start].strip() if start >= 0 else ""
        return content or None, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in found]
    calls = parse_tool_calls(text)
    if not calls or all(c.error for c in calls):
        return text, []
    tool_calls, content = [], text
    for call, match in zip(calls, TOOL_CALL.finditer(text)):
        if call.error:
            continue
        tool_calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": call.name, "arguments": json.dumps(call.arguments)}})
        content = content.replace(match.group(0), "", 1)
    content = content.strip()
    return content or None, tool_calls
