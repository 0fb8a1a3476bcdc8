"""verl's tool classes: `BaseTool` subclasses (create / execute / release) as tools of tiller's multi-turn loop.

A tool config entry `class_name: my_pkg.tools.MyTool` whose class subclasses verl's `BaseTool` runs as verl's tool
agent loop runs it (`verl/experimental/agent_loop/tool_agent_loop.py`, verl-project/verl 1dda039b), verl not
installed:

    from verl.tools.base_tool import BaseTool                  # tiller's stand-ins while the module imports
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

    class MyTool(BaseTool):
        async def create(self, instance_id=None, **kwargs):      # kwargs["create_kwargs"]: the sample's
            ...                                                  #   extra_info.tools_kwargs[<tool name>].create_kwargs
        async def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(text="..."), reward, {}
        async def release(self, instance_id, **kwargs): ...

As verl's loop:
- the class is built as `MyTool(config=<the entry's config, `type` included>, tool_schema=OpenAIFunctionToolSchema
  | None)` (pydantic models with verl's fields: `self.tool_schema.function.name` works);
- every call is one instance: `create(create_kwargs=tools_kwargs[name].get("create_kwargs", {}))`, then
  `execute(instance_id, arguments, agent_data=...)`, then `release(instance_id)` (also after a failure);
  `calc_reward` is not called (verl's loop does not either); the sample's `tools_kwargs` come from its
  `extra_info.tools_kwargs` (verl's RLHFDataset; its gsm8k multi-turn preprocessing writes them);
- `execute`'s reward goes to the sample's `tool_rewards` (the reward function's `extra_info["tool_rewards"]`); its
  metrics are dropped; a raised error comes back to the model as `Error: ...` text with reward 0.0;
- the calls of one turn run concurrently, across all the samples of the batch (verl's loop runs every sample's
  calls concurrently too), on one event loop that lives as long as the process (a tool may keep an HTTP session).

`agent_data` (verl's `AgentData`) is a small object with the sample's `request_id`, `tools_kwargs`, `extra_info`,
the `tool_rewards` so far and a `metrics` dict; it has no `messages` (tiller's loop works on token ids).

`verl.tools.gsm8k_tool.Gsm8kTool` (verl <= 0.7's gsm8k multi-turn example, removed from verl in 2026-05) is
tiller's `Gsm8kTool`: same schema, state, scoring (gsm8k `flexible`) and -0.05 penalty for an answer that does not
improve the score, and it takes verl's `create_kwargs` (`ground_truth`); `verl.tools.geo3k_tool.Geo3kTool` likewise
(`Geo3kTool`: the answer graded by math-verify). `verl.tools.search_tool.SearchTool` (its
Search-R1-like example, removed with it) is tiller's `SearchTool`, against any server with Search-R1's retrieval
API (`tiller retrieval-server`).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional
from uuid import uuid4

from pydantic import BaseModel, Field, model_validator


@dataclass
class ToolResult:
    """One call's outcome: the text shown to the model, the tool reward and the tool's metrics."""

    text: str
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------ verl.tools.schemas
class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter (verl's model: type, description, enum)."""

    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(
        default_factory=lambda: OpenAIFunctionParametersSchema(type="object", properties={}, required=[]))
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """A tool's OpenAI function schema (verl's `verl.tools.schemas.OpenAIFunctionToolSchema`)."""

    type: str
    function: OpenAIFunctionSchema


class ToolResponse(BaseModel):
    """A tool's response (verl's `verl.tools.schemas.ToolResponse`; tiller's tool loop takes its text)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, values):
        for name in ("image", "video"):
            if isinstance(values, dict) and name in values and not isinstance(values[name], list):
                raise ValueError(f"{name} must be a list, got {type(values[name]).__name__}; wrap one in a list")
        return values

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video


# ---------------------------------------------------------------------------- verl.tools.base_tool
class BaseTool:
    """verl's `verl.tools.base_tool.BaseTool`: subclass it and override the async methods."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"{type(self).__name__}: no tool schema (give `tool_schema` in the tool config)")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        return (instance_id if instance_id is not None else str(uuid4())), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None


def rollout_trace_op(fn: Callable) -> Callable:
    """verl's `verl.utils.rollout_trace.rollout_trace_op` (tracing to weave / mlflow): here the function itself."""
    return fn


def is_verl_base_tool(cls: Any) -> bool:
    """Whether `cls` subclasses verl's `BaseTool` (tiller's stand-in, or verl's own where verl is installed)."""
    return isinstance(cls, type) and any(
        base.__name__ == "BaseTool" and base.__module__ in ("verl.tools.base_tool", __name__) for base in cls.__mro__)


# ------------------------------------------------------------------------------- the event loop
class _ToolEventLoop:
    """One asyncio loop in a daemon thread per process: every async tool call of a run is awaited there (a tool's
    HTTP session or lock stays bound to one loop, as in verl's agent-loop worker)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = -1

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid() or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="tiller-tools", daemon=True).start()
                self._loop, self._pid = loop, os.getpid()
            return self._loop

    def run(self, coro: Awaitable) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop()).result()

    def gather(self, coros: list[Awaitable]) -> list[Any]:
        """Each coroutine's result (or the exception it raised), run concurrently."""
        async def _all():
            return await asyncio.gather(*coros, return_exceptions=True)
        return self.run(_all()) if coros else []


TOOL_LOOP = _ToolEventLoop()


# --------------------------------------------------------------------------------- the adapter
@dataclass
class AgentData:
    """What a verl tool's `execute(..., agent_data=...)` can read of its sample (see the module docstring)."""

    request_id: str
    tools_kwargs: dict = field(default_factory=dict)
    extra_info: dict = field(default_factory=dict)
    tool_rewards: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)


def response_text(value: Any) -> str:
    """The text of a tool's `ToolResponse` (verl's or tiller's); images / videos are an error (text-only loop)."""
    if getattr(value, "image", None) or getattr(value, "video", None):
        raise TypeError("the tool returned images / videos; tiller's tool loop takes text only")
    return getattr(value, "text", None) or ""


class VerlTool:
    """A verl `BaseTool` instance as a tiller tool: `name`, `schema` (the dict the chat template renders),
    `acall(arguments, tools_kwargs, agent_data)` (create / execute / release, see the module docstring) and the
    synchronous `run` / `__call__` of every tiller tool."""

    is_async = True

    def __init__(self, tool: Any):
        self.tool, self.name = tool, str(tool.name)
        schema = tool.tool_schema
        self.schema = schema.model_dump(exclude_unset=True, exclude_none=True) if hasattr(
            schema, "model_dump") else dict(schema)

    async def acall(self, arguments: dict, tools_kwargs: dict | None = None,
                    agent_data: AgentData | None = None) -> ToolResult:
        kwargs = (tools_kwargs or {}).get(self.name) or {}
        instance_id = None
        try:
            instance_id, _ = await self.tool.create(create_kwargs=kwargs.get("create_kwargs") or {})
            response, reward, metrics = await self.tool.execute(
                instance_id, arguments, agent_data=agent_data or AgentData(uuid4().hex, dict(tools_kwargs or {})))
        finally:
            if instance_id:
                await self.tool.release(instance_id)
        return ToolResult(response_text(response), 0.0 if reward is None else float(reward), dict(metrics or {}))

    def run(self, arguments: dict, tools_kwargs: dict | None = None, agent_data: AgentData | None = None) -> ToolResult:
        return TOOL_LOOP.run(self.acall(arguments, tools_kwargs, agent_data))

    def __call__(self, arguments: dict) -> str:
        return self.run(arguments).text

    def __repr__(self) -> str:
        return f"VerlTool({type(self.tool).__name__}, {self.name!r})"


def build_verl_tool(cls: type, config: dict, tool_schema: dict | None) -> VerlTool:
    """`cls(config=..., tool_schema=OpenAIFunctionToolSchema | None)` as verl's `initialize_tools_from_config`
    builds it (the schema validated by the schema model of `cls`'s own verl, real or stand-in)."""
    schema_model = _schema_model_for(cls)
    schema = schema_model.model_validate(tool_schema) if tool_schema is not None else None
    return VerlTool(cls(config=config, tool_schema=schema))


def _schema_model_for(cls: type) -> type:
    for base in cls.__mro__:
        if base.__name__ == "BaseTool" and base.__module__ == "verl.tools.base_tool":
            import importlib  # import cost: only when verl itself is installed and the class is its BaseTool's
            return importlib.import_module("verl.tools.schemas").OpenAIFunctionToolSchema
    return OpenAIFunctionToolSchema


# ---------------------------------------------------------------------------------- built-ins
def answer_schema(name: str, task: str, answer: str) -> OpenAIFunctionToolSchema:
    """The default schema of verl's reward tools: one string argument `answer`."""
    return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
        "name": name, "description": f"A tool for calculating the reward of {task}",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string", "description": answer}},
                       "required": ["answer"]}}})


class Gsm8kTool(BaseTool):
    """verl's `verl.tools.gsm8k_tool.Gsm8kTool`: the model submits `answer`; the reply states the parsed answer and
    its gsm8k score (flexible), the tool reward is 0.0 when the score improved on the instance's last, else -0.05."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        super().__init__(config, tool_schema or answer_schema("calc_gsm8k_reward", "gsm8k", "The answer to the question"))
        self._instances: dict[str, dict] = {}

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                     **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id if instance_id is not None else str(uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self._instances[instance_id]
        state["response"] = self.graded(answer)
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > state["reward"] else -0.05  # (verl: a penalty for a non-improved answer)
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    @staticmethod
    def graded(answer: str) -> str:
        """The text the scorer reads: gsm8k's `#### <answer>` line."""
        return answer if answer.startswith("#### ") else "#### " + answer

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        from tiller.rewards.scorers import gsm8k  # import cost: the rewards package, only when the tool scores

        state = self._instances[instance_id]
        return gsm8k.compute_score(state["response"], state["ground_truth"], method="flexible", format_score=0.0,
                                   score=1.0)

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


class Geo3kTool(Gsm8kTool):
    """verl's `verl.tools.geo3k_tool.Geo3kTool` (its geo3k multi-turn example): the model submits `answer`, graded
    as verl's geo3k scorer with use_boxed=False (the answer text itself against the ground truth; math-verify here,
    mathruler in verl); reply and -0.05 penalty as `Gsm8kTool`. verl's version reads `ground_truth` only as a
    keyword of `create`, so under verl's current loop (which passes `create_kwargs`) it grades against None; this one
    reads `create_kwargs` too."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        super().__init__(config, tool_schema or answer_schema(
            "calc_geo3k_reward", "geo3k", "The answer to the question, enclosed in \\boxed{}"))

    @staticmethod
    def graded(answer: str) -> str:
        """The text the scorer reads: the answer itself (verl's use_boxed=False)."""
        return answer

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        from tiller.rewards.scorers import math as math_scorer  # import cost: math-verify, only when the tool scores

        state = self._instances[instance_id]
        return math_scorer.answer_score(state["response"], str(state["ground_truth"]))


class SearchTool(BaseTool):
    """verl's `verl.tools.search_tool.SearchTool` (its Search-R1-like example; removed from verl in 2026-05): the
    model's `query_list` goes to a retrieval server (`config.retrieval_service_url`, Search-R1's `/retrieve` API:
    POST {"queries", "topk", "return_scores": true} -> {"result": [[{"document": {"contents": "title\\ntext"},
    "score"}, ...], ...]}, e.g. `tiller retrieval-server`), and the reply is verl's text: JSON {"result": "Doc 1
    (Title: ...)\\n...\\n---\\n..."}, one block of `topk` passages per query. Tool reward 0.0, as verl.

    config as verl's: `retrieval_service_url` (required), `topk` (3), `timeout` (30 s), `num_workers` (120) and
    `rate_limit` (120, with `enable_global_rate_limit`: true): at most that many requests in flight (per process
    here; verl's limit is one Ray actor for the cluster). Retries as verl: up to `max_retries` attempts (10; a tiller
    key) on a 5xx reply, a connection error or a timeout, waiting 1, 2, ... s; another error ends at once. A failed
    search is the reply `{"result": "Search error: ..."}`, not an exception (as verl)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        super().__init__(config, tool_schema)
        self.url = config.get("retrieval_service_url")
        if not self.url:
            raise ValueError("config.retrieval_service_url is not set (the retrieval server's /retrieve URL)")
        self.topk, self.timeout = int(config.get("topk", 3)), float(config.get("timeout", 30))
        self.max_retries = int(config.get("max_retries", 10))
        limit = int(config.get("num_workers", 120))
        if config.get("enable_global_rate_limit", True):
            limit = min(limit, int(config.get("rate_limit", 120)))
        if self.topk < 1 or self.max_retries < 1 or limit < 1:
            raise ValueError(f"topk, max_retries, num_workers and rate_limit must be >= 1 (topk={self.topk}, "
                             f"max_retries={self.max_retries}, concurrency {limit})")
        self.limit = limit
        self._client = self._semaphore = None  # made on the tool event loop, on first use

    async def _post(self, queries: list[str]) -> tuple[dict | None, str | None]:
        import httpx  # import cost: the HTTP client, only when a search runs

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout)
            self._semaphore = asyncio.Semaphore(self.limit)
        payload = {"queries": queries, "topk": self.topk, "return_scores": True}
        error = None
        for attempt in range(self.max_retries):
            retry = True
            try:
                async with self._semaphore:
                    response = await self._client.post(self.url, json=payload)
                if response.status_code in (500, 502, 503, 504):
                    error = f"Server Error ({response.status_code}) on attempt {attempt + 1}/{self.max_retries}"
                else:
                    response.raise_for_status()
                    return response.json(), None
            except (httpx.ConnectError, httpx.TimeoutException, httpx.RemoteProtocolError) as err:
                error = f"{type(err).__name__}: {err}"
            except (httpx.HTTPError, ValueError) as err:  # another HTTP status, a body that is not JSON
                error, retry = f"{type(err).__name__}: {err}", False
            if not retry:
                break
            if attempt < self.max_retries - 1:
                await asyncio.sleep(attempt + 1)
        return None, f"API Call Failed: {error}"

    @staticmethod
    def passages(results: list) -> str:
        """verl's `_passages2string`: `Doc i (Title: <first line>)\\n<the rest>` per passage."""
        blocks = []
        for i, item in enumerate(results):
            lines = item["document"]["contents"].split("\n")
            blocks.append(f"Doc {i + 1} (Title: {lines[0]})\n" + "\n".join(lines[1:]) + "\n\n")
        return "".join(blocks).strip()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        queries = parameters.get("query_list")
        if not queries or not isinstance(queries, list):
            message = "Error: 'query_list' is missing, empty, or not a list in parameters."
            return ToolResponse(text=json.dumps({"result": message})), 0.0, {}
        response, error = await self._post([str(q) for q in queries])
        if error:
            text = f"Search error: {error}"
        else:
            try:
                results = response.get("result", [])
                text = "\n---\n".join(self.passages(r) for r in results) if results else "No search results found."
            except (AttributeError, KeyError, TypeError) as err:
                text = f"Error processing search results: {err}"
        return ToolResponse(text=json.dumps({"result": text}, ensure_ascii=False)), 0.0, {}


def stand_in_modules() -> dict[str, types.ModuleType]:
    """The modules `verl.tools.base_tool`, `verl.tools.schemas`, `verl.utils.rollout_trace` (tiller's stand-ins)
    by name, for the import shim of `tiller.rollout.function_tools.verl_tool_imports`."""
    base_tool, schemas, trace = (types.ModuleType(n) for n in (
        "verl.tools.base_tool", "verl.tools.schemas", "verl.utils.rollout_trace"))
    base_tool.BaseTool, base_tool.OpenAIFunctionToolSchema, base_tool.ToolResponse = (
        BaseTool, OpenAIFunctionToolSchema, ToolResponse)
    base_tool.rollout_trace_op = rollout_trace_op
    for model in (OpenAIFunctionPropertySchema, OpenAIFunctionParametersSchema, OpenAIFunctionSchema,
                  OpenAIFunctionToolSchema, ToolResponse):
        setattr(schemas, model.__name__, model)
    trace.rollout_trace_op = rollout_trace_op
    return {"verl.tools.base_tool": base_tool, "verl.tools.schemas": schemas, "verl.utils.rollout_trace": trace}

