"""TRL 1.16's tool calling in GRPO (`GRPOTrainer(tools=..., environment_factory=...)`) on tiller's rollout engines.

`TRLToolLoop` is the multi-turn loop of the RL driver for a TRL script (`tiller.trainer.rl.run(cfg, tool_loop=...)`,
in place of verl's `multi_turn` loop); it follows TRL's `GRPOTrainer._tool_call_loop` step for step:

1. every completion of the generation batch is sampled (`max_completion_length` new tokens) and parsed into an
   assistant message by transformers' response parsing (`tokenizer.parse_response`, TRL's `parse_response`: a
   malformed call gives a plain-text message, so the conversation ends);
2. a message with `tool_calls` runs each call (`function.arguments` as keywords): the synchronous tools in order,
   then the coroutines of async ones (their results after the synchronous ones', as TRL appends them; every sample's
   coroutines of a turn run concurrently, TRL gathers one sample's at a time). A result becomes the tool message
   `{"role": "tool", "name": ..., "content": str(result)}` (a list stays a list); a call that raises, names an
   unknown tool or is not of type "function" gives `str({"error": ...})` and counts as a failure;
3. the tool messages' tokens are TRL's `_get_tool_suffix_ids`: the chat template's rendering of a dummy tool-call
   turn plus the tool messages with the generation prompt, after the dummy turn's last eos (never re-tokenized: the
   sampled ids stay as they were);
4. when the tool tokens would take the completion past `max_completion_length` (or the context past the model's
   `max_position_embeddings`), the tool messages are dropped and the sample ends as it is (TRL's rollback);
5. otherwise the policy continues from prompt + completion + tool tokens (the rest of the budget), the new turn is
   parsed, and the loop repeats while there are calls, at most `max_tool_calling_iterations` times.

Tool tokens are context (response mask 0, TRL's tool_mask); each sample's messages go to the reward functions as
its completion. Environments (`environment_factory`): one instance per completion, drawn from a pool that grows as
a batch needs (TRL's "construct once, reset often"); `reset(**row)` before generation (a returned string is appended
to the prompt's last user message, and the prompt is rendered again with that row's tools); the instance's public
methods are its tools; `get_reward()` is a reward source named after the class (weight 1).

Response parsing needs the tokenizer's `response_template` (or legacy `response_schema`): the one it carries, else
the one TRL's `add_response_schema` sets for the chat templates it knows (trl installed), else a `ConfigError`.
A chat template that is not prefix-preserving is replaced by TRL's training template (trl installed), as TRL does.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from tiller.errors import ConfigError, DataError, UserError
from tiller.rollout.agent import AgentRolloutOutput
from tiller.rollout.base import SamplingParams, eos_token_ids
from tiller.rollout.verl_tools import TOOL_LOOP
from tiller.trl.rewards import ROW_KEY, SPLIT_KEY

TURN_SEED_STRIDE = 1_000_003  # a conversation's turn t samples with seed + stride x t (as tiller's verl loop)


# --------------------------------------------------------------------------------------------- tools
@dataclass
class TRLTool:
    """One callable as TRL exposes it: its `__name__`, transformers' JSON schema of it (what `apply_chat_template`
    renders for a callable in `tools=`), sync or async."""

    fn: Callable
    name: str
    schema: dict
    is_async: bool


def tool_of(fn: Any, where: str) -> TRLTool:
    """`fn` as a tool; a `ConfigError` naming it when transformers cannot write its schema."""
    from transformers.utils import get_json_schema

    if not callable(fn):
        raise ConfigError(f"{where}: a {type(fn).__name__} is not a function")
    name = getattr(fn, "__name__", None)
    if not name:
        raise ConfigError(f"{where}: {fn!r} has no __name__ (TRL calls a tool by its function name)")
    try:
        schema = get_json_schema(fn)
    except Exception as err:  # noqa: BLE001 - transformers' DocstringParsingException / TypeHintParsingException
        raise ConfigError(f"{where}: cannot write the schema of {name!r}: {err} (a tool needs a type hint on every "
                          "argument and a Google-style docstring with an Args: line for each)") from None
    return TRLTool(fn, name, schema, inspect.iscoroutinefunction(fn))


def environment_methods(instance: Any) -> list[Callable]:
    """The tools of an environment instance: its class's public functions but reset / get_reward (TRL's listing,
    on the class so properties are not evaluated), bound to the instance."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


class EnvironmentPool:
    """`environment_factory` (one callable, or {name: callable}): probed once per environment (reset required,
    tools read), then instances handed out per batch, more made only when a batch needs more."""

    def __init__(self, factory: Any, standalone: list[TRLTool]):
        self.multi = isinstance(factory, dict)
        self.factories = dict(factory) if self.multi else {None: factory}
        if not self.factories:
            raise ConfigError("environment_factory: an empty dict")
        self.pool: dict[Any, list[Any]] = {}
        self.tools: dict[Any, list[TRLTool]] = {}  # per environment name: standalone + its methods (its schema)
        self.reward_classes: list[type] = []  # classes with get_reward, once each
        for name, make in self.factories.items():
            where = "environment_factory" + (f"[{name!r}]" if self.multi else "")
            if not callable(make):
                raise ConfigError(f"{where}: a {type(make).__name__} is not callable")
            instance = make()
            members = dict(inspect.getmembers(type(instance), predicate=inspect.isfunction))
            if "reset" not in members:
                raise ConfigError(f"{where}: {type(instance).__name__} has no `reset` method; each environment "
                                  "instance returned by `environment_factory` must define a callable `reset`")
            methods = [tool_of(m, f"{where}: {type(instance).__name__}.{m.__name__}")
                       for m in environment_methods(instance)]
            self.tools[name] = standalone + methods
            self.pool[name] = [instance]
            if "get_reward" in members and type(instance) not in self.reward_classes:
                self.reward_classes.append(type(instance))

    def union(self) -> list[TRLTool]:
        out: dict[str, TRLTool] = {}
        for tools in self.tools.values():
            for tool in tools:
                out.setdefault(tool.name, tool)
        return list(out.values())

    def draw(self, names: list[Any]) -> list[Any]:
        """One instance per name, in order (reused across batches; the pool grows as TRL's does)."""
        cursor: dict[Any, int] = {}
        out = []
        for name in names:
            if name not in self.factories:
                raise DataError(f"a row has environment={name!r}, which is not among the environments passed to "
                                f"environment_factory; expected one of {list(self.factories)}")
            pool, k = self.pool[name], cursor.get(name, 0)
            if k == len(pool):
                pool.append(self.factories[name]())
            cursor[name] = k + 1
            out.append(pool[k])
        return out


def environment_rewards(pool: EnvironmentPool) -> list[tuple[str, Callable]]:
    """(name, reward function) of every environment class that owns its reward (`get_reward`): the rollouts of that
    exact class are scored by it, the others get None (TRL's extra reward source, weight 1)."""
    out = []
    for cls in pool.reward_classes:
        if inspect.iscoroutinefunction(cls.get_reward):
            async def reward(environments, _cls=cls, **_: Any) -> list:
                return [await e.get_reward() if type(e) is _cls else None for e in environments]
        else:
            def reward(environments, _cls=cls, **_: Any) -> list:
                return [e.get_reward() if type(e) is _cls else None for e in environments]
        out.append((cls.__name__, reward))
    return out


# ----------------------------------------------------------------------------------------- templates
def prefix_preserving(tokenizer, chat_template: str | None = None) -> bool:
    """Whether the template renders a conversation's earlier messages the same whatever follows (a tool-call turn
    then a tool message): multi-turn generation concatenates ids, so it must."""
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}]}
    base = [{"role": "user", "content": "hi"}, call]
    try:
        short = tokenizer.apply_chat_template(base, tokenize=False, chat_template=chat_template)
        full = tokenizer.apply_chat_template(base + [{"role": "tool", "name": "probe", "content": "ok"}],
                                             tokenize=False, chat_template=chat_template)
    except Exception:  # noqa: BLE001 - a template that cannot render a tool turn at all
        return False
    return full.startswith(short.rstrip())


def supports_tool_calling(tokenizer) -> bool:
    """The template renders a tool call's name and arguments and a tool message's content (TRL's check)."""
    name, key, value, content = "tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2", "tool_arg_val_d6e7a9f3", \
        "tool_content_c4f9a8e2"
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": name, "arguments": {key: value}}}]},
                {"role": "tool", "name": name, "content": content}]
    if not getattr(tokenizer, "chat_template", None):
        return False
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - jinja TemplateError: the template rejects the roles
        return False
    return all(s in rendered for s in (name, key, value, content))


def prepare_tokenizer(tokenizer, model: str) -> str | None:
    """Set the tokenizer up for tool calling as TRL does; returns the chat template to render with (None: its own).
    A `ConfigError` naming `model` when its template cannot render tool calls or its responses cannot be parsed."""
    if not supports_tool_calling(tokenizer):
        raise ConfigError(f"tools / environment_factory with {model!r}: its chat template does not support tool "
                          "calling; it must render a full tool-calling conversation (user -> assistant with "
                          "tool_calls -> tool)")
    has_parser = getattr(tokenizer, "response_template", None) is not None or \
        getattr(tokenizer, "response_schema", None) is not None
    trl_utils = None
    try:
        import trl.chat_template_utils as trl_utils  # optional dependency: TRL's templates of known models
    except ImportError:
        pass
    if not has_parser:
        if trl_utils is None:
            raise ConfigError(f"tools / environment_factory with {model!r}: its tokenizer has no response_template "
                              "(transformers' response parsing, which reads the tool calls); set "
                              "tokenizer.response_template, or install trl>=1.16, whose add_response_schema knows "
                              "the common chat templates (Qwen, Llama 3.x, GLM, gpt-oss, ...)")
        try:
            trl_utils.add_response_schema(tokenizer)
        except ValueError as err:
            raise ConfigError(f"tools / environment_factory with {model!r}: {err}") from None
    if prefix_preserving(tokenizer):
        return None
    if trl_utils is None:
        raise ConfigError(f"tools / environment_factory with {model!r}: its chat template is not prefix-preserving "
                          "(earlier turns render differently once more follow), so multi-turn ids cannot be "
                          "concatenated; TRL swaps in its training template for known models (install trl>=1.16) "
                          "or give a prefix-preserving template")
    return trl_utils.get_training_chat_template(tokenizer)


def parse_response(tokenizer, ids: list[int], prefix: list[int], tools: list[TRLTool]) -> dict:
    """An assistant message of the sampled `ids` (TRL's `parse_response`: a parse failure is the plain text)."""
    try:
        if getattr(tokenizer, "response_template", None) is not None:
            try:
                parsed = tokenizer.parse_response(ids, prefix=prefix, tools=[t.schema for t in tools] or None)
            except TypeError:  # transformers < 5.15: no tools= (arguments typed by a lenient JSON parse)
                parsed = tokenizer.parse_response(ids, prefix=prefix)
        else:
            parsed = tokenizer.parse_response(ids)
        if parsed is None:
            raise ValueError("parse_response returned None")
        if isinstance(parsed.get("content"), str) and tokenizer.eos_token:
            parsed["content"] = parsed["content"].removesuffix(tokenizer.eos_token)
        if not parsed.get("content"):
            parsed["content"] = ""
        if "tool_calls" in parsed:
            _check_calls(parsed["tool_calls"])
    except (ValueError, TypeError):
        parsed = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return parsed


def _check_calls(calls: Any) -> None:
    """TRL's `_validate_tool_calls`: a partly parsed call is a parse failure; missing arguments are {}."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list or None.")
    for call in calls:
        if not isinstance(call, dict):
            raise ValueError("a tool call must be a dict")
        target = call["function"] if "function" in call else call
        if not isinstance(target, dict) or not isinstance(target.get("name"), str):
            raise ValueError("a tool call needs a string name")
        if target.get("arguments") is None:
            target["arguments"] = {}


# ------------------------------------------------------------------------------------------- episodes
@dataclass
class TRLEpisode:
    """What the reward functions read of one completion: its prompt (with a reset observation appended), its
    environment (None without environment_factory) and its messages."""

    prompt: Any
    environment: Any = None
    messages: list[dict] = field(default_factory=list)


@dataclass
class _Sample:
    prompt_ids: list[int]
    tools: dict[str, TRLTool]
    schema_tools: list[TRLTool]
    episode: TRLEpisode
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = "stop"  # TRL's is_truncated: "length"
    turns: int = 0
    calls: int = 0
    failures: int = 0


class TRLToolLoop:
    """The RL driver's tool loop for TRL's tools / environments (module docstring). `rows`: {split: dataset rows}
    (the TRL front end's, read by the `extra_info` row index); `decoders`: {split: row decoder or None}."""

    wants_rows = True  # generate() is given each prompt's fields (its extra_info: the dataset row's index)

    def __init__(self, tools: list[TRLTool], environments: EnvironmentPool | None, rows: dict[str, list[dict]],
                 decoders: dict[str, Any], max_iterations: int | None, chat_template: str | None,
                 chat_template_kwargs: dict | None, max_model_len: int, max_prompt_length: int, tokenizer=None):
        self.tokenizer = tokenizer  # set up by `prepare_tokenizer` (its response template); None: the engine's
        self.standalone, self.environments = list(tools), environments
        union = environments.union() if environments is not None else self.standalone
        self.tools = {t.name: t for t in union}  # the schemas the data renders into the prompts
        self.rows, self.decoders = rows, decoders
        self.max_iterations = max_iterations if max_iterations is not None else 1 << 62
        self.chat_template, self.chat_template_kwargs = chat_template, dict(chat_template_kwargs or {})
        self.max_model_len, self.max_prompt_length = int(max_model_len), int(max_prompt_length)

    # ------------------------------------------------------------------------------------ setup
    def _row(self, info: Any) -> dict:
        info = info or {}
        split, index = info.get(SPLIT_KEY, "train"), int(info[ROW_KEY])
        row = self.rows[split][index]
        decode = self.decoders.get(split)
        return decode(row) if decode is not None else row

    def _samples(self, tokenizer, prompt_ids: list[list[int]], n: int, extra_info: Sequence[Any] | None) \
            -> list[_Sample]:
        rows = [self._row(info) for info in extra_info] if extra_info is not None else [None] * len(prompt_ids)
        if self.environments is None:
            return [_Sample(list(p), {t.name: t for t in self.standalone}, self.standalone,
                            TRLEpisode(copy.deepcopy(row["prompt"]) if row is not None else None))
                    for p, row in zip(prompt_ids, rows) for _ in range(n)]
        if extra_info is None:
            raise ValueError("environments need each prompt's extra_info (its dataset row)")
        pool = self.environments
        per_sample = [row for row in rows for _ in range(n)]
        names = [row.get("environment") if pool.multi else None for row in per_sample]
        instances = pool.draw(names)
        out = []
        for k, (row, name, env) in enumerate(zip(per_sample, names, instances)):
            prompt = copy.deepcopy(row.get("prompt", [{"role": "user", "content": ""}]))
            kwargs = {key: v for key, v in row.items() if key != "environment"} if pool.multi else dict(row)
            try:
                observation = env.reset(**kwargs)
            except Exception as err:  # noqa: BLE001 - the user's environment: named, the run stops
                raise UserError(f"environment {type(env).__name__}.reset() raised {type(err).__name__}: {err}") \
                    from err
            if observation is not None:
                content = prompt[-1]["content"]
                if isinstance(observation, list) and isinstance(content, str):
                    content = [{"type": "text", "text": content}]
                if isinstance(observation, str) and isinstance(content, list):
                    observation = [{"type": "text", "text": observation}]
                prompt = prompt[:-1] + [{**prompt[-1], "content": content + observation}]
            tools = pool.tools[name][:len(self.standalone)] + [
                replace(t, fn=getattr(env, t.name)) for t in pool.tools[name][len(self.standalone):]]
            ids = self._render(tokenizer, prompt, tools)
            if len(ids) > self.max_prompt_length:
                raise DataError(f"sample {k}: the prompt after {type(env).__name__}.reset() has {len(ids)} tokens, "
                                f"more than the {self.max_prompt_length} tiller sized the batch for (the longest "
                                "dataset prompt plus room for reset observations, within the model's context)")
            out.append(_Sample(ids, {t.name: t for t in tools}, tools, TRLEpisode(prompt, env)))
        return out

    def _render(self, tokenizer, prompt: list[dict], tools: list[TRLTool]) -> list[int]:
        return list(tokenizer.apply_chat_template(prompt, tools=[t.schema for t in tools] or None,
                                                  chat_template=self.chat_template, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False, **self.chat_template_kwargs))

    # ------------------------------------------------------------------------------------ tools
    def _execute(self, batch: list[tuple[_Sample, list]]) -> list[list[dict]]:
        """Each sample's tool messages for its calls (TRL's order: sync results, then async ones)."""
        sync: list[list[tuple[str, Any]]] = [[] for _ in batch]
        pending: list[tuple[int, str, Any]] = []
        for i, (sample, calls) in enumerate(batch):
            for call in calls:
                sample.calls += 1
                if call.get("type") != "function":
                    sample.failures += 1
                    sync[i].append((call.get("name", "unknown"),
                                    {"error": f"Unsupported tool call type: {call.get('type')}"}))
                    continue
                function = call["function"]
                name = function["name"]
                tool = sample.tools.get(name)
                try:
                    if tool is None:
                        raise ValueError(f"Tool {name} not found.")
                    if tool.is_async:
                        pending.append((i, name, tool.fn(**function["arguments"])))
                    else:
                        sync[i].append((name, tool.fn(**function["arguments"])))
                except Exception as err:  # noqa: BLE001 - as TRL: the error goes back to the model
                    sample.failures += 1
                    sync[i].append((name, {"error": str(err)}))
        results = TOOL_LOOP.gather([coro for _, _, coro in pending])
        for (i, name, _), result in zip(pending, results):
            if isinstance(result, BaseException):
                batch[i][0].failures += 1
                result = {"error": str(result)}
            sync[i].append((name, result))
        return [[{"role": "tool", "name": name, "content": value if isinstance(value, list) else str(value)}
                 for name, value in sample_results] for sample_results in sync]

    def suffix_ids(self, tokenizer, tool_messages: list[dict]) -> list[int]:
        """TRL's `_get_tool_suffix_ids`: the tool messages' tokens (and the next generation prompt) after an
        assistant tool-call turn, cut at that turn's last eos."""
        call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
        prefix = list(tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True,
                                                    chat_template=self.chat_template, return_dict=False,
                                                    **self.chat_template_kwargs))
        full = list(tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, tokenize=True,
                                                  chat_template=self.chat_template, return_dict=False,
                                                  **self.chat_template_kwargs))
        eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
        if eos:
            prefix = prefix[:eos[-1] + 1]
        if full[:len(prefix)] != prefix:
            raise ValueError("Unexpected tokenization: the EOS-trimmed prefix IDs are not a prefix of the full IDs.")
        return full[len(prefix):]

    # ------------------------------------------------------------------------------------ the loop
    def generate(self, engine, tokenizer, prompt_ids: list[list[int]], sampling: SamplingParams,
                 max_response_length: int | None = None, tools_kwargs=None, weights_hook=None, multi_modal=None,
                 single_turn=None, rows: Sequence[dict] | None = None) -> AgentRolloutOutput:
        if multi_modal is not None and any(m is not None for m in multi_modal):
            raise ConfigError("tools / environment_factory with image prompts: not supported by tiller's TRL front "
                              "end in this version")
        tokenizer = self.tokenizer or tokenizer
        budget = int(max_response_length or sampling.max_new_tokens)
        extra_info = [r.get("extra_info") for r in rows] if rows is not None else None
        samples = self._samples(tokenizer, prompt_ids, sampling.n, extra_info)
        hook = {"weights_hook": weights_hook} if weights_hook is not None else {}
        eos_ids = (set(eos_token_ids(None, tokenizer)) | {tokenizer.pad_token_id}) - {None}

        def turn(live: list[_Sample], t: int) -> list[dict]:
            room = [budget - len(s.ids) for s in live]
            call = replace(sampling, n=1, max_new_tokens=max(1, min(sampling.max_new_tokens, max(room))),
                           seed=None if sampling.seed is None else sampling.seed + TURN_SEED_STRIDE * t)
            out = engine.generate([s.prompt_ids + s.ids for s in live], call, **hook)
            messages = []
            for s, r, ids, lps in zip(live, room, out.response_ids, out.logprobs):
                context = s.prompt_ids + s.ids
                kept = list(ids)[:r]
                s.turns += 1
                s.ids += kept
                s.mask += [1] * len(kept)
                s.logprobs += list(lps)[:len(kept)]
                # (TRL parses every first turn; a post-tool turn cut to nothing is no message)
                message = parse_response(tokenizer, kept, context, s.schema_tools) if kept or t == 0 else {}
                if message:
                    s.episode.messages.append(message)
                messages.append(message)
            return messages

        messages = turn(samples, 0)
        live = [(s, m.get("tool_calls")) for s, m in zip(samples, messages) if m.get("tool_calls")]
        iteration = 0
        while live and iteration < self.max_iterations:
            results = self._execute(live)
            going = []
            for (s, _), tool_messages in zip(live, results):
                suffix = self.suffix_ids(tokenizer, tool_messages)
                if len(s.ids) + len(suffix) > budget or len(s.prompt_ids) + len(s.ids) + len(suffix) >= \
                        self.max_model_len:
                    continue  # TRL's rollback: the results are dropped, the sample ends as it is
                s.episode.messages += tool_messages
                s.ids += suffix
                s.mask += [0] * len(suffix)
                s.logprobs += [0.0] * len(suffix)
                going.append(s)
            if not going:
                break
            iteration += 1
            going = [s for s in going if len(s.ids) < budget]  # (no room: TRL's post-tool turn is cut to nothing)
            messages = turn(going, iteration) if going else []
            live = [(s, m.get("tool_calls")) for s, m in zip(going, messages) if m.get("tool_calls")]
        for s in samples:  # TRL's is_truncated: a completion whose last token is no eos / pad
            s.finish = "stop" if s.ids and s.ids[-1] in eos_ids else "length"
        return AgentRolloutOutput(
            prompt_ids=[s.prompt_ids for s in samples], response_ids=[s.ids for s in samples],
            logprobs=[s.logprobs for s in samples], finish_reason=[s.finish for s in samples],
            response_mask=[s.mask for s in samples], num_turns=[s.turns for s in samples],
            num_tool_calls=[s.calls for s in samples], tool_errors=[s.failures for s in samples],
            tool_rewards=[[] for _ in samples], messages=[s.episode.messages for s in samples],
            states=[s.episode for s in samples])


__all__ = ["EnvironmentPool", "TRLEpisode", "TRLTool", "TRLToolLoop", "environment_rewards", "parse_response",
           "prepare_tokenizer", "tool_of"]
