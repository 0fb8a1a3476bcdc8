"""verl's custom agent loops (`actor_rollout_ref.rollout.agent.agent_loop_config_path`) on tiller's rollout engines.

A verl agent loop is an `AgentLoopBase` subclass whose `async run(sampling_params, **row) -> AgentLoopOutput` drives
the policy through `self.server_manager.generate(request_id, prompt_ids=..., sampling_params=...) -> TokenOutput`
(token ids in, token ids and log-probs out) and returns one trajectory: prompt ids, response ids, a response mask
(1 on the policy's tokens, 0 on tool / observation tokens) and the response log-probs. tiller runs it as verl does:

- the YAML at `agent_loop_config_path` lists loops, `- name: my_agent` / `_target_: pkg.module.Class` plus keyword
  arguments for the constructor (verl's hydra `instantiate`); `_target_` is a dotted path importable from the working
  directory, or `path/to/file.py:Class`; classes decorated with `@register("name")` in an imported module register
  too. Each row's `agent_name` column (else `agent.default_agent_loop`) picks its loop; `single_turn_agent` and
  `tool_agent` stay tiller's own loops (`tool_agent` with `multi_turn.enable`);
- one instance per sample (prompt x n), constructed with verl's arguments (`trainer_config` / `data_config` wrapping
  the run's config, `server_manager`, `tokenizer`, `processor`, `dataset_cls` None, `tools`), `run` called with
  verl's sampling parameters (`temperature` - 0 when greedy -, `top_p`, `top_k`, `repetition_penalty`, `logprobs`)
  and the row's fields (`raw_prompt`, `data_source`, `reward_model`, `extra_info`, `index`, `tools_kwargs`,
  `agent_name`, `uid`); every sample's coroutine runs concurrently on one event loop (the native engine batches
  their requests together: `tiller.rollout.continuous`);
- `server_manager.generate`: `max_tokens` from the sampling parameters, else verl's default min(response_length,
  prompt_length + response_length - len(prompt_ids)), clamped to the model's context; `temperature`, `top_p`,
  `top_k` and vLLM's penalties (`repetition_penalty`, `presence_penalty`, `frequency_penalty`) from the sampling
  parameters over the rollout's; log-probs are always returned; each call of a sample is seeded (the step's seed,
  the sample, the call);
- the output: prompt ids as returned, response ids / mask / log-probs cut to the response length (as verl pads
  them); `response_logprobs` is required (tiller trains with the rollout's log-probs: pass `TokenOutput.log_probs`
  through, as verl's own loops do); `reward_score`, when set, is the sample's reward in place of the reward function
  (verl: "some agent loops compute the reward themselves"); `extra_fields["tool_rewards"]` reach the reward
  function as `extra_info["tool_rewards"]`; `num_turns` is logged (`agent/turns/mean`).

The `AgentLoopBase` helpers verl's loops use are here for text models: `ct_build_initial_tokens` (the chat template
with the generation prompt, left-cut to `rollout.prompt_length` as verl warns and cuts), `ct_merge_assistant_token`
(the sampled ids appended, mask 1, their log-probs), `ct_merge_non_assistant_msg` (the appended tool / user
messages as the template renders them after the last end-of-turn token, plus the next generation prompt; mask 0,
log-prob 0), `process_multi_modal_info` ({} for text). While the loop's module imports, `verl.experimental.
agent_loop`, `verl.workers.rollout.replica`, `verl.utils.profiler` and the tool modules are tiller's stand-ins
unless verl is installed. Asynchronous RL runs them in the producer (whole trajectories, each token recorded with the
version the call started with; partial rollouts are refused). Not supported: image / video / audio inputs,
`routed_experts`, teacher log-probs.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import sys
import time
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

from pydantic import BaseModel, ConfigDict

from tiller.config.verl_view import verl_config
from tiller.errors import ConfigError, DataError, UserError
from tiller.rollout.agent import AgentLoop, AgentRolloutOutput, build_agent_loop
from tiller.rollout.base import SamplingParams, eos_token_ids
from tiller.rollout.continuous import EpisodeGenerator
from tiller.rollout.function_tools import verl_tool_imports

KEY = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
BUILTIN = ("single_turn_agent", "tool_agent")  # tiller's own loops under verl's names
CALL_SEED_STRIDE = 1_000_003
SAMPLE_SEED_STRIDE = 7919


# ------------------------------------------------------------------------------- verl's classes
class AgentLoopMetrics(BaseModel):
    """verl's per-trajectory timings."""

    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    compute_score: float = 0.0
    num_preempted: int = -1


class AgentLoopOutput(BaseModel):
    """One trajectory (verl's fields)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: Optional[list[float]] = None
    routed_experts: Optional[Any] = None
    multi_modal_data: Optional[dict[str, Any]] = None
    reward_score: Optional[float] = None
    num_turns: int = 0
    metrics: AgentLoopMetrics = AgentLoopMetrics()
    extra_fields: dict[str, Any] = {}
    mm_processor_kwargs: Optional[dict[str, Any]] = None


class TokenOutput(BaseModel):
    """What `server_manager.generate` returns (verl's `verl.workers.rollout.replica.TokenOutput`)."""

    token_ids: list[int]
    log_probs: Optional[list[float]] = None
    routed_experts: Optional[Any] = None
    stop_reason: Optional[str] = None
    num_preempted: Optional[int] = None
    extra_fields: dict[str, Any] = {}


class DictConfigWrap:
    def __init__(self, config: Any):
        self.config = config


class ToolListWrap:
    def __init__(self, tools: list):
        self.tools = tools


@dataclass(frozen=True)
class MergeResult:
    """The runtime token stream after a merge (verl's Continuous Token `MergeResult`)."""

    token_ids: list[int]
    appended_token_count: int
    kind: str = "non_assistant"
    inserted_token_ids: list[int] = field(default_factory=list)
    removed_prefix_token_count: int = 0


REGISTRY: dict[str, dict] = {}  # agent name -> {"_target_": dotted path, "_class": the class, **kwargs}


def register(agent_name: str):
    """verl's `@register("name")`: the decorated class runs the rows whose agent_name is `name`."""

    def decorator(subclass: type) -> type:
        REGISTRY[agent_name] = {"_target_": f"{subclass.__module__}.{subclass.__qualname__}", "_class": subclass}
        return subclass

    return decorator


class AgentLoopBase(ABC):
    """verl's base class (text models): the constructor's attributes and the token helpers (module docstring)."""

    def __init__(self, trainer_config: DictConfigWrap, server_manager: Any, tokenizer: Any, processor: Any,
                 dataset_cls: Any = None, data_config: DictConfigWrap | None = None, hf_model_type: str | None = None,
                 **kwargs: Any):
        self.config = trainer_config.config
        self.rollout_config = self.config.actor_rollout_ref.rollout
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.data_config = data_config.config if data_config is not None else self.config.data
        self.apply_chat_template_kwargs = dict(self.data_config.get("apply_chat_template_kwargs") or {})
        self.mm_processor_kwargs = dict(self.data_config.get("mm_processor_kwargs") or {})
        self.loop = asyncio.get_running_loop()

    async def process_vision_info(self, messages: list[dict]) -> dict:
        return await self.process_multi_modal_info(messages)

    async def process_multi_modal_info(self, messages: list[dict]) -> dict:
        for message in messages:
            content = message.get("content")
            if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") != "text" for p in content):
                raise NotImplementedError("tiller runs verl agent loops on text prompts (no image / video / audio)")
        return {}

    def _get_mm_processor_kwargs(self, audio_data: Any = None) -> dict:
        return dict(self.mm_processor_kwargs)

    def _assert_mm_supported(self, has_multi_modal: bool) -> None:
        if has_multi_modal:
            raise NotImplementedError("tiller runs verl agent loops on text prompts (no image / video / audio)")

    def _render(self, messages: list[dict], generation_prompt: bool, tools: list | None) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                                       add_generation_prompt=generation_prompt, return_dict=False,
                                                       **self.apply_chat_template_kwargs))

    async def ct_build_initial_tokens(self, messages: list[dict], tools: list | None = None, images: Any = None,
                                      videos: Any = None, audios: Any = None) -> list[int]:
        self._assert_mm_supported(bool(images or videos or audios))
        ids = await self.loop.run_in_executor(None, lambda: self._render(list(messages), True, tools))
        return self._cap_text_prompt_length(ids)

    async def ct_merge_assistant_token(self, runtime_token_ids: list[int], assistant_token_ids: list[int],
                                       response_mask: list[int], response_logprobs: list[float] | None = None,
                                       assistant_logprobs: list[float] | None = None):
        merged = MergeResult(list(runtime_token_ids) + list(assistant_token_ids), len(assistant_token_ids),
                             "assistant")
        mask = list(response_mask) + [1] * len(assistant_token_ids)
        logprobs = None
        if response_logprobs is not None or assistant_logprobs is not None:
            given = list(assistant_logprobs) if assistant_logprobs is not None else [0.0] * len(assistant_token_ids)
            logprobs = list(response_logprobs or [0.0] * len(response_mask)) + given
        return merged, mask, logprobs

    async def ct_merge_non_assistant_msg(self, previous_messages: list[dict], updated_messages: list[dict],
                                         runtime_token_ids: list[int], response_mask: list[int],
                                         response_logprobs: list[float] | None = None, tools: list | None = None):
        appended = list(updated_messages[len(previous_messages):])
        ids = await self.loop.run_in_executor(None, lambda: self._appended_ids(appended, runtime_token_ids, tools))
        merged = MergeResult(list(runtime_token_ids) + ids, len(ids))
        logprobs = list(response_logprobs) + [0.0] * len(ids) if response_logprobs is not None else None
        return merged, list(response_mask) + [0] * len(ids), logprobs

    def _appended_ids(self, appended: list[dict], runtime: list[int], tools: list | None) -> list[int]:
        """The appended messages' tokens after an assistant turn, as the template renders them after that turn's
        end-of-turn token, plus the next generation prompt (an eos first when the runtime stream lacks one)."""
        if not appended:
            return []
        if appended[0].get("role") == "tool":
            names = [m.get("name") or "tool" for m in appended if m.get("role") == "tool"]
            turn = {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": n, "arguments": {}}} for n in names]}
        else:
            turn = {"role": "assistant", "content": "ASSISTANT"}
        base = [{"role": "user", "content": "USER"}, turn]
        prefix = self._render(base, False, tools)
        full = self._render(base + appended, True, tools)
        eos = set(eos_token_ids(None, self.tokenizer))
        cut = max((i for i, t in enumerate(prefix) if t in eos), default=-1) + 1
        if cut == 0 or full[:cut] != prefix[:cut]:
            raise ValueError(f"cannot render the appended {[m.get('role') for m in appended]} messages after an "
                             "assistant turn with this chat template")
        ids = full[cut:]
        if runtime and runtime[-1] not in eos and self.tokenizer.eos_token_id is not None:
            ids = [self.tokenizer.eos_token_id] + ids
        return ids

    def _cap_text_prompt_length(self, prompt_ids: list[int]) -> list[int]:
        limit = int(self.rollout_config.prompt_length)
        return prompt_ids[-limit:] if len(prompt_ids) > limit else prompt_ids

    @abstractmethod
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        raise NotImplementedError


@contextlib.contextmanager
def simple_timer(name: str, timing: dict):
    """verl.utils.profiler.simple_timer: the block's wall time into timing[name]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def stand_in_modules() -> dict[str, types.ModuleType]:
    """`verl.experimental.agent_loop` (and `.agent_loop`), `verl.workers.rollout.replica`, `verl.utils.profiler`."""
    names = ("verl.experimental", "verl.experimental.agent_loop", "verl.experimental.agent_loop.agent_loop",
             "verl.workers", "verl.workers.rollout", "verl.workers.rollout.replica", "verl.utils.profiler")
    modules = {n: types.ModuleType(n) for n in names}
    for n in ("verl.experimental", "verl.experimental.agent_loop", "verl.workers", "verl.workers.rollout"):
        modules[n].__path__ = []
    for n in ("verl.experimental.agent_loop", "verl.experimental.agent_loop.agent_loop"):
        for obj in (AgentLoopBase, AgentLoopOutput, AgentLoopMetrics, DictConfigWrap, ToolListWrap, register):
            setattr(modules[n], obj.__name__, obj)
        modules[n]._agent_loop_registry = REGISTRY
    modules["verl.experimental.agent_loop"].agent_loop = modules["verl.experimental.agent_loop.agent_loop"]
    modules["verl.workers.rollout.replica"].TokenOutput = TokenOutput
    modules["verl.utils.profiler"].simple_timer = simple_timer
    return modules


# ------------------------------------------------------------------------------------- loading
def _import_target(target: str, where: str) -> type:
    with verl_tool_imports(extra=stand_in_modules()):
        try:
            if ":" in target:
                file, _, name = target.rpartition(":")
                path = Path(file).expanduser()
                if not path.is_file():
                    raise ConfigError(f"{where}: _target_={target!r}: no such file {file}")
                module_name = "tiller_agent_loop_" + str(path.resolve()).replace("/", "_").replace(".", "_")
                spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[module_name] = module
                spec.loader.exec_module(module)
            else:
                module_name, _, name = target.rpartition(".")
                if "" not in sys.path and str(Path.cwd()) not in sys.path:
                    sys.path.insert(0, str(Path.cwd()))  # (verl: hydra imports from the working directory)
                module = importlib.import_module(module_name)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - the user's module: named
            raise ConfigError(f"{where}: cannot import _target_={target!r}: {type(err).__name__}: {err}") from err
    cls = getattr(module, name, None)
    if cls is None:
        raise ConfigError(f"{where}: _target_={target!r}: {module_name} has no {name!r}")
    if not (isinstance(cls, type) and hasattr(cls, "run")):
        raise ConfigError(f"{where}: _target_={target!r} is not an agent loop class (AgentLoopBase with run())")
    return cls


def load_agent_loops(path: str) -> dict[str, dict]:
    """{name: {"_class": class, **kwargs}} of the YAML at `path` (verl's list of `name` / `_target_` entries)."""
    from omegaconf import OmegaConf

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{KEY}={path}: file not found")
    try:
        entries = OmegaConf.to_container(OmegaConf.load(file), resolve=True)
    except Exception as err:  # noqa: BLE001 - YAML errors
        raise ConfigError(f"{KEY}={path}: not a YAML list of agent loops: {err}") from None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{KEY}={path}: must be a non-empty YAML list of {{name, _target_, ...}} entries")
    out: dict[str, dict] = {}
    for i, entry in enumerate(entries):
        where = f"{KEY}={path} entry {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry.get("_target_"):
            raise ConfigError(f"{where}: needs a `name` and a `_target_` (a class path), got {entry!r:.200}")
        name = entry["name"]
        if name in BUILTIN:
            raise ConfigError(f"{where}: name={name!r} is one of tiller's built-in loops ({', '.join(BUILTIN)}); "
                              "give the custom loop another name")
        if name in out:
            raise ConfigError(f"{where}: name={name!r} is listed twice")
        kwargs = {k: v for k, v in entry.items() if k not in ("name", "_target_")}
        out[name] = {"_class": _import_target(str(entry["_target_"]), where), **kwargs}
    for name, entry in REGISTRY.items():  # @register("...") in the imported modules
        if name not in BUILTIN and name not in out and "_class" in entry:
            out[name] = {"_class": entry["_class"]}
    return out


def build_rollout_loop(rollout_cfg: Any, chat_template_kwargs: dict | None = None, config: Any = None):
    """The RL rollout's multi-turn loop: `build_agent_loop`'s (multi_turn.enable) or None, or with
    `agent.agent_loop_config_path` a `VerlAgentLoops` over the custom loops (and that loop for tool_agent /
    single_turn_agent rows). `config`: the run's whole config (what custom loops read as `self.config`)."""
    loop = build_agent_loop(rollout_cfg, chat_template_kwargs)
    if not rollout_cfg.agent.agent_loop_config_path:
        return loop
    loops = load_agent_loops(rollout_cfg.agent.agent_loop_config_path)
    default = rollout_cfg.agent.default_agent_loop
    if default not in loops and default not in BUILTIN:
        raise ConfigError(f"actor_rollout_ref.rollout.agent.default_agent_loop={default!r}: not a loop of "
                          f"{KEY} ({', '.join(sorted(loops))}) nor single_turn_agent / tool_agent")
    if default == "tool_agent" and loop is None:
        raise ConfigError("actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent needs "
                          "actor_rollout_ref.rollout.multi_turn.enable=true")
    builtin = loop if loop is not None else AgentLoop(tools={}, chat_template_kwargs=dict(chat_template_kwargs or {}))
    return VerlAgentLoops(loops, default, builtin, verl_config(config) if config is not None else None,
                          tools=list(loop.tools.values()) if loop is not None else [])


# ------------------------------------------------------------------------------------ running
@dataclass
class VerlLoopResult:
    """What the reward side reads of a custom loop's trajectory: its `reward_score` (None: the reward function's)."""

    reward_score: float | None = None
    extra_fields: dict = field(default_factory=dict)


class _Server:
    """`server_manager` of one sample: verl's `generate` on the shared engine, each call seeded."""

    def __init__(self, generate, sampling: SamplingParams, seed: int | None, prompt_length: int,
                 response_length: int, max_model_len: int):
        self._generate, self.sampling, self.seed = generate, sampling, seed
        self.prompt_length, self.response_length, self.max_model_len = prompt_length, response_length, max_model_len
        self.calls = 0

    async def generate(self, request_id: Any = None, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None, **kwargs: Any) -> TokenOutput:
        if image_data or video_data or audio_data:
            raise NotImplementedError("tiller runs verl agent loops on text prompts (no image / video / audio)")
        params = dict(sampling_params)
        ids = [int(t) for t in prompt_ids]
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"Prompt length ({len(ids)}) leaves no room to generate within the model's maximum "
                             f"context length ({self.max_model_len})")
        if "max_tokens" in params:
            max_tokens = int(params.pop("max_tokens"))
        elif "max_new_tokens" in params:
            max_tokens = int(params.pop("max_new_tokens"))
        else:
            max_tokens = min(self.response_length, self.prompt_length + self.response_length - len(ids))
        max_tokens = max(1, min(max_tokens, room))
        temperature = float(params.get("temperature", self.sampling.temperature))
        top_k = params.get("top_k", self.sampling.top_k)
        call = replace(self.sampling, n=1, max_new_tokens=max_tokens, do_sample=temperature > 0,
                       temperature=temperature if temperature > 0 else 1.0,
                       top_p=float(params.get("top_p", self.sampling.top_p)),
                       top_k=-1 if top_k in (None, 0) else int(top_k),
                       **{name: float(params.get(name, getattr(self.sampling, name))) for name in PENALTIES},
                       seed=None if self.seed is None else self.seed + CALL_SEED_STRIDE * self.calls)
        self.calls += 1
        out = await self._generate(ids, call)
        return TokenOutput(token_ids=list(out.response_ids[0]), log_probs=list(out.logprobs[0]),
                           stop_reason="completed")


PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")  # vLLM's names, SamplingParams' fields


def verl_sampling_params(sampling: SamplingParams) -> dict[str, Any]:
    """The sampling parameters verl hands `run` (greedy: temperature 0; `rollout.repetition_penalty`)."""
    return dict(temperature=sampling.temperature if sampling.do_sample else 0.0, top_p=sampling.top_p,
                top_k=sampling.top_k, repetition_penalty=sampling.repetition_penalty, logprobs=True)


class VerlAgentLoops:
    """The rollout's multi-turn loop when custom agent loops are configured: each row runs its loop (a custom one,
    or tiller's `builtin` loop for single_turn_agent / tool_agent rows)."""

    wants_rows = True  # generate() is given each prompt's row fields

    def __init__(self, loops: dict[str, dict], default: str, builtin: Any, config: Any, processor: Any = None,
                 tools: list | None = None):
        self.loops, self.default, self.builtin = loops, default, builtin
        # the schemas rendered into the prompts: multi_turn's tools (None without multi_turn.enable)
        self.tools = {t.name: t for t in tools} if tools else None
        self.config, self.processor, self.tool_list = config, processor, list(tools or [])

    def agent_names(self) -> set[str]:
        return set(self.loops)

    def _max_model_len(self, engine) -> int:
        model = getattr(getattr(engine, "weights", None), "module", None) or getattr(engine, "model", None)
        return int(getattr(getattr(model, "config", None), "max_position_embeddings", 0) or 1 << 30)

    def generate(self, engine, tokenizer, prompt_ids: list[list[int]], sampling: SamplingParams,
                 max_response_length: int | None = None, tools_kwargs=None, weights_hook=None, multi_modal=None,
                 single_turn=None, rows: Sequence[dict] | None = None) -> AgentRolloutOutput:
        if multi_modal is not None and any(m is not None for m in multi_modal):
            raise ConfigError(f"{KEY} with image prompts: tiller runs verl agent loops on text prompts")
        rows = list(rows) if rows is not None else [{} for _ in prompt_ids]
        names = [r.get("agent_name") or self.default for r in rows]
        custom = [k for k, name in enumerate(names) if name not in BUILTIN]
        plain = [k for k, name in enumerate(names) if name in BUILTIN]
        n = sampling.n
        parts: dict[int, AgentRolloutOutput] = {}
        if plain:
            sub = self.builtin.generate(engine, tokenizer, [prompt_ids[k] for k in plain], sampling,
                                        max_response_length=max_response_length,
                                        tools_kwargs=[tools_kwargs[k] for k in plain] if tools_kwargs else None,
                                        weights_hook=weights_hook,
                                        single_turn=[names[k] == "single_turn_agent" for k in plain])
            parts.update(_split(sub, plain, n))
        if custom:
            sub = self._run_custom(engine, tokenizer, [rows[k] for k in custom], [names[k] for k in custom],
                                   sampling, int(max_response_length or sampling.max_new_tokens), weights_hook)
            parts.update(_split(sub, custom, n))
        out = AgentRolloutOutput()
        for k in range(len(prompt_ids)):
            part = parts[k]
            for f in ("prompt_ids", "response_ids", "logprobs", "finish_reason", "response_mask", "num_turns",
                      "num_tool_calls", "tool_errors", "tool_rewards", "token_versions"):
                getattr(out, f).extend(getattr(part, f))
            out.states.extend(part.states or [None] * n)
        if not any(s is not None for s in out.states):
            out.states = []
        return out

    def _run_custom(self, engine, tokenizer, rows: list[dict], names: list[str], sampling: SamplingParams,
                    budget: int, weights_hook) -> AgentRolloutOutput:
        n = sampling.n
        rollout = self.config.actor_rollout_ref.rollout
        prompt_length = int(rollout.prompt_length)
        max_model_len = self._max_model_len(engine)
        # asynchronous RL (whole trajectories: partial_rollout is refused): the version every token is sampled with
        version = weights_hook() if weights_hook is not None else None
        episodes = EpisodeGenerator(engine, weights_hook)  # (the native engine's requests share decode steps)
        generate = episodes.generate
        params = verl_sampling_params(sampling)

        async def one(k: int) -> AgentLoopOutput:
            row, name = rows[k // n], names[k // n]
            entry = self.loops.get(name)
            if entry is None:
                raise DataError(f"agent_name={name!r}: not a registered agent loop (registered: "
                                f"{', '.join(sorted(self.loops) + list(BUILTIN))})")
            seed = None if sampling.seed is None else sampling.seed + SAMPLE_SEED_STRIDE * k
            server = _Server(generate, sampling, seed, prompt_length, budget, max_model_len)
            kwargs = {key: v for key, v in entry.items() if key != "_class"}
            try:
                agent = entry["_class"](trainer_config=DictConfigWrap(self.config), server_manager=server,
                                        tokenizer=tokenizer, processor=self.processor, dataset_cls=None,
                                        data_config=DictConfigWrap(self.config.data),
                                        tools=ToolListWrap(self.tool_list), **kwargs)
                output = await agent.run(dict(params), **_run_kwargs(row, name))
            except (ConfigError, DataError, UserError):
                raise
            except Exception as err:  # noqa: BLE001 - the user's loop: named, the run stops
                raise UserError(f"agent loop {name!r} ({entry['_class'].__name__}) failed on sample {k}: "
                                f"{type(err).__name__}: {err}") from err
            if not isinstance(output, AgentLoopOutput) and type(output).__name__ != "AgentLoopOutput":
                raise UserError(f"agent loop {name!r}: run() returned a {type(output).__name__}, not an "
                                "AgentLoopOutput")
            return output

        async def main() -> list:
            return list(await asyncio.gather(*(one(k) for k in range(len(rows) * n))))

        try:
            outputs = asyncio.run(main())
        finally:
            episodes.close()
        eos = (set(eos_token_ids(None, tokenizer)) | {tokenizer.pad_token_id}) - {None}
        out = AgentRolloutOutput()
        for k, o in enumerate(outputs):
            name = names[k // n]
            if len(o.response_mask) != len(o.response_ids):
                raise UserError(f"agent loop {name!r}: response_mask has {len(o.response_mask)} entries for "
                                f"{len(o.response_ids)} response ids")
            if o.response_logprobs is None:
                raise UserError(f"agent loop {name!r}: its AgentLoopOutput has no response_logprobs; tiller trains "
                                "with the rollout's log-probs: pass the TokenOutput.log_probs of each generate call "
                                "through (ct_merge_assistant_token(..., assistant_logprobs=output.log_probs))")
            if o.multi_modal_data:
                raise UserError(f"agent loop {name!r}: multi_modal_data: tiller runs verl agent loops on text")
            ids, mask = list(o.response_ids)[:budget], list(o.response_mask)[:budget]
            out.prompt_ids.append(list(o.prompt_ids))
            out.response_ids.append(ids)
            out.response_mask.append(mask)
            out.logprobs.append([float(x) for x in o.response_logprobs][:budget])
            out.finish_reason.append("stop" if ids and ids[-1] in eos else "length")
            out.num_turns.append(int(o.num_turns))
            out.num_tool_calls.append(0)
            out.tool_errors.append(0)
            out.tool_rewards.append([float(x) for x in (o.extra_fields or {}).get("tool_rewards") or []])
            out.states.append(VerlLoopResult(o.reward_score, dict(o.extra_fields or {})))
            if version is not None:
                out.token_versions.append([version] * len(ids))
        return out


def _run_kwargs(row: dict, name: str) -> dict[str, Any]:
    """The row's fields as verl's `run(**kwargs)` gets them (its RLHFDataset's non-tensor fields)."""
    info = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    kwargs = {"raw_prompt": row.get("raw_prompt"), "data_source": row.get("data_source"),
              "reward_model": {"style": "rule", "ground_truth": row.get("ground_truth")},
              "extra_info": row.get("extra_info"), "index": info.get("index", 0),
              "tools_kwargs": info.get("tools_kwargs") or {}, "agent_name": name, "uid": row.get("uid")}
    if kwargs["raw_prompt"] is None:
        raise DataError("a row without its chat messages (raw_prompt): verl agent loops need data.return_raw_chat")
    return kwargs


def _split(out: AgentRolloutOutput, prompts: list[int], n: int) -> dict[int, AgentRolloutOutput]:
    """Per prompt index (of the whole call), its n samples of `out` (rows of `prompts` in order)."""
    parts = {}
    for j, k in enumerate(prompts):
        part = AgentRolloutOutput()
        for f in ("prompt_ids", "response_ids", "logprobs", "finish_reason", "response_mask", "num_turns",
                  "num_tool_calls", "tool_errors", "tool_rewards", "token_versions", "states"):
            values = getattr(out, f)
            if values:
                setattr(part, f, list(values[j * n:(j + 1) * n]))
        parts[k] = part
    return parts


__all__ = ["AgentLoopBase", "AgentLoopMetrics", "AgentLoopOutput", "TokenOutput", "VerlAgentLoops",
           "VerlLoopResult", "load_agent_loops", "register", "stand_in_modules", "verl_config"]
