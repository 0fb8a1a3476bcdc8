"""Request bodies of the OpenAI-compatible endpoints (the subset tiller serves) and their checks.

Fields follow the OpenAI API reference for `/v1/completions` and `/v1/chat/completions`, plus vLLM's
`top_k`, `min_p`, `repetition_penalty` and `ignore_eos` extensions. Unknown fields are ignored (clients send many),
but the OpenAI fields tiller cannot honour (`best_of` > n, forced `tool_choice`, `functions`, `audio`, `prediction`,
...) are refused with a 400 naming the field, never silently dropped. `response_format` is checked here
(`text`, `json_object` or `json_schema` in OpenAI's shape) and honoured by constrained decoding.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from tiller.errors import UserError


class RequestError(UserError):
    """A bad request: becomes HTTP 400 with OpenAI's error body naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class SamplingFields(BaseModel):
    """Sampling fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")  # kept only to refuse the unsupported ones (check_supported)

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: Optional[int] = Field(None, ge=1)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    return_tokens_as_token_ids: bool = False
    """vLLM's extension: logprob entries name their token as `token_id:<id>` (exact, no decoding)."""
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    """vLLM's extension: `{"regex": "..."}` constrains the reply to text matching the regex (its other kinds are
    refused: JSON goes through response_format)."""
    guided_regex: Optional[str] = None
    """vLLM's older spelling of structured_outputs.regex."""
    stop_token_ids: Optional[list[int]] = None
    """vLLM's extension: token ids that end a choice (the token's text is left out of the reply, as vLLM)."""
    include_stop_str_in_output: bool = False
    """vLLM's extension: keep the stop string (or stop token's text) that ended a choice in its text."""
    skip_special_tokens: bool = True
    """vLLM's extension: False keeps special tokens in the reply's text."""
    min_tokens: int = 0
    """vLLM's extension: refused when > 0 (tiller's sampler does not hold eos back)."""

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise RequestError("stop must hold at most 16 non-empty strings", "stop")
        return stops

    def check_supported(self) -> None:
        if self.min_tokens:
            raise RequestError("min_tokens is not supported by tiller serve (use 0)", "min_tokens")
        self.json_schema()
        extra = self.model_extra or {}
        for name in UNSUPPORTED_FIELDS:
            if extra.get(name) not in (None, [], {}, False):
                raise RequestError(f"{name} is not supported by tiller serve", name)
        modalities = extra.get("modalities")
        if modalities not in (None, ["text"]):
            raise RequestError("modalities other than ['text'] are not supported by tiller serve", "modalities")

    def json_schema(self) -> dict[str, Any] | None:
        """The JSON schema the reply must follow (`{"type": "object"}` for `json_object`), None for text.

        OpenAI's shapes: `{"type": "text"}`, `{"type": "json_object"}`, `{"type": "json_schema", "json_schema":
        {"name": ..., "schema": {...}, "strict": ..., "description": ...}}`. Constrained decoding follows the
        schema exactly, which is what `strict: true` asks and what `strict: false` allows.
        """
        fmt = self.response_format
        if fmt is None:
            return None
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "object"}
        if kind != "json_schema":
            raise RequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                               "response_format")
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError("response_format.json_schema must be an object with `name` and `schema`",
                               "response_format.json_schema")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError("response_format.json_schema.name must be a non-empty string",
                               "response_format.json_schema.name")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON schema object",
                               "response_format.json_schema.schema")
        if spec.get("strict") not in (None, True, False):
            raise RequestError("response_format.json_schema.strict must be a boolean",
                               "response_format.json_schema.strict")
        return schema

    def regex(self) -> tuple[str, str] | None:
        """(the regex the reply must match, the field it came from), or None (vLLM's structured_outputs.regex /
        guided_regex)."""
        found = []
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, dict):
                raise RequestError("structured_outputs must be an object", "structured_outputs")
            for key, value in self.structured_outputs.items():
                if key == "regex" and value is not None:
                    found.append((value, "structured_outputs.regex"))
                elif key != "regex" and value not in (None, False, ""):
                    raise RequestError(f"structured_outputs.{key} is not supported by tiller serve (regex is; JSON "
                                       "goes through response_format)", f"structured_outputs.{key}")
        if self.guided_regex is not None:
            found.append((self.guided_regex, "guided_regex"))
        if len(found) > 1:
            raise RequestError("structured_outputs.regex and guided_regex are both set: use one", "guided_regex")
        if not found:
            return None
        pattern, field = found[0]
        if not isinstance(pattern, str) or not pattern:
            raise RequestError(f"{field} must be a non-empty string", field)
        if self.json_schema() is not None:
            raise RequestError(f"{field} and a JSON response_format are both set: a reply takes one constraint",
                               field)
        return pattern, field

    def token_bias(self, vocab: int) -> dict[int, float]:
        """`logit_bias` as {token id: bias}, checked: ids in [0, vocab), biases in [-100, 100] (OpenAI's range)."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                tid = int(key)
            except ValueError:
                raise RequestError(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
            if not 0 <= tid < vocab:
                raise RequestError(f"logit_bias token id {tid} is outside [0, {vocab})", "logit_bias")
            if not -100.0 <= float(value) <= 100.0:
                raise RequestError(f"logit_bias value {value} for token {tid} is outside [-100, 100]", "logit_bias")
            out[tid] = float(value)
        return out


UNSUPPORTED_FIELDS = ("functions", "function_call", "audio", "prediction", "web_search_options",
                      # vLLM's extensions tiller serve does not build (its others are fields above)
                      "guided_json", "guided_choice", "guided_grammar", "bad_words", "allowed_token_ids",
                      "prompt_logprobs", "truncate_prompt_tokens", "use_beam_search", "continue_final_message")
"""OpenAI (and vLLM extension) request fields tiller serve cannot honour: refused when set (they arrive as extra
fields; None, False and empty values are not set)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    """vLLM's extension: extra variables for the chat template (e.g. Qwen3's {"enable_thinking": false}), over the
    server's own."""

    def text_messages(self, parts: Callable[[list[dict], str], Any]) -> list[dict[str, Any]]:
        """Messages for the chat template, a list content turned into what `parts(content, where)` makes of it
        (the server's `tiller.serve.images.message_content`: text parts joined, image parts decoded); the
        `tool_calls`, `tool_call_id` and `name` fields are kept."""
        out = []
        for i, m in enumerate(self.messages):
            if m.role not in ("system", "user", "assistant", "tool", "developer"):
                raise RequestError(f"messages[{i}].role {m.role!r} is not one of system, user, assistant, tool",
                                   f"messages[{i}].role")
            content = m.content
            if isinstance(content, list):
                content = parts(content, f"messages[{i}].content")
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            for key in ("tool_calls", "tool_call_id", "name"):
                if (m.model_extra or {}).get(key) is not None:
                    msg[key] = m.model_extra[key]
            out.append(msg)
        return out


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def prompt_list(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            items: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [list(p)]
        else:
            items = list(p)
        if not items or any(len(x) == 0 for x in items):
            raise RequestError("prompt must be a non-empty string, list of strings or token ids", "prompt")
        return items
