"""The OpenAI-compatible HTTP app: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/health`.

With the native engine, requests go to a `ContinuousBatcher` (`tiller.rollout.continuous`): they join the
running batch between decode steps, each row with its own sampling settings, `logit_bias` and (seeded)
generator. Other engines (hf, vllm) sit behind a `MicroBatcher` (requests with equal settings share an engine
call). Chat prompts are rendered with the tokenizer's chat template (`add_generation_prompt=True`) and
tokenized without extra special tokens, as the trainer does, so a served checkpoint sees exactly the
prompts it was trained on.

Semantics and deviations from the OpenAI API:
- `temperature=0` is greedy decoding. `seed` makes a request reproducible: with the native engine it batches
  with the others and draws from its own generator, so it returns the same tokens alone or under load
  (other engines run a seeded request in its own engine call).
- `stop` strings end a choice and are not part of the returned text (as OpenAI); the token that completed
  the string is still counted in `usage.completion_tokens`. vLLM's extensions: `stop_token_ids` end a choice too
  (the token's text left out), `include_stop_str_in_output` keeps the stop string / token in the text,
  `skip_special_tokens=false` keeps special tokens; `min_tokens` > 0 is refused. `chat_template_kwargs` (vLLM's:
  extra chat-template variables, e.g. Qwen3's `enable_thinking`) renders the chat with them; vLLM's guided_json /
  guided_choice / guided_grammar, bad_words, allowed_token_ids, prompt_logprobs, truncate_prompt_tokens,
  use_beam_search and continue_final_message are refused when set (400 naming the field), never ignored.
- `logprobs` (and `top_logprobs` <= 20 on chat, `logprobs: k` <= 20 on completions) are those of the sampling
  distribution (after `logit_bias`, the penalties, the `response_format` mask, temperature, top-k, top-p, min-p),
  the quantity RL training uses; at temperature 1 without filters that is the model's `log_softmax`. Tokens the filters
  removed report -9999 (vLLM's floor). Top-k logprobs and `logit_bias` need the native engine (400 naming the
  field otherwise).
- `logit_bias` ({token id: bias in [-100, 100]}) is added to the logits before sampling, as OpenAI.
- `presence_penalty` / `frequency_penalty` (OpenAI's, [-2, 2]: a token already in the completion loses
  presence + frequency x its count) and vLLM's `repetition_penalty` (> 0: a logit of a token in the prompt or the
  completion is divided by it when positive, multiplied when negative) apply before temperature and the filters,
  on every engine (`tiller.rollout.sampling.apply_penalties`); the logprobs are those of the penalised distribution.
- vLLM's `structured_outputs: {"regex": ...}` (or its older `guided_regex`) constrains the reply to text matching
  the regex, by the same constrained decoding (native engine; the reply ends at eos once the text matches).
- `response_format` `{"type": "json_object"}` (any JSON object) and `{"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}}}` are honoured on both endpoints by constrained decoding with the native engine
  (`tiller.rollout.constrained`): at every step the tokens that cannot continue valid JSON are masked, and eos is
  allowed only once the value is complete, so a choice that ends with `finish_reason: "stop"` parses (one cut by
  `max_tokens` ends with `"length"`, as OpenAI). Objects come on one line with `", "` / `": "` separators
  unless the schema carries llguidance options under `"x-guidance"` (`tiller.rollout.constrained`). The
  reported logprobs are those of the masked distribution the tokens were drawn from. A schema llguidance cannot
  compile is a 400 naming `response_format.json_schema` with its message; other engines answer 400.
- Streaming (`stream=true`, both endpoints) uses OpenAI's SSE chunk format, but a choice's chunks are sent
  once its generation has finished.
- `usage.prompt_tokens` counts each prompt once, whatever `n` is; completion tokens include a stop token.
- Function calling (`tools`, `tool_choice` auto | none, `parallel_tool_calls`) maps to the Hermes / Qwen
  `<tool_call>` format (`tiller.serve.tool_calls`); forcing a tool is refused.
- Images (a vision-language model, served with its processor): chat `image_url` parts with base64 `data:` URLs
  are decoded and go through the processor into the engine (native or hf); a remote URL is not fetched (400);
  see `tiller.serve.images`. `usage.prompt_tokens` counts the image tokens.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import threading
import time
import uuid
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the handlers' (string) annotations here

from tiller.errors import DataError, UserError
from tiller.models.vision import encode_image_prompt
from tiller.rollout import RolloutOutput, SamplingParams
from tiller.rollout.agent_endpoint import CURRENT_EPISODE, EpisodeNotFound, EpisodeRecorder
from tiller.rollout.constrained import Grammar, GrammarCompiler, GrammarError
from tiller.rollout.continuous import ContinuousBatcher
from tiller.rollout.continuous import QueueFull as RowsFull
from tiller.rollout.continuous import RequestFuture
from tiller.rollout.native import NativeRolloutEngine
from tiller.serve.batcher import MicroBatcher, QueueFull
from tiller.serve.images import message_content
from tiller.serve.protocol import ChatCompletionRequest, CompletionRequest, RequestError, SamplingFields
from tiller.rollout.tool_parsers import KEEP_SPECIAL_TOKENS
from tiller.serve.tool_calls import extract_tool_calls, prepare_messages


class ServedModel:
    """What the handlers need: engine (behind a batcher), tokenizer, name and limits.

    Agent rollouts set `recorder` (an object with `check(episode)` and `record(episode, out, version)`;
    every completion of a request is recorded at token level under `CURRENT_EPISODE`), `policy_version`, and
    `fixed_sampling` ({field: value}: a request that leaves the field out gets the value, one that sets
    another value is refused, so the trainer's logprobs are of the distribution that sampled), and
    `chat_template_kwargs` (the run's `data.apply_chat_template_kwargs`: chats render as the prompt set did).
    """

    recorder = None
    policy_version = 0
    fixed_sampling: dict = {}
    chat_template_kwargs: dict = {}  # extra template variables of every chat (an RL run's apply_chat_template_kwargs)
    tool_call_parser: str = "hermes"  # how the model writes tool calls (tiller serve --tool-call-parser)

    def __init__(self, engine, tokenizer, *, name: str, max_model_len: int, max_tokens_default: int = 512,
                 max_batch_prompts: int = 64, max_wait_s: float = 0.005, max_n: int = 64,
                 max_prompts_per_request: int = 64, max_request_tokens: int = 1 << 20, max_queue: int = 256,
                 prompt_cache_mb: float = 64.0, processor=None):
        self.tokenizer = tokenizer
        self.processor = processor  # a vision-language model's (tiller.models.vision.load_processor): image parts
        self.max_n = int(max_n)
        self.max_prompts_per_request = int(max_prompts_per_request)
        self.max_request_tokens = int(max_request_tokens)
        self.name = name
        self.max_model_len = int(max_model_len)
        self.max_tokens_default = int(max_tokens_default)
        self.created = int(time.time())
        if isinstance(engine, NativeRolloutEngine):
            self.batcher = ContinuousBatcher(engine, max_rows=max_batch_prompts, max_queue=max_queue,
                                             prompt_cache_mb=prompt_cache_mb)
        else:
            self.batcher = MicroBatcher(engine, max_batch_prompts=max_batch_prompts, max_wait_s=max_wait_s,
                                        max_queue=max_queue)
        self._compiler: GrammarCompiler | None = None  # built on the first response_format request
        self._compiler_lock = threading.Lock()

    @property
    def continuous(self) -> bool:
        """True when requests share decode steps (native engine): top-k logprobs, logit_bias and
        response_format work."""
        return isinstance(self.batcher, ContinuousBatcher)

    def grammar(self, req: SamplingFields) -> Grammar | None:
        """The compiled grammar of `req.response_format` or of its regex (vLLM's structured_outputs.regex /
        guided_regex); None for text. Blocking (llguidance quotes up to ~1 s for a large vocabulary's first
        compile); native engine only."""
        schema, regex = req.json_schema(), req.regex()
        if schema is None and regex is None:
            return None
        param = regex[1] if regex is not None else "response_format"
        if not self.continuous:
            raise RequestError(f"{param} needs the native engine (tiller serve --engine native): constrained "
                               "decoding runs in its continuous batcher", param)
        try:
            with self._compiler_lock:
                if self._compiler is None:
                    model = self.batcher.engine.weights.module
                    self._compiler = GrammarCompiler(self.tokenizer, model.config.vocab_size)
            if regex is not None:
                return self._compiler.regex(regex[0])
            return self._compiler.json_schema(schema)
        except GrammarError as err:
            if regex is None and req.response_format.get("type") == "json_schema":
                param = "response_format.json_schema"
            raise RequestError(f"{param}: {err}", param) from None

    # ------------------------------------------------------------------------------------ helpers
    def check_model(self, requested: str | None) -> None:
        if requested and requested != self.name:
            raise RequestError(f"The model `{requested}` does not exist; this server serves `{self.name}`",
                               "model", status=404, code="model_not_found")

    def limits(self) -> str:
        """The request limits, one line (printed at start-up)."""
        return (f"requests waiting or running <= {self.batcher.max_queue}, n <= {self.max_n}, prompts per request <= {self.max_prompts_per_request}, prompts x n x max_tokens "
                f"<= {self.max_request_tokens}, prompt + max_tokens <= {self.max_model_len} tokens")

    def check_prompt_count(self, count: int) -> None:
        if count > self.max_prompts_per_request:
            raise RequestError(f"{count} prompts in one request; this server takes at most "
                               f"{self.max_prompts_per_request} (--max-prompts-per-request)", "prompt")

    def sampling(self, req: SamplingFields, max_tokens: int | None, prompt_lens: list[int]) -> SamplingParams:
        req.check_supported()
        if req.n > self.max_n:
            raise RequestError(f"n={req.n} is over this server's limit of {self.max_n} (--max-n)", "n")
        longest = max(prompt_lens)
        room = self.max_model_len - longest
        if room < 1:
            raise RequestError(f"the prompt has {longest} tokens; the model's context is {self.max_model_len}",
                               "messages" if isinstance(req, ChatCompletionRequest) else "prompt")
        if max_tokens is None:
            max_tokens = min(self.max_tokens_default, room)
        elif max_tokens > room:
            raise RequestError(f"max_tokens={max_tokens} + prompt ({longest} tokens) exceeds the model's context "
                               f"of {self.max_model_len} tokens", "max_tokens")
        budget = len(prompt_lens) * req.n * max_tokens
        if budget > self.max_request_tokens:
            raise RequestError(f"prompts x n x max_tokens = {len(prompt_lens)} x {req.n} x {max_tokens} = {budget} "
                               f"tokens is over this server's limit of {self.max_request_tokens} per request "
                               "(--max-request-tokens)", "max_tokens")
        for name, value in self.fixed_sampling.items():
            if name in req.model_fields_set and getattr(req, name) != value:
                raise RequestError(f"{name}={getattr(req, name)} differs from the trainer's rollout {name}={value} "
                                   "(the trained logprobs must be those of the sampling distribution): leave it "
                                   "out or set it to the rollout's value", name)
            setattr(req, name, value)
        vocab = self.vocab_size()
        stop_ids = tuple(int(t) for t in req.stop_token_ids or ())
        if any(not 0 <= t < vocab for t in stop_ids):
            raise RequestError(f"stop_token_ids must be token ids in [0, {vocab})", "stop_token_ids")
        greedy = req.temperature == 0.0
        params = SamplingParams(n=req.n, temperature=1.0 if greedy else req.temperature, top_p=req.top_p,
                                top_k=req.top_k, min_p=req.min_p, max_new_tokens=max_tokens, do_sample=not greedy,
                                stop=tuple(req.stop_list()), seed=req.seed, ignore_eos=req.ignore_eos,
                                repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                                frequency_penalty=req.frequency_penalty, stop_token_ids=stop_ids)
        try:
            params.validate()
        except UserError as err:
            raise RequestError(str(err)) from None
        return params

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render_chat(self, req: ChatCompletionRequest) -> tuple[list[int], dict | None]:
        """(prompt ids, None) or, for a chat with images, (ids with the image tokens, its pixel_values /
        image_grid_thw from the processor)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template; use /v1/completions", "messages")
        if req.tool_choice not in (None, "auto", "none"):
            raise RequestError("tool_choice must be 'auto' or 'none' (forcing a tool is not supported)",
                               "tool_choice")
        images: list | None = [] if self.processor is not None else None  # None: a text model, image parts refused
        messages, tools = prepare_messages(req.text_messages(functools.partial(message_content, images=images)),
                                           req.tools, self.tokenizer.chat_template)
        variables = {**self.chat_template_kwargs, **(req.chat_template_kwargs or {})}
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools,
                                                      add_generation_prompt=req.add_generation_prompt, tokenize=False,
                                                      **variables)
        except RequestError:
            raise
        except Exception as err:  # jinja errors from the model's own template
            raise RequestError(f"the chat template rejected the messages: {err}", "messages") from None
        if images:
            return self.encode_images(text, images)
        ids = self.encode_text(text)
        if not ids:
            raise RequestError("the rendered prompt is empty", "messages")
        return ids, None

    def encode_images(self, text: str, images: list) -> tuple[list[int], dict]:
        """The rendered chat and its images through the processor: (ids, {"pixel_values", "image_grid_thw"})."""
        if "multi_modal" not in inspect.signature(self.batcher.engine.generate).parameters:
            raise RequestError(f"this server's engine ({type(self.batcher.engine).__name__}) takes text prompts "
                               "only; serve a vision-language model with --engine native or hf", "messages")
        try:
            enc = encode_image_prompt(self.processor, text, images, where="messages")
        except DataError as err:
            raise RequestError(str(err), "messages") from None
        return enc.prompt_ids, {"pixel_values": enc.pixel_values, "image_grid_thw": enc.image_grid_thw}

    def vocab_size(self) -> int:
        return len(self.tokenizer)

    async def generate(self, prompts: list[list[int]], sampling: SamplingParams, *, logit_bias: dict | None = None,
                       top_logprobs: int = 0, top_param: str = "top_logprobs",
                       grammar: Grammar | None = None, multi_modal: list[dict | None] | None = None) -> RolloutOutput:
        episode = CURRENT_EPISODE.get()
        if self.recorder is not None:
            self.recorder.check(episode)
        vocab = self.vocab_size()
        for p in prompts:
            if min(p) < 0 or max(p) >= vocab:
                raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        extra = {}
        if logit_bias or top_logprobs:
            for name, value in (("logit_bias", logit_bias), (top_param, top_logprobs)):
                if value and not self.continuous:
                    raise RequestError(f"{name} needs the native engine (tiller serve --engine native)", name)
            extra = dict(logit_bias=logit_bias, top_logprobs=top_logprobs)
        if grammar is not None:
            extra["grammar"] = grammar  # self.grammar() refused it unless the batcher is continuous
        if multi_modal is not None and any(m is not None for m in multi_modal):
            extra["multi_modal"] = multi_modal  # encode_images() refused it unless the engine takes images
        try:
            future = self.batcher.submit(prompts, sampling, **extra)
        except (QueueFull, RowsFull) as err:
            raise RequestError(str(err), None, status=429, code="queue_full") from None
        try:
            out = await asyncio.wrap_future(future)  # cancelling this await cancels the queued job
        except asyncio.CancelledError:  # the client left: a running request's rows leave the batch too
            if isinstance(future, RequestFuture):
                future.abandon()
            raise
        if self.recorder is not None:
            self.recorder.record(episode, out, self.policy_version)
        return out

    def top_pairs(self, out: RolloutOutput, row: int, k: int, as_ids: bool = False) -> list[list[tuple[str, float]]]:
        """Per generated token of `row`, its top-k (token text, logprob) pairs (empty lists when k = 0)."""
        tops = getattr(out, "top_logprobs", None)
        if not k or not tops:
            return [[] for _ in out.response_ids[row]]
        return [[(self.token_text(t, as_ids), float(lp)) for t, lp in step] for step in tops[row]]

    def finish_text(self, ids: list[int], stops: tuple[str, ...], req: SamplingFields | None = None) -> str:
        """Decoded text (without special tokens unless the request's skip_special_tokens is False), cut before the
        first stop string; a final token from the request's stop_token_ids is left out, as vLLM does. With
        include_stop_str_in_output both stay."""
        keep = bool(req is not None and req.include_stop_str_in_output)
        if ids and req is not None and ids[-1] in (req.stop_token_ids or ()) and not keep:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=req is None or req.skip_special_tokens)
        hits = [(text.find(s), s) for s in stops if s in text]
        if not hits:
            return text
        at, stop = min(hits)
        return text[:at + len(stop)] if keep else text[:at]

    def token_text(self, token: int, as_id: bool = False) -> str:
        """A token as logprob entries name it: its text, or `token_id:<id>` (`return_tokens_as_token_ids`)."""
        return f"token_id:{token}" if as_id else self.tokenizer.decode([token], skip_special_tokens=False)

    def token_logprobs(self, ids: list[int], logprobs: list[float], as_ids: bool = False) -> list[tuple[str, float]]:
        return [(self.token_text(t, as_ids), float(lp)) for t, lp in zip(ids, logprobs)]


def _usage(prompts: list[list[int]], out: RolloutOutput) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = out.num_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _text_deltas(served: ServedModel, ids: list[int], final: str) -> list[str]:
    """Pieces of `final`, one per token where the token's text is complete; they concatenate to `final`."""
    pieces, emitted = [], 0
    for i in range(1, len(ids) + 1):
        prefix = served.tokenizer.decode(ids[:i], skip_special_tokens=True)
        if final.startswith(prefix) and len(prefix) > emitted:
            pieces.append(final[emitted:len(prefix)])
            emitted = len(prefix)
    if emitted < len(final):
        pieces.append(final[emitted:])
    return pieces


# ------------------------------------------------------------------------------------------- chat
async def chat_completion(served: ServedModel, req: ChatCompletionRequest) -> dict | Any:
    served.check_model(req.model)
    if req.top_logprobs and not req.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    # rendering, decoding images and tokenizing a long prompt stay off the event loop
    prompt, images = await asyncio.to_thread(served.render_chat, req)
    sampling = served.sampling(req, req.max_completion_tokens or req.max_tokens, [len(prompt)])
    top_k = req.top_logprobs or 0
    grammar = await asyncio.to_thread(served.grammar, req)
    out = await served.generate([prompt], sampling, logit_bias=req.token_bias(served.vocab_size()),
                                top_logprobs=top_k, grammar=grammar, multi_modal=[images])
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    choices = []
    for i in range(len(out)):
        text = served.finish_text(out.response_ids[i], sampling.stop, req)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reason = out.finish_reason[i]
        if req.tools and req.tool_choice != "none":
            parse_text = text
            if served.tool_call_parser in KEEP_SPECIAL_TOKENS:  # (their tags may be special tokens)
                parse_text = served.tokenizer.decode(out.response_ids[i], skip_special_tokens=False)
            content, calls = extract_tool_calls(parse_text, served.tool_call_parser, req.tools)
            if req.parallel_tool_calls is False:
                calls = calls[:1]
            if calls:
                message, reason = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": reason, "logprobs": None}
        if req.logprobs:
            as_ids = req.return_tokens_as_token_ids
            tops = served.top_pairs(out, i, top_k, as_ids)
            choice["logprobs"] = {"content": [
                {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for t, v in top]}
                for (tok, lp), top in zip(served.token_logprobs(out.response_ids[i], out.logprobs[i], as_ids), tops)]}
        choices.append(choice)
    body = {"id": rid, "object": "chat.completion", "created": created, "model": served.name,
            "choices": choices, "usage": _usage([prompt], out)}
    if req.stream:
        return _stream_chat(served, body, out, req)
    return body


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def _stream_chat(served: ServedModel, body: dict, out: RolloutOutput, req: ChatCompletionRequest):
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": served.name}
    include_usage = bool((req.stream_options or {}).get("include_usage"))

    def events():
        for choice in body["choices"]:
            i = choice["index"]
            yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
            message = choice["message"]
            calls = message.get("tool_calls")
            pieces = (_text_deltas(served, out.response_ids[i], message["content"]) if calls is None
                      else [message["content"] or ""])
            for piece in filter(None, pieces):
                yield _sse({**base, "choices": [{"index": i, "delta": {"content": piece}, "logprobs": None,
                                                 "finish_reason": None}]})
            if calls:
                deltas = [{"index": k, **c} for k, c in enumerate(calls)]
                yield _sse({**base, "choices": [{"index": i, "delta": {"tool_calls": deltas}, "logprobs": None,
                                                 "finish_reason": None}]})
            yield _sse({**base, "choices": [{"index": i, "delta": {}, "logprobs": choice["logprobs"],
                                             "finish_reason": choice["finish_reason"]}]})
        if include_usage:
            yield _sse({**base, "choices": [], "usage": body["usage"]})
        yield _sse("[DONE]")

    return events()


# ------------------------------------------------------------------------------------ completions
async def completion(served: ServedModel, req: CompletionRequest) -> dict | Any:
    served.check_model(req.model)
    if req.best_of is not None and req.best_of != req.n:
        raise RequestError("best_of other than n is not supported", "best_of")
    if req.suffix:
        raise RequestError("suffix is not supported", "suffix")
    raw = req.prompt_list()
    served.check_prompt_count(len(raw))
    prompts = await asyncio.to_thread(lambda: [served.encode_text(p) if isinstance(p, str) else list(p) for p in raw])
    if any(not p for p in prompts):
        raise RequestError("a prompt tokenizes to 0 tokens", "prompt")
    sampling = served.sampling(req, req.max_tokens, [len(p) for p in prompts])
    top_k = req.logprobs or 0
    grammar = await asyncio.to_thread(served.grammar, req)
    out = await served.generate(prompts, sampling, logit_bias=req.token_bias(served.vocab_size()),
                                top_logprobs=top_k, top_param="logprobs", grammar=grammar)
    rid, created, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), sampling.n
    choices = []
    for i in range(len(out)):
        text = served.finish_text(out.response_ids[i], sampling.stop, req)
        if req.echo:
            text = served.tokenizer.decode(prompts[i // n], skip_special_tokens=False) + text
        choice: dict[str, Any] = {"index": i, "text": text, "finish_reason": out.finish_reason[i], "logprobs": None}
        if req.logprobs is not None:
            as_ids = req.return_tokens_as_token_ids
            pairs = served.token_logprobs(out.response_ids[i], out.logprobs[i], as_ids)
            offsets, pos = [], 0
            for tok, _ in pairs:
                offsets.append(pos)
                pos += len(tok)
            tops = [dict(top) for top in served.top_pairs(out, i, top_k, as_ids)] if top_k else None
            choice["logprobs"] = {"tokens": [t for t, _ in pairs], "token_logprobs": [lp for _, lp in pairs],
                                  "top_logprobs": tops, "text_offset": offsets}
        choices.append(choice)
    body = {"id": rid, "object": "text_completion", "created": created, "model": served.name, "choices": choices,
            "usage": _usage(prompts, out)}
    if req.stream:
        return _stream_completion(served, body, out, req)
    return body


def _stream_completion(served: ServedModel, body: dict, out: RolloutOutput, req: CompletionRequest):
    base = {"id": body["id"], "object": "text_completion", "created": body["created"], "model": served.name}
    include_usage = bool((req.stream_options or {}).get("include_usage"))

    def events():
        for choice in body["choices"]:
            i = choice["index"]
            for piece in _text_deltas(served, out.response_ids[i], choice["text"]) if not req.echo else [choice["text"]]:
                yield _sse({**base, "choices": [{"index": i, "text": piece, "logprobs": None, "finish_reason": None}]})
            yield _sse({**base, "choices": [{"index": i, "text": "", "logprobs": choice["logprobs"],
                                             "finish_reason": choice["finish_reason"]}]})
        if include_usage:
            yield _sse({**base, "choices": [], "usage": body["usage"]})
        yield _sse("[DONE]")

    return events()


# ------------------------------------------------------------------------------------------- app
class ClientGone(Exception):
    """The client disconnected before its reply was ready."""


async def unless_client_leaves(request, work, poll_s: float = 0.2):
    """Await `work`, checking every `poll_s` whether the client is still connected; if it left, cancel the work
    (a queued engine job is dropped; see `MicroBatcher`) and return a 499 nobody reads."""
    from fastapi.responses import JSONResponse

    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            return JSONResponse(status_code=499, content={"error": {"message": "client closed the request",
                                                                    "type": "invalid_request_error",
                                                                    "param": None, "code": "client_closed"}})


def create_app(served: ServedModel):
    """The FastAPI app around a `ServedModel` (its batcher thread is closed on shutdown)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    @asynccontextmanager
    async def lifespan(app):
        yield
        served.batcher.close()

    app = FastAPI(title="tiller OpenAI-compatible server", lifespan=lifespan)

    def error(status: int, message: str, param: str | None, code: str | None = None) -> JSONResponse:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse(status_code=status,
                            content={"error": {"message": message, "type": kind, "param": param, "code": code}})

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        return error(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        return error(exc.status, str(exc), exc.param, exc.code)

    @app.exception_handler(UserError)
    async def on_user_error(request: Request, exc: UserError):
        return error(400, str(exc), None)

    def respond(result):
        if isinstance(result, (dict, Response)):
            return result
        return StreamingResponse(result, media_type="text/event-stream")

    @app.get("/health")
    async def health():
        queue = served.batcher.pending
        if served.batcher.overloaded:
            return JSONResponse(status_code=503, content={"status": "overloaded", "queue": queue})
        return {"status": "ok", "queue": queue}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                            "owned_by": "tiller", "max_model_len": served.max_model_len}]}

    @app.get("/stats")
    async def stats() -> dict:
        return dict(served.batcher.stats)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        return respond(await unless_client_leaves(request, chat_completion(served, req)))

    @app.post("/v1/completions")
    async def complete(req: CompletionRequest, request: Request):
        return respond(await unless_client_leaves(request, completion(served, req)))

    return app


def agent_app(engine, tokenizer, recorder: EpisodeRecorder, *, max_model_len: int, max_tokens_default: int,
              max_rows: int):
    """(served, app): the OpenAI app an agent rollout trains through (`tiller.rollout.agent_endpoint.AgentEndpoint`
    starts it), every completion recorded by `recorder` under its episode; a request outside a live episode
    is answered 404."""
    from fastapi.responses import JSONResponse

    served = ServedModel(engine, tokenizer, name="policy", max_model_len=max_model_len,
                         max_tokens_default=max_tokens_default, max_batch_prompts=max_rows, max_queue=1 << 16,
                         max_prompts_per_request=max_rows)
    served.recorder = recorder
    app = create_app(served)

    async def not_found(request, exc: EpisodeNotFound):
        return JSONResponse(status_code=404, content={"error": {"message": str(exc), "type": "invalid_request_error",
                                                                "param": None, "code": "episode_not_found"}})

    app.add_exception_handler(EpisodeNotFound, not_found)
    return served, app
