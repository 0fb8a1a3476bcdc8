"""Tool-call formats of the multi-turn loop (`actor_rollout_ref.rollout.multi_turn.format`), as verl's
`verl/experimental/agent_loop/tool_parser.py` (verl-project/verl 1dda039b) parses them:

| format | what a model writes | models |
|---|---|---|
| `hermes` | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` | Qwen2.5, Qwen3, Hermes |
| `qwen3_coder` | `<tool_call><function=NAME><parameter=ARG>value</parameter>...</function></tool_call>` | Qwen3-Coder, Qwen3.5 |
| `glm` | `<tool_call>NAME<arg_key>ARG</arg_key><arg_value>value</arg_value>...</tool_call>` (stop: `<|observation|>`) | GLM-4.5 |
| `seed` | `<seed:tool_call><function=NAME><parameter=ARG>value</parameter></function></seed:tool_call>` | Seed-OSS |
| `minimax` | `<minimax:tool_call><invoke name="NAME"><parameter name="ARG">value</parameter></invoke></minimax:tool_call>` | MiniMax-M2 |
| `gpt-oss` | `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` | gpt-oss |

Values: qwen3_coder converts each by the tool schema's parameter type (int, number, boolean, object via JSON, other
types via `ast.literal_eval`, else the string), as verl; glm / seed / minimax take JSON when it parses, else the
stripped string. A malformed call is dropped, as verl's parsers drop it (a turn whose calls are all malformed ends
the conversation); `hermes` keeps tiller's behaviour: a malformed block comes back to the model as an error.
glm, seed, minimax and gpt-oss read the turn with its special tokens.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tiller.config.validate import TOOL_CALL_FORMATS

FORMATS = TOOL_CALL_FORMATS


@dataclass
class ParsedCall:
    name: str
    arguments: dict
    error: str | None = None


def _json_or_text(raw: str) -> Any:
    value = raw.strip()
    try:
        return json.loads(value)
    except ValueError:
        return value


# ------------------------------------------------------------------------------------------- qwen3_coder
_Q_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$", re.DOTALL)
_Q_FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
_Q_PARAMETER = re.compile(r"<parameter=(.*?)</parameter>|<parameter=(.*?)$", re.DOTALL)
_INT_TYPES = ("int", "uint", "long", "short", "unsigned")


def _typed(value: str, spec: dict | None) -> Any:
    """verl's `convert_param_value`: a parameter's text as its schema type says."""
    if value.lower() == "null":
        return None
    if spec is None:
        return value
    kind = str(spec.get("type", "string")).strip().lower() if isinstance(spec, dict) else "string"
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind.startswith(_INT_TYPES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
            return number if number - int(number) != 0 else int(number)
        except (ValueError, OverflowError):
            return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind == "object" or kind.startswith("dict"):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def parse_qwen3_coder(text: str, schemas: Sequence[dict] = ()) -> list[ParsedCall]:
    """Qwen3-Coder / Qwen3.5's XML calls (verl's `Qwen3XMLToolParser`, a truncated last call included)."""
    if "<tool_call>" not in text:
        return []
    blocks = [a or b for a, b in _Q_CALL.findall(text)] or [text]
    functions = [a or b for block in blocks for a, b in _Q_FUNCTION.findall(block)]
    properties = {s.get("function", {}).get("name"): (s.get("function", {}).get("parameters") or {}).get(
        "properties") or {} for s in schemas}
    calls = []
    for body in functions:
        end = body.find(">")
        if end < 0:
            continue  # (a truncated header: not recoverable)
        name, specs, arguments = body[:end], properties.get(body[:end], {}), {}
        for a, b in _Q_PARAMETER.findall(body[end + 1:]):
            part = a or b
            cut = part.find(">")
            if cut < 0:
                continue
            value = part[cut + 1:]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            arguments[part[:cut]] = _typed(value, specs.get(part[:cut]) if specs else None)
        calls.append(ParsedCall(name, arguments))
    return calls


# ------------------------------------------------------------------------------------------------- glm
_GLM_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse_glm(text: str, schemas: Sequence[dict] = ()) -> list[ParsedCall]:
    """GLM-4.5's calls (verl's `GLMToolParser`)."""
    calls = []
    for body in _GLM_CALL.findall(text):
        first = body.find("<arg_key>")
        name = (body if first < 0 else body[:first]).strip()
        arguments = {} if first < 0 else {k.strip(): _json_or_text(v) for k, v in _GLM_ARG.findall(body[first:])}
        calls.append(ParsedCall(name, arguments))
    return calls


# ------------------------------------------------------------------------------------------------ seed
_SEED_CALL = re.compile(r"<seed:tool_call>(.*?)</seed:tool_call>", re.DOTALL)
_SEED_FUNCTION = re.compile(r"<function=([^>\n]+)>\s*(.*?)</function>", re.DOTALL)
_SEED_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def parse_seed(text: str, schemas: Sequence[dict] = ()) -> list[ParsedCall]:
    """ByteDance Seed's calls (verl's `SeedToolParser`)."""
    calls = []
    for body in _SEED_CALL.findall(text):
        match = _SEED_FUNCTION.search(body)
        if match:
            calls.append(ParsedCall(match.group(1).strip(), {k.strip(): _json_or_text(v) for k, v in
                                                             _SEED_PARAMETER.findall(match.group(2))}))
    return calls


# --------------------------------------------------------------------------------------------- minimax
_MM_CALL = re.compile(r"<minimax:tool_call>(.*?)</minimax:tool_call>", re.DOTALL)
_MM_INVOKE = re.compile(r'<invoke name="([^"]+)">\s*(.*?)</invoke>', re.DOTALL)
_MM_PARAMETER = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)


def parse_minimax(text: str, schemas: Sequence[dict] = ()) -> list[ParsedCall]:
    """MiniMax's calls (verl's `MiniMaxToolParser`): several invokes per block."""
    return [ParsedCall(name.strip(), {k.strip(): _json_or_text(v) for k, v in _MM_PARAMETER.findall(body)})
            for block in _MM_CALL.findall(text) for name, body in _MM_INVOKE.findall(block)]


# --------------------------------------------------------------------------------------------- gpt-oss
_OSS_COT = re.compile(r"<\|start\|>assistant<\|channel\|>analysis<\|message\|>.*?<\|end\|>", re.DOTALL)
_OSS_PARTIAL_COT = re.compile(r"<\|channel\|>analysis<\|message\|>(.*?)<\|end\|>", re.DOTALL)
_OSS_CALL = re.compile(r"<\|start\|>assistant<\|channel\|>[^<]* to=functions\.([^<]+) "
                       r"<\|constrain\|>json<\|message\|>(.*?)<\|call\|>", re.DOTALL)


def parse_gpt_oss(text: str, schemas: Sequence[dict] = ()) -> list[ParsedCall]:
    """gpt-oss's harmony calls (verl's `GptOssToolParser`; its reasoning channel removed first). Arguments that are
    not a JSON object come back to the model as an error (verl passes the raw text on to the tool)."""
    text = _OSS_PARTIAL_COT.sub("", _OSS_COT.sub("", text))
    calls = []
    for name, raw in _OSS_CALL.findall(text):
        try:
            arguments = json.loads(raw)
            if not isinstance(arguments, dict):
                raise ValueError("not a JSON object")
            calls.append(ParsedCall(name.strip(), arguments))
        except ValueError as err:
            calls.append(ParsedCall("", {}, error=f"invalid arguments for {name.strip()!r}: {raw[:200]!r}: {err}"))
    return calls


PARSERS: dict[str, Callable[[str, Sequence[dict]], list[ParsedCall]]] = {
    "qwen3_coder": parse_qwen3_coder, "glm": parse_glm, "seed": parse_seed, "minimax": parse_minimax,
    "gpt-oss": parse_gpt_oss}
KEEP_SPECIAL_TOKENS = ("glm", "seed", "minimax", "gpt-oss")
# where a format's calls start (an OpenAI server's content is the text before it); `tiller serve --tool-call-parser`
# and the agent endpoint take these formats (gpt-oss's harmony chats are not served)
CALL_STARTS = {"qwen3_coder": "<tool_call>", "glm": "<tool_call>", "seed": "<seed:tool_call>",
               "minimax": "<minimax:tool_call>"}
SERVE_FORMATS = ("hermes", *CALL_STARTS)  # (verl decodes their turns with special tokens)
STOP_TOKENS = {"glm": ("<|observation|>",)}


def stop_token_ids(fmt: str, tokenizer) -> list[int]:
    """The extra stop tokens of a format that the tokenizer has (GLM's `<|observation|>`)."""
    ids = []
    for token in STOP_TOKENS.get(fmt, ()):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id >= 0 and token_id != getattr(tokenizer, "unk_token_id", None):
            ids.append(token_id)
    return ids
