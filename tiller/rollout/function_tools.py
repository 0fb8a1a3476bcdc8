"""verl's function tools: a Python file of `@function_tool` functions as the multi-turn loop's tools.

`actor_rollout_ref.rollout.multi_turn.function_tool_path` (and its data-level copy `data.function_tool_path`) names a
`.py` file; every function it decorates becomes a tool, next to the tools of `tool_config_path` (a name in both is an
error). A file written for verl runs unchanged without verl installed:

    from verl.tools.function_tool import function_tool   # or: from tiller.rollout.function_tools import function_tool

    @function_tool                                       # the tool's name is the function's
    def get_weather(city: str) -> dict:
        \"\"\"Get the current weather for a city.

        Args:
            city: The city to look up.
        \"\"\"
        return {"temperature_c": 17.3}

    @function_tool("lookup")                             # renamed; or schema={...} to give the schema yourself

As verl (`verl/tools/function_tool.py`):
- the schema is `transformers.utils.get_json_schema(fn)` (signature + Google docstring; a missing docstring, type
  hint or argument description is an error naming the function), cut to the fields verl's `OpenAIFunctionToolSchema`
  keeps (function name / description / parameters {type, properties {type, description, enum}, required}), so
  the chat template renders what verl's would; `*args` / `**kwargs` are refused;
- a call passes the model's arguments as keywords; `async def` functions are awaited;
- the return value: str -> the text, dict -> its JSON, `ToolResponse` -> its text, `(response, reward)` /
  `(response, reward, metrics)` -> the response and a tool reward (None -> 0.0 / {}); other tuples are an error,
  anything else is `str()`-ed; errors go back to the model as text (`Error: ...`), as for every tiller tool;
- no per-trajectory lifecycle (create / release), no `tools_kwargs`.

Tool rewards, as verl's reward managers: every call of an episode appends its reward (0.0 for tools without one
and for failed calls) to the episode's `tool_rewards`, handed to the reward function in `extra_info["tool_rewards"]`.

While tiller imports the file, `verl.tools.function_tool`, `verl.tools.schemas` and the other modules of
`verl_tool_imports` are tiller's stand-ins when verl is not installed (removed again afterwards); with verl
installed the file uses verl's own decorator and tiller reads verl's registry.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import sys
import types
from pathlib import Path
from typing import Any, Callable, Optional

from tiller.errors import ConfigError
from tiller.rollout import verl_tools
from tiller.rollout.verl_tools import ToolResponse, ToolResult
from tiller.stand_ins import installed, verl_installed

KEY = "actor_rollout_ref.rollout.multi_turn.function_tool_path"


# ----------------------------------------------------------------------------------------- schema
def _where(fn: Callable) -> str:
    code = getattr(fn, "__code__", None)
    place = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"@function_tool {getattr(fn, '__qualname__', fn)!r}{place}"


def verl_schema(raw: Any, where: str) -> dict:
    """`raw` (an OpenAI function-tool schema) as verl's `OpenAIFunctionToolSchema` validates and dumps it
    (exclude_unset, exclude_none): the fields verl keeps, a ConfigError naming `where` for a missing one."""
    if hasattr(raw, "model_dump"):  # an OpenAIFunctionToolSchema object (verl's, or the stand-in)
        raw = raw.model_dump(exclude_unset=True, exclude_none=True)
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(raw.get("type"), str):
        raise ConfigError(f"{where}: the schema must be {{'type': 'function', 'function': {{'name', 'description', "
                          f"'parameters'}}}}, got {raw!r:.200}")
    for name in ("name", "description"):
        if not isinstance(fn.get(name), str):
            raise ConfigError(f"{where}: the schema's function.{name} must be a string")
    out_fn: dict[str, Any] = {"name": fn["name"], "description": fn["description"]}
    if "parameters" in fn:
        params = fn["parameters"]
        if not isinstance(params, dict) or not isinstance(params.get("type"), str) or not isinstance(
                params.get("properties"), dict):
            raise ConfigError(f"{where}: the schema's function.parameters needs a 'type' and a 'properties' mapping")
        props = {}
        for arg, spec in params["properties"].items():
            if not isinstance(spec, dict) or not isinstance(spec.get("type"), (str, list)):
                raise ConfigError(f"{where}: parameter {arg!r} of the schema has no 'type'")
            props[arg] = {k: spec[k] for k in ("type", "description", "enum") if spec.get(k) is not None}
        out_params: dict[str, Any] = {"type": params["type"], "properties": props}
        if "required" in params:
            out_params["required"] = list(params["required"])
        out_fn["parameters"] = out_params
    if "strict" in fn:
        out_fn["strict"] = bool(fn["strict"])
    return {"type": raw["type"], "function": out_fn}


def infer_schema(fn: Callable, name: str) -> dict:
    """The OpenAI tool schema of `fn` named `name`: `transformers.utils.get_json_schema`, cut as verl's."""
    from transformers.utils import get_json_schema

    variadic = [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if variadic:
        raise ConfigError(f"{_where(fn)}: variadic parameter(s) {variadic} cannot be expressed in an OpenAI tool "
                          "schema; give explicit named parameters (e.g. items: list[int])")
    try:
        raw = get_json_schema(fn)
    except Exception as err:  # noqa: BLE001 - transformers' DocstringParsingException / TypeHintParsingException
        raise ConfigError(f"{_where(fn)}: cannot infer its schema: {err} (give it a Google-style docstring with an "
                          "Args: line per parameter and a type hint on every parameter, or pass schema=)") from None
    raw["function"]["name"] = name
    return verl_schema(raw, _where(fn))


# ------------------------------------------------------------------------------------- decorator
_REGISTERED: list["FunctionTool"] = []  # every tool the decorator made, in order (a load takes the new ones)


def function_tool(name: Optional[str | Callable] = None, *, schema: Optional[dict] = None):
    """Mark a function as a tool (verl's `@function_tool`): bare, `@function_tool("name")` or with `schema=`.

    The function itself is returned unchanged; its schema is inferred now, so a bad docstring fails at import.
    """

    def decorator(fn: Callable) -> Callable:
        tool_name = name if isinstance(name, str) else fn.__name__
        built = verl_schema(schema, _where(fn)) if schema is not None else infer_schema(fn, tool_name)
        _REGISTERED.append(FunctionTool(fn, tool_name, built))
        return fn

    if callable(name) and schema is None:
        return decorator(name)
    return decorator


# ------------------------------------------------------------------------------------------ calls
def _text(value: Any) -> str:
    if isinstance(value, ToolResponse) or _is_verl_tool_response(value):
        return verl_tools.response_text(value)
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _is_verl_tool_response(value: Any) -> bool:
    return type(value).__name__ == "ToolResponse" and type(value).__module__ == "verl.tools.schemas"


def normalize_return(value: Any) -> ToolResult:
    """A function tool's return value as verl's `normalize_function_tool_return` reads it (see the module docstring).

    >>> normalize_return(("done", 1))
    ToolResult(text='done', reward=1.0, metrics={})
    >>> normalize_return({"a": 1}).text
    '{"a": 1}'
    """
    if isinstance(value, tuple):
        if not 1 <= len(value) <= 3:
            raise TypeError(f"@function_tool return tuple must have length 1, 2, or 3 (got length {len(value)}: "
                            f"{value!r:.200}); use (response,), (response, reward) or (response, reward, metrics)")
        reward = 0.0 if len(value) < 2 or value[1] is None else float(value[1])
        metrics = {} if len(value) < 3 or value[2] is None else dict(value[2])
        return ToolResult(_text(value[0]), reward, metrics)
    return ToolResult(_text(value))


class FunctionTool:
    """A `@function_tool` function as a tiller tool (`tiller.rollout.tools.Tool`, plus `run` with its reward)."""

    def __init__(self, fn: Callable, name: str, schema: dict):
        self.fn, self.name, self.schema = fn, name, schema
        self.is_async = inspect.iscoroutinefunction(fn)

    def run(self, arguments: dict) -> ToolResult:
        value = self.fn(**arguments)
        if inspect.isawaitable(value):  # (async functions: awaited on the process's tool event loop)
            value = verl_tools.TOOL_LOOP.run(value)
        return normalize_return(value)

    async def acall(self, arguments: dict, tools_kwargs: dict | None = None, agent_data: Any = None) -> ToolResult:
        """`run` awaited (the agent loop gathers the async tools' calls; function tools take no tools_kwargs)."""
        value = self.fn(**arguments)
        return normalize_return(await value if inspect.isawaitable(value) else value)

    def __call__(self, arguments: dict) -> str:
        return self.run(arguments).text

    def __repr__(self) -> str:
        return f"FunctionTool({self.name!r})"


# ---------------------------------------------------------------------------------------- loading
def _stand_ins() -> dict[str, types.ModuleType]:
    """verl's tool-facing modules as tiller's stand-ins, by name (see `verl_tool_imports`)."""
    from tiller.rewards import registry  # import cost: the scorer registry, only while a verl tool file imports
    from tiller.rewards.scorers import gsm8k  # import cost: as above

    modules = {n: types.ModuleType(n) for n in ("verl", "verl.tools", "verl.tools.function_tool", "verl.utils",
                                                  "verl.utils.reward_score")}
    modules.update(verl_tools.stand_in_modules())
    modules["verl.utils.reward_score.gsm8k"] = gsm8k
    for name, module in modules.items():
        if name in ("verl", "verl.tools", "verl.utils", "verl.utils.reward_score"):
            module.__path__ = []
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    function_tool_mod = modules["verl.tools.function_tool"]
    function_tool_mod.function_tool, function_tool_mod.ToolResponse = function_tool, ToolResponse
    function_tool_mod.FunctionTool = FunctionTool
    modules["verl.utils.reward_score"].default_compute_score = registry.default_compute_score
    return modules


@contextlib.contextmanager
def verl_tool_imports(extra: dict[str, types.ModuleType] | None = None):
    """While importing a tool file (`@function_tool` functions, verl `BaseTool` classes): verl's
    `verl.tools.function_tool`, `verl.tools.schemas`, `verl.tools.base_tool`, `verl.utils.rollout_trace` and
    `verl.utils.reward_score` (`default_compute_score`, `gsm8k`) are tiller's stand-ins unless verl is installed (a
    real verl is never shadowed), removed again afterwards. `extra`: more stand-in modules by name (an agent loop
    file's: `tiller.rollout.verl_agent_loop.stand_in_modules`)."""
    if verl_installed():
        yield
        return
    with installed({**_stand_ins(), **(extra or {})}):
        yield


def _verl_registry() -> dict | None:
    module = sys.modules.get("verl.tools.function_tool")
    registry = getattr(module, "FUNCTION_TOOL_REGISTRY", None)
    return registry if isinstance(registry, dict) else None


def load_function_tools(path: str | Path, key: str = KEY) -> dict[str, FunctionTool]:
    """The `@function_tool` functions of the `.py` file at `path`, by name; ConfigError naming `key` and the file
    when it is missing, not a .py file, fails to import, or decorates no function (or two with one name)."""
    p = Path(path).expanduser()
    if p.suffix != ".py":
        raise ConfigError(f"{key}={path}: not a Python file (.py) of @function_tool functions")
    if not p.is_file():
        raise ConfigError(f"{key}={path}: file not found")
    p = p.resolve()
    module_name = "tiller_function_tools_" + str(p).replace("/", "_").replace(".", "_").replace("-", "_")
    first = len(_REGISTERED)
    verl_before = dict(_verl_registry() or {})
    try:
        with verl_tool_imports():
            spec = importlib.util.spec_from_file_location(module_name, p)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # (verl's loader too: the file's own imports can find it)
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(module_name, None)
                raise
    except ConfigError as err:
        raise ConfigError(f"{key}={path}: {err}") from None
    except (Exception, SystemExit) as err:  # noqa: BLE001 - the user's file failed to import (or exited)
        raise ConfigError(f"{key}={path}: cannot import it: {type(err).__name__}: {err}") from None
    found = list(_REGISTERED[first:])
    del _REGISTERED[first:]  # each load takes its own; a second load of the file makes them anew
    for name, entry in (_verl_registry() or {}).items():  # a real verl's decorator registered them
        if verl_before.get(name) is not entry:
            found.append(FunctionTool(entry.fn, name, verl_schema(entry.tool_schema, f"{key}={path}: {name}")))
    if not found:
        raise ConfigError(f"{key}={path}: no @function_tool function in the file (decorate each tool function "
                          "with @function_tool from verl.tools.function_tool or tiller.rollout.function_tools)")
    tools: dict[str, FunctionTool] = {}
    for tool in found:
        if tool.name in tools:
            raise ConfigError(f"{key}={path}: two @function_tool functions are named {tool.name!r}; rename one")
        tools[tool.name] = tool
    return tools
