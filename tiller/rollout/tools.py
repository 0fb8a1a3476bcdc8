"""Tools a model can call during a multi-turn rollout, and the tool-config YAML that lists them.

A tool is any object with `name: str`, `schema: dict` (OpenAI function schema, which chat templates such as
Qwen2.5's render into the system prompt via `apply_chat_template(..., tools=[...])`) and
`__call__(arguments: dict) -> str`. Tool errors are returned to the model as text, never raised.

Built-ins:
- `calculator`: `{"expression": "3 * (4 + 5) / 2"}` evaluated by walking the `ast` (numbers, + - * / // % **,
  unary +/-, and sqrt, abs, round, min, max, floor, ceil, log, exp, sin, cos, pi, e); no `eval`, size limits
  on exponents and results.
- `python`: `{"code": "print(2**10)"}` run in the rewards sandbox (`tiller.rewards.sandbox`: own process
  group, rlimits, no network); returns stdout (and stderr on failure).
- `class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool` (verl's retool recipe): `{"code": ...}` run on a
  SandboxFusion server (`SandboxFusionTool`, config `sandbox_fusion_url`, ...).
- `class_name: verl.tools.gsm8k_tool.Gsm8kTool` / `verl.tools.geo3k_tool.Geo3kTool` (verl's gsm8k and geo3k
  multi-turn examples) and `verl.tools.search_tool.SearchTool` (its Search-R1-like example): `tiller.rollout.verl_tools`.

The YAML (`actor_rollout_ref.rollout.multi_turn.tool_config_path`; verl's layout with `class_name`,
`config`, `tool_schema`, plus two shorter forms):

    tools:
      - name: calculator                          # a built-in
      - name: python
        config: {timeout_s: 5}
      - function: my_pkg.tools:lookup             # a function(**arguments) -> str
        tool_schema: {type: function, function: {name: lookup, description: ..., parameters: {...}}}
      - class_name: my_pkg.tools.Search           # Search(config=dict, tool_schema=dict), then called with arguments
        config: {...}
        tool_schema: {...}
      - class_name: my_pkg.tools.MyVerlTool       # a subclass of verl's BaseTool: run as verl runs it (create /
        config: {type: native}                    #   execute / release per call, the sample's tools_kwargs),
        tool_schema: {...}                        #   `tiller.rollout.verl_tools`
"""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import operator
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from tiller.errors import ConfigError, UserError
from tiller.rewards import sandbox_fusion
from tiller.rewards.sandbox import run_program, SandboxLimits
from tiller.rollout.function_tools import verl_tool_imports
from tiller.rollout.verl_tools import build_verl_tool, Geo3kTool, Gsm8kTool, is_verl_base_tool, SearchTool


@runtime_checkable
class Tool(Protocol):
    name: str
    schema: dict

    def __call__(self, arguments: dict) -> str: ...


def function_schema(name: str, description: str, properties: dict[str, dict], required: Sequence[str]) -> dict:
    """An OpenAI function-tool schema."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(required)}}}


# ------------------------------------------------------------------------------------- calculator
_BINOPS: dict[type, Callable] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                 ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
                                 ast.Pow: operator.pow}
_UNARY: dict[type, Callable] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS: dict[str, Callable] = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max,
                               "floor": math.floor, "ceil": math.ceil, "log": math.log, "exp": math.exp,
                               "sin": math.sin, "cos": math.cos}
_NAMES = {"pi": math.pi, "e": math.e}
MAX_EXPRESSION_CHARS = 500
MAX_RESULT = 1e100


def _check_size(value: float | int) -> float | int:
    if isinstance(value, complex):
        raise ValueError("the result is a complex number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not finite")
    if abs(value) > MAX_RESULT:
        raise ValueError("result too large")
    return value


def _eval_node(node: ast.AST, depth: int = 0) -> float | int:
    if depth > 50:
        raise ValueError("expression nested too deeply")
    if isinstance(node, ast.Expression):
        return _eval_node(node.body, depth + 1)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval_node(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval_node(node.left, depth + 1), _eval_node(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            if abs(right) > 1000 or (abs(left) > 1 and abs(right) * math.log10(abs(left)) > 100):
                raise ValueError("power too large")
        return _check_size(_BINOPS[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ValueError("'^' is not a power here; use **")
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
            and not node.keywords):
        args = [_eval_node(a, depth + 1) for a in node.args]
        return _check_size(_FUNCS[node.func.id](*args))
    raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")


def safe_eval(expression: str) -> float | int:
    """Evaluate an arithmetic expression without `eval` (raises ValueError / ZeroDivisionError).

    >>> safe_eval("3 * (4 + 5) / 2")
    13.5
    >>> safe_eval("2 ** 10 - sqrt(16)")
    1020.0
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"invalid expression: {err.msg}") from None
    return _eval_node(tree)


def format_number(value: float | int) -> str:
    """Integers as integers, floats with 12 significant digits: 13.5 -> '13.5', 1020.0 -> '1020'."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g") if isinstance(value, float) else str(value)


class CalculatorTool:
    """Built-in `calculator`: arithmetic on numbers, evaluated safely."""

    name = "calculator"

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        self.schema = tool_schema or function_schema(
            "calculator", "Evaluate an arithmetic expression, e.g. '3 * (4 + 5) / 2'.",
            {"expression": {"type": "string", "description": "the expression"}}, ["expression"])

    def __call__(self, arguments: dict) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return "Error: calculator needs a string argument 'expression'"
        try:
            return format_number(safe_eval(expression))
        except (ValueError, ZeroDivisionError, OverflowError, TypeError) as err:
            return f"Error: {err}"


class PythonTool:
    """Built-in `python`: runs code in the rewards sandbox, returns its stdout (stderr too on failure)."""

    name = "python"

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        config = dict(config or {})
        timeout = float(config.pop("timeout_s", 5.0))
        self.max_output_chars = int(config.pop("max_output_chars", 2000))
        if config:
            raise ConfigError(f"python tool: unknown config keys {sorted(config)}; valid: timeout_s, max_output_chars")
        self.limits = SandboxLimits(cpu_time_s=max(1, int(math.ceil(timeout))), wall_time_s=timeout * 2)
        self.schema = tool_schema or function_schema(
            "python", "Run a Python program and return what it prints.",
            {"code": {"type": "string", "description": "Python source; print the result"}}, ["code"])

    def __call__(self, arguments: dict) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            return "Error: python needs a string argument 'code'"
        result = run_program(code, limits=self.limits)
        text = result.stdout if result.ok else f"{result.stdout}{result.stderr}\n[{result.status}]"
        return text.strip()[: self.max_output_chars]


class SandboxFusionTool:
    """verl's `verl.tools.sandbox_fusion_tools.SandboxFusionTool` (its retool recipe): the `code` argument runs on a
    SandboxFusion `/run_code` server (`tiller.rewards.sandbox_fusion.run_code`, no stdin, compile and run limits of
    `timeout` s); the answer is stdout + stderr when the program ran to its end (any exit code), else
    "no stdout here" (time limit, compile error, server failure), as verl.

    config: `sandbox_fusion_url` (required), `memory_limit_mb` (1024), `default_timeout` (30 s), `default_language`
    (python); a call may pass `timeout` and `language`. verl's `num_workers` / `rate_limit` / `enable_global_rate_limit`
    bound how many runs are in flight; tiller's tool loop runs one call at a time, inside those bounds.
    """

    CONFIG = {"sandbox_fusion_url": "", "memory_limit_mb": 1024, "default_timeout": 30, "default_language": "python",
              "num_workers": 10, "rate_limit": 10, "enable_global_rate_limit": True}

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        config = dict(config or {})
        unknown = sorted(set(config) - set(self.CONFIG))
        if unknown:
            raise ConfigError(f"SandboxFusionTool: unknown config keys {unknown}; valid: {', '.join(self.CONFIG)}")
        settings = {**self.CONFIG, **config}
        self.url = settings["sandbox_fusion_url"]
        if not self.url:
            raise ConfigError("SandboxFusionTool: config.sandbox_fusion_url is not set (http://HOST:PORT/run_code)")
        self.memory_limit_mb = int(settings["memory_limit_mb"])
        self.timeout, self.language = settings["default_timeout"], settings["default_language"]
        try:
            sandbox_fusion.check_server(self.url, self.memory_limit_mb, key="config.sandbox_fusion_url")
        except UserError as err:
            raise ConfigError(f"SandboxFusionTool: {err}") from None
        self.schema = tool_schema or function_schema(
            "code_interpreter", "A tool for executing code.",
            {"code": {"type": "string", "description": "The code to execute."}}, ["code"])
        self.name = self.schema["function"]["name"]

    def __call__(self, arguments: dict) -> str:
        code = arguments.get("code", "")
        response, _ = sandbox_fusion.run_code(
            self.url, code if isinstance(code, str) else str(code), None,
            compile_timeout=arguments.get("timeout", self.timeout), run_timeout=arguments.get("timeout", self.timeout),
            memory_limit_mb=self.memory_limit_mb, language=arguments.get("language", self.language))
        ran = (response or {}).get("run_result") or {}
        if ran.get("status") == "Finished":
            return (ran.get("stdout") or "") + (ran.get("stderr") or "")
        return "no stdout here"


class FunctionTool:
    """A user function `fn(**arguments) -> str` (other return values are turned into text)."""

    def __init__(self, fn: Callable[..., Any], schema: dict | None = None, name: str | None = None):
        self.fn = fn
        self.name = name or (schema or {}).get("function", {}).get("name") or fn.__name__
        self.schema = schema or function_schema(self.name, (fn.__doc__ or "").strip().split("\n")[0],
                                                {p: {"type": "string"} for p in inspect.signature(fn).parameters},
                                                list(inspect.signature(fn).parameters))

    def __call__(self, arguments: dict) -> str:
        try:
            value = self.fn(**arguments)
        except Exception as err:  # noqa: BLE001 - a tool failure is shown to the model
            return f"Error: {type(err).__name__}: {err}"
        return value if isinstance(value, str) else str(value)


BUILTIN_TOOLS: dict[str, type] = {"calculator": CalculatorTool, "python": PythonTool}
# verl's tool classes tiller carries its own version of (a verl tool config names them as they are)
VERL_TOOL_CLASSES: dict[str, type] = {"verl.tools.sandbox_fusion_tools.SandboxFusionTool": SandboxFusionTool,
                                      "verl.tools.gsm8k_tool.Gsm8kTool": Gsm8kTool,
                                      "verl.tools.geo3k_tool.Geo3kTool": Geo3kTool,
                                      "verl.tools.search_tool.SearchTool": SearchTool}


def _import(ref: str, where: str) -> Any:
    module_name, _, attr = ref.partition(":") if ":" in ref else ref.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{where}: {ref!r} must be 'module:name' or 'module.name'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{where}: cannot import {ref!r}: {err}") from None


def build_tool(entry: dict, where: str) -> Tool:
    """One tool from a YAML entry (see the module docstring)."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: a tool entry must be a mapping, got {type(entry).__name__}")
    unknown = set(entry) - {"name", "config", "tool_schema", "function", "class_name"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; valid: name, config, tool_schema, function, "
                          "class_name")
    config, schema = dict(entry.get("config") or {}), entry.get("tool_schema")
    verl_config = dict(config)  # (a verl BaseTool gets its config as verl gives it, `type` included)
    config.pop("type", None)  # verl's `config: {type: native}`
    if "class_name" in entry:
        ref = str(entry["class_name"])
        with verl_tool_imports():  # (a module written for verl imports verl.tools.base_tool / schemas)
            cls = VERL_TOOL_CLASSES.get(ref) or _import(ref, where)
        if is_verl_base_tool(cls):
            if verl_config.get("type", "native") != "native":
                raise ConfigError(f"{where}: config.type={verl_config['type']!r}: verl's only tool type is 'native'")
            try:
                tool = build_verl_tool(cls, verl_config, schema)
            except Exception as err:  # noqa: BLE001 - a bad schema (pydantic) or the user's constructor failing
                raise ConfigError(f"{where}: cannot build {ref}: {type(err).__name__}: {err}") from None
            return tool
        try:
            tool = cls(config=config, tool_schema=schema)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
    elif "function" in entry:
        tool = FunctionTool(_import(str(entry["function"]), where), schema, entry.get("name"))
    elif entry.get("name") in BUILTIN_TOOLS:
        tool = BUILTIN_TOOLS[entry["name"]](config=config, tool_schema=schema)
    else:
        raise ConfigError(f"{where}: give a built-in name ({', '.join(BUILTIN_TOOLS)}), `function` or `class_name`")
    if not callable(tool) or not isinstance(getattr(tool, "name", None), str):
        raise ConfigError(f"{where}: the tool must be callable with a `name` attribute")
    if getattr(tool, "schema", None) is None:
        tool.schema = schema or function_schema(tool.name, "", {}, [])
    return tool


def load_tools(path: str | Path) -> dict[str, Tool]:
    """Tools by name from a tool-config YAML; ConfigError naming the file and entry on any problem."""
    import yaml

    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"actor_rollout_ref.rollout.multi_turn.tool_config_path: file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: invalid YAML: {err}") from None
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{p}: expected a top-level `tools:` list with at least one entry")
    tools: dict[str, Tool] = {}
    for i, entry in enumerate(entries):
        tool = build_tool(entry, f"{p} tools[{i}]")
        if tool.name in tools:
            raise ConfigError(f"{p} tools[{i}]: duplicate tool name {tool.name!r}")
        tools[tool.name] = tool
    return tools
