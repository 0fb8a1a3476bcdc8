"""Continuous batching over the native engine's model: requests join and leave the running batch between
decode steps (Yu et al. 2022, "Orca"; vLLM's scheduler is the model), each row with its own sampling
settings (penalties included), `logit_bias`, top-k logprobs, optional grammar (constrained decoding) and, when
seeded, its own `torch.Generator`.

`ContinuousBatcher(engine).submit(prompt_ids, sampling, logit_bias=..., top_logprobs=..., grammar=...)` returns a
`Future[DetailedOutput]`; one daemon thread owns the model and loops:

1. admit waiting jobs while rows are free (`max_rows`): prefill their prompts (the native engine's chunked
   prefill, once per prompt; the `n` rows of a prompt copy its keys / values) into free slots of a
   preallocated slot cache; their first logits join the batch's;
2. sample one token for every live row (`sampling.warp_logits` per settings group; a seeded row's uniform
   comes from its own generator, the others' from the batcher's), record the logprob (and the top-k); a row
   with a grammar first has the tokens its matcher forbids set to -inf, and its matcher consumes the token
   drawn (`tiller.rollout.constrained`; no mask work at all while no live row has a grammar);
3. rows that hit a stop token / stop string / their `max_new_tokens` leave; the last live rows move into
   their slots (one row's cache copied, never the whole batch), so live rows stay at the front;
4. one decode step for the live rows (the fused Llama / Qwen2 step where supported; with the engine's
   `static_decode`, the static step of `tiller.rollout.graphed_decode`, replayed from CUDA graphs on a GPU: the
   host admits, samples and retires rows between replays).

Slot cache layout: keys / values [S, H, L, D] per layer (S = max_rows slots, L grows by doubling); row r's
tokens occupy columns [start_r, end_r) and the next token is written at column end_r, so rows of
different ages share a step; the attention mask is `start_r <= column <= end_r`; positions are
`len(prompt) + generated - 1` as in HF `generate`.

Seeded rows: the row j of a request with `seed` s draws from `Generator().manual_seed(s * 1_000_003 + j)`,
one uniform per step, so its tokens do not depend on what else runs (up to float rounding of batched
matmuls, which in fp32 does not change a draw in practice: tested). Unseeded rows share one generator.

Semantics (as `tiller.rollout.base`): logprobs are those of the sampling distribution after `logit_bias`, the
penalties (repetition, presence, frequency: `sampling.apply_penalties`), the grammar's mask, temperature, top-k,
top-p and min-p; greedy reports `log_softmax(penalised(logits + bias) + mask)` (mask 0 or -inf). With a grammar
these are the logprobs of the constrained distribution the tokens were drawn from, which is what RL trains on. A constrained row also ends at the
grammar's eos (allowed only once the text is complete) even with `ignore_eos`.

Letters: `B` live rows, `S` slots, `H` kv heads, `L` cache columns, `D` head dim, `V` vocabulary.
"""

from __future__ import annotations

import queue
from collections import OrderedDict
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from tiller.models.layer_masks import has_recurrent_layers, layout_of
from tiller.models.loading import cache_keyword
from tiller.rollout.base import (
    param_versions,
    RolloutOutput,
    SamplingParams,
    StopStringWatcher,
    check_prompts,
    eval_mode,
    finalize_row,
    pad_token_id,
    stop_ids_for,
)
from tiller.rollout.constrained import Grammar, Matcher, allowed_tokens
from tiller.rollout.graphed_decode import capture_sizes, SlotStep
from tiller.rollout.images import ImagePrompts, check_multi_modal, next_positions, suppress_vision_tokens
from tiller.rollout.images import vision_ids_tensor
from tiller.rollout.native import KVBuffer, NativeRolloutEngine, prefill_inputs
from tiller.rollout.sampling import apply_penalties, draw_with_uniforms, token_counts, warp_logits

MAX_TOP_LOGPROBS = 20


@dataclass
class DetailedOutput(RolloutOutput):
    """`RolloutOutput` plus, per row and generated token, the `top_logprobs` most likely (token id, logprob)
    pairs of the sampling distribution (empty lists when none were asked for)."""

    top_logprobs: list[list[list[tuple[int, float]]]] = field(default_factory=list)


class QueueFull(Exception):
    """More requests are waiting or running than the batcher takes (`max_queue`): the server answers 429."""


class RequestFuture(Future):
    """A request's future. `abandon()` drops the request: one still waiting is cancelled, one already running
    has its rows leave the batch at the next decode step (its client disconnected; nobody reads the result)."""

    def __init__(self):
        super().__init__()
        self.abandoned = False

    def abandon(self) -> None:
        if not self.cancel():
            self.abandoned = True


@dataclass
class _Job:
    prompt_ids: list[list[int]]
    sampling: SamplingParams
    logit_bias: dict[int, float]
    top_logprobs: int
    grammar: Grammar | None = None
    multi_modal: list[dict | None] | None = None  # per prompt: None (text) or its pixel_values / image_grid_thw
    first_positions: list[int] = field(default_factory=list)  # per prompt: its first response token's position
    future: RequestFuture = field(default_factory=RequestFuture)
    rows: list["_Row"] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)
    watcher: StopStringWatcher | None = None


@dataclass
class _Row:
    job: _Job
    prompt: list[int]
    generator: torch.Generator | None
    matcher: Matcher | None = None  # a constrained row's own grammar state
    position_offset: int = 0  # an image prompt's M-RoPE delta: positions are len(prompt) + t + this
    start: int = 0
    end: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per token: the weights' version of its logits
    done: bool = False
    result: tuple | None = None
    penalty: tuple | None = None  # penalised rows: (prompt_seen [V], output counts [V], tokens counted so far)

    def penalty_state(self, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_seen [V] bool, output counts [V]) for `apply_penalties`, kept across steps: the prompt's set is
        built once and only the tokens sampled since the last call are counted (O(new tokens) a step)."""
        if self.penalty is None or self.penalty[1].device != torch.device(device) or self.penalty[2] > len(self.tokens):
            self.penalty = (token_counts([self.prompt], vocab, device)[0] > 0,
                            torch.zeros(vocab, dtype=torch.float32, device=device), 0)
        seen, counts, counted = self.penalty
        if counted < len(self.tokens):
            new = torch.tensor(self.tokens[counted:], dtype=torch.long, device=counts.device)
            counts.index_add_(0, new, torch.ones(len(new), device=counts.device))
            self.penalty = (seen, counts, len(self.tokens))
        return seen, counts

    def sampling_key(self) -> tuple:
        s = self.job.sampling
        return (s.do_sample, s.temperature, s.top_k, s.top_p, s.min_p)


class SlotCache(KVBuffer):
    """The slot cache (see the module docstring). In decode mode `update` writes each row's new key at its
    own column `write_cols[r]` and returns keys / values of the live rows over columns [0, key_len). A recurrent
    layer's (Qwen3.5's Gated DeltaNet, Mamba) per-slot state: the live rows' states are the first slots' (a view,
    which the layer's one-token step updates in place)."""

    def __init__(self, slots: int, device: torch.device):
        super().__init__(slots, 0, device)
        self.write_cols: torch.Tensor | None = None
        self.key_len = 0
        self.live = 0
        self.states: dict[tuple, torch.Tensor] = {}

    def ensure(self, like: KVBuffer, columns: int) -> None:
        """Allocate (from a prefilled buffer's shapes) or grow to at least `columns` columns (doubling)."""
        if not self.keys and not self.states:
            self.max_len = max(64, columns)
            for k in like.keys:
                if k is None:  # a recurrent layer
                    self.keys.append(None)
                    self.values.append(None)
                    continue
                shape = (self.batch, k.shape[1], self.max_len, k.shape[3])
                self.keys.append(torch.zeros(shape, dtype=k.dtype, device=self.device))
                self.values.append(torch.zeros(shape, dtype=k.dtype, device=self.device))
            for key, state in like.__dict__.get("states", {}).items():
                self.states[key] = torch.zeros((self.batch, *state.shape[1:]), dtype=state.dtype, device=self.device)
            return
        if columns <= self.max_len:
            return
        new_len = max(columns, 2 * self.max_len)
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                if old is None:
                    continue
                new = torch.zeros((*old.shape[:2], new_len, old.shape[3]), dtype=old.dtype, device=old.device)
                new[:, :, : self.max_len] = old
                bufs[i] = new
        self.max_len = new_len

    def _state(self, kind: str, layer_idx: int, state_idx: int):
        state = self.states.get((kind, layer_idx, state_idx))
        return None if state is None else state[: self.live]

    def _store(self, kind: str, layer_idx: int, state_idx: int, state: torch.Tensor) -> torch.Tensor:
        self.states[(kind, layer_idx, state_idx)][: self.live].copy_(state)
        return state

    def set_write_cols(self, cols: torch.Tensor) -> None:
        """The decode step's write column per live row; its flat row index into a [S * H * L, D] view of every
        layer's buffer is computed here once per step (all layers share the shape)."""
        self.write_cols, self.live = cols, cols.shape[0]
        like = next((k for k in self.keys if k is not None), None)
        if like is None:  # every layer recurrent: no keys to write
            return
        b, (_, h, length, _) = cols.shape[0], like.shape
        heads = torch.arange(h, device=cols.device)
        rows = torch.arange(b, device=cols.device)
        self._flat = ((rows[:, None] * h + heads[None, :]) * length + cols[:, None]).reshape(-1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        b, d = key_states.shape[0], key_states.shape[-1]
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        # one index_copy_ per buffer: row r, head h, column write_cols[r]
        k_buf.view(-1, d).index_copy_(0, self._flat, key_states.reshape(-1, d))
        v_buf.view(-1, d).index_copy_(0, self._flat, value_states.reshape(-1, d))
        return k_buf[:b, :, : self.key_len], v_buf[:b, :, : self.key_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(0, self.key_len - 1)  # columns before the one being written (HF's cache_position)

    def move_rows(self, src: list[int], dst: list[int], columns: int) -> None:
        """Copy rows `src` into slots `dst` (disjoint sets), columns [0, columns)."""
        s, d = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for bufs in (self.keys, self.values):
            for buf in bufs:
                if buf is not None:
                    buf[d, :, :columns] = buf[s, :, :columns]
        for state in self.states.values():
            state[d] = state[s]


class PromptCache:
    """Keys / values and last-position logits of recently prefilled prompts, so the same prompt again (another
    request of a GRPO group, an agent's first turn n times, a retry) joins the batch without a prefill; prompts
    repeated within one admission are prefilled once. LRU, bounded by `max_bytes`; emptied whenever the weights
    change (entries are only valid for the weights that computed them). vLLM's automatic prefix caching reuses
    full cache blocks of any shared prefix; here a prompt that shares at least `MIN_PREFIX` leading tokens with a
    cached one (a system prompt, an agent's earlier turn) reuses that prefix's keys / values and prefills only the
    rest, token-granular."""

    MIN_PREFIX = 16

    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self.entries: OrderedDict[tuple, tuple] = OrderedDict()  # prompt -> (keys, values, logits)
        self.arrays: dict[tuple, np.ndarray] = {}  # prompt -> its ids as an array (prefix matching)
        self.bytes = 0
        self._weights: tuple | None = None

    def check_weights(self, versions: tuple) -> None:
        if versions != self._weights:
            self.entries.clear()
            self.arrays.clear()
            self.bytes = 0
            self._weights = versions

    def longest_prefix(self, prompt: list[int]) -> tuple[tuple | None, int]:
        """(the cached prompt sharing the most leading tokens with `prompt`, how many), at most len(prompt) - 1
        (the last token is always run: its logits are the first sample's); (None, 0) below MIN_PREFIX."""
        best, best_len = None, 0
        if len(prompt) <= self.MIN_PREFIX:
            return None, 0
        new = np.asarray(prompt, dtype=np.int64)
        for key in self.entries:
            m = min(len(key), len(new) - 1)
            if m < max(self.MIN_PREFIX, best_len + 1):
                continue
            same = self.arrays[key][:m] == new[:m]
            shared = m if same.all() else int(same.argmin())
            if shared > best_len:
                best, best_len = key, shared
        return (best, best_len) if best_len >= self.MIN_PREFIX else (None, 0)

    def get(self, prompt: tuple):
        entry = self.entries.get(prompt)
        if entry is not None:
            self.entries.move_to_end(prompt)
        return entry

    def put(self, prompt: tuple, keys: list[torch.Tensor], values: list[torch.Tensor], logits: torch.Tensor) -> None:
        size = sum(t.nbytes for t in (*keys, *values, logits))
        if size > self.max_bytes or prompt in self.entries:
            return
        while self.bytes + size > self.max_bytes:
            gone, old = self.entries.popitem(last=False)
            del self.arrays[gone]
            self.bytes -= sum(t.nbytes for t in (*old[0], *old[1], old[2]))
        self.entries[prompt] = (keys, values, logits)
        self.arrays[prompt] = np.asarray(prompt, dtype=np.int64)
        self.bytes += size


class ContinuousBatcher:
    """`submit(...) -> Future[DetailedOutput]`; a daemon thread decodes all live rows together.

    At most `max_queue` requests wait or run at once (`submit` raises `QueueFull` past it); a request whose
    future is cancelled before it is admitted is dropped (`stats["dropped"]`); an admitted one whose future is
    abandoned (`RequestFuture.abandon`: its client left) leaves the batch at the next decode step, its rows
    freed (`stats["abandoned"]`), else it runs to its end. Stats: requests, prompts, tokens, steps, dropped,
    abandoned, peak_rows, prefills_in_decode (admissions that ran
    in a decode pass), prompt_cache_hits (prompts that needed no prefill: cached or repeated within an
    admission, see `PromptCache`; `prompt_cache_mb=0` turns both off), prompt_cache_prefix_tokens (prompt tokens
    not prefilled because a cached prompt shared them), idle_s (seconds with no live row, waiting
    for a request), prefill_s / decode_s / sample_s (seconds in each part of the loop), static_steps (decode
    steps on the engine's static step: CUDA graph replays on a GPU).

    `weights_hook` (asynchronous RL's partial rollouts, as the native engine's `generate`; settable while no
    request runs): called in the batcher's thread before every forward (prefill or decode step); it may load
    newer weights into the engine's module (re-read here: cast copy, fused decoder; the KV cache is kept) and
    returns the version in use, recorded per token in the outputs' `token_versions`; it may raise to abort
    every running and waiting request. It turns the static step off (its graphs hold the old weights).
    """

    def __init__(self, engine: NativeRolloutEngine, *, max_rows: int = 64, max_queue: int = 256,
                 prompt_cache_mb: float = 64.0, weights_hook=None):
        if not isinstance(engine, NativeRolloutEngine):
            raise TypeError("ContinuousBatcher drives the native engine's model")
        self.engine = engine
        self.max_rows = max(1, int(max_rows))
        self.max_queue = max(1, int(max_queue))
        self.pending = 0
        self._pending_lock = threading.Lock()
        self.queue: queue.Queue[_Job | None] = queue.Queue()
        self.stats = {"requests": 0, "prompts": 0, "tokens": 0, "steps": 0, "dropped": 0, "abandoned": 0,
                      "peak_rows": 0,
                      "prefills_in_decode": 0, "prompt_cache_hits": 0, "prompt_cache_prefix_tokens": 0,
                      "idle_s": 0.0,
                      "prefill_s": 0.0, "decode_s": 0.0, "sample_s": 0.0, "static_steps": 0}
        model = engine.weights.module
        # a recurrent layer's state after a prompt is not cached (nor extended by a longer prompt): no prompt cache
        self.prompt_cache = PromptCache(0 if has_recurrent_layers(model) else int(prompt_cache_mb * (1 << 20)))
        self._layout = layout_of(model)  # each layer kind's mask (sliding windows, recurrent layers)
        self._waiting: _Job | None = None  # a job taken from the queue that did not fit yet
        self._rows: list[_Row] = []
        self._logits: torch.Tensor | None = None  # [B, V] of the live rows, to sample from next
        self._cache: SlotCache | None = None
        model = engine.weights.module
        self._device = next(model.parameters()).device
        self._shared = torch.Generator(device=self._device).manual_seed(engine.generator_seed)
        self._vision_ids = vision_ids_tensor(model, self._device)  # never sampled (a vision-language model)
        self._closing = False
        self.weights_hook = weights_hook
        self._version = self._logits_version = -1  # weights_hook's version now / when self._logits were computed
        self._thread = threading.Thread(target=self._loop, name="tiller-continuous-batcher", daemon=True)
        self._thread.start()

    @property
    def overloaded(self) -> bool:
        return self.pending >= self.max_queue

    def submit(self, prompt_ids: list[list[int]], sampling: SamplingParams, *,
               logit_bias: dict[int, float] | None = None, top_logprobs: int = 0,
               grammar: Grammar | None = None, multi_modal: list[dict | None] | None = None) -> Future:
        """Queue one request (`len(prompt_ids) * sampling.n` rows); raises `QueueFull` past `max_queue`.

        `grammar` (`tiller.rollout.constrained.Grammar`) constrains every row of the request, each with its own
        matcher (`sampling.regex` compiles into one when no grammar is given; both at once are refused).
        `multi_modal`: per prompt None or {"pixel_values", "image_grid_thw"} (a vision-language model;
        `tiller.rollout.images`): the vision tower runs in the prompt's prefill, and an image prompt is never
        shared with another prompt or kept in the prompt cache (its key would have to hold the pixels).
        """
        sampling.validate()
        if sampling.regex is not None:
            if grammar is not None:
                raise ValueError("a request takes one constraint: a grammar or sampling.regex, not both")
            grammar = self.engine.grammar_for(sampling.regex)
        model = self.engine.weights.module
        check_prompts(prompt_ids, model.get_input_embeddings().num_embeddings)
        multi_modal = check_multi_modal(model, prompt_ids, multi_modal)
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
        with self._pending_lock:
            if self.pending >= self.max_queue:
                raise QueueFull(f"{self.pending} requests are waiting or running; this server takes at most "
                                f"{self.max_queue} at once (--max-queue): retry later")
            self.pending += 1
        job = _Job([list(p) for p in prompt_ids], sampling, dict(logit_bias or {}), int(top_logprobs), grammar,
                   multi_modal, next_positions(model, prompt_ids, multi_modal))
        job.future.add_done_callback(self._done)
        self.queue.put(job)
        return job.future

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, **kwargs) -> DetailedOutput:
        """Blocking form of `submit` (the `RolloutEngine.generate` signature)."""
        return self.submit(prompt_ids, sampling, **kwargs).result()

    def _done(self, _future) -> None:
        with self._pending_lock:
            self.pending -= 1

    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        self.queue.put(None)
        self._thread.join(timeout)

    # --------------------------------------------------------------------------------- worker thread
    def _loop(self) -> None:
        engine = self.engine
        if engine.num_threads:
            torch.set_num_threads(engine.num_threads)
        while True:
            idle = not self._rows
            t0 = time.perf_counter() if idle else 0.0
            try:
                jobs = self._take_jobs(block=idle)
            except _Closed:
                self._fail_all(RuntimeError("the server is shutting down"))
                return
            if idle:
                self.stats["idle_s"] += time.perf_counter() - t0
            try:
                with torch.inference_mode():
                    if self.weights_hook is not None and (jobs or self._rows):  # before this pass's forwards
                        self._version = self.engine._new_weights(self.weights_hook, self._version)
                    if jobs and not self._rows:
                        self._admit(jobs)
                        jobs = []
                        self._logits_version = self._version
                    if self._rows:
                        self._step(jobs)  # samples from logits of _logits_version, then a forward at _version
                        self._logits_version = self._version
            except BaseException as err:  # noqa: BLE001 - the error belongs to the waiting requests
                self._fail_all(err, jobs)

    def _fail_all(self, err: BaseException, jobs: list[_Job] = ()) -> None:
        for job in {**{id(r.job): r.job for r in self._rows}, **{id(j): j for j in jobs}}.values():
            if not job.future.done():
                job.future.set_exception(err)
        self._rows, self._logits = [], None

    def _take_jobs(self, block: bool) -> list[_Job]:
        """Waiting jobs that fit in the free rows (the first one blocks when nothing runs)."""
        jobs, free = [], self.max_rows - len(self._rows)
        while True:
            job, self._waiting = self._waiting, None
            if job is None:
                try:
                    job = self.queue.get() if block and not jobs else self.queue.get_nowait()
                except queue.Empty:
                    return jobs
                if job is None:
                    raise _Closed
                if not job.future.set_running_or_notify_cancel():  # cancelled while waiting: its client left
                    self.stats["dropped"] += 1
                    continue
            elif job.future.abandoned:  # taken earlier, waited for rows, and its client left meanwhile
                self.stats["dropped"] += 1
                job.future.set_exception(RequestAbandoned("the request was abandoned before it ran"))
                continue
            size = len(job.prompt_ids) * job.sampling.n
            if size > free and (jobs or self._rows):
                self._waiting = job  # wait for rows to free up (a job larger than max_rows runs alone)
                return jobs
            jobs.append(job)
            free -= size

    def _sync_weights(self):
        """The module to run (new weights read if the trainer changed them) with its fused decoder synced."""
        engine = self.engine
        engine.weights.sync_if_stale()
        model = engine.weights.module
        engine.fused_for(model)
        return model

    def _slot_step(self, model):
        """The engine's static decode step over the slot cache (`graphed_decode.SlotStep`; `static_decode`, CUDA
        graphs on a GPU), or None where the fused step applies instead (static decode off, no fused decoder for
        the model, a vision-language model's per-row position offsets)."""
        engine = self.engine
        fused = engine._fused if engine._fused is not None and engine._fused.model is model else None
        if not engine.static_decode or fused is None or self._vision_ids is not None or self.weights_hook is not None:
            return None
        step = getattr(self, "_slot", None)
        if step is None or step.fused is not fused:
            step = self._slot = SlotStep(fused, capture_sizes(self.max_rows, engine.capture_sizes),
                                         capture=engine.cuda_graphs, compile=engine.compile_decode)
        return step

    def _admit(self, jobs: list[_Job]) -> None:
        """Prefill the jobs' prompts into free slots; their first logits join `self._logits`."""
        engine = self.engine
        model = self._sync_weights()
        prompts, images = _prompts_of(jobs)
        width = max(len(p) for p in prompts)
        keys = _prompt_keys(prompts, images)
        todo, hits = self._lookup(model, prompts, keys)
        tmp, first = None, None
        if todo:
            tmp = KVBuffer(len(todo), width, self._device)
            todo_mm = [images[i] for i in todo] if images is not None else None
            with eval_mode(model):
                t0 = time.perf_counter()
                vision = None
                if todo_mm is not None and any(m is not None for m in todo_mm):
                    vision = ImagePrompts(model, [prompts[i] for i in todo], todo_mm)
                first = engine._prefill(model, [prompts[i] for i in todo], tmp, width, 1,
                                        pad_token_id(model, engine.tokenizer), vision)
                self.stats["prefill_s"] += time.perf_counter() - t0
        self._install(jobs, width, *self._assemble(prompts, keys, width, todo, tmp, first, hits))

    # --------------------------------------------------------------------------------- prompt cache
    def _lookup(self, model, prompts: list[list[int]], keys: list[tuple]) -> tuple[list[int], dict[tuple, tuple]]:
        """(the indices of the distinct prompts that need a prefill, cached entries of the others by key)."""
        cache = self.prompt_cache
        if not cache.max_bytes:  # off: every prompt is prefilled, repeats too
            return list(range(len(prompts))), {}
        cache.check_weights(param_versions(model))
        todo, hits, seen = [], {}, set()
        fused = self.engine._fused if self.engine._fused is not None and self.engine._fused.model is model else None
        for i, (p, key) in enumerate(zip(prompts, keys)):
            if key in seen:
                continue
            seen.add(key)
            if key != tuple(p):  # an image prompt: prefilled, never cached
                todo.append(i)
                continue
            entry = cache.get(key)
            if entry is None and fused is not None:
                base, shared = cache.longest_prefix(p)
                if base is not None:
                    entry = self._extend(model, fused, cache.get(base), shared, p)
                    cache.put(key, *entry)
                    self.stats["prompt_cache_prefix_tokens"] += shared
            if entry is not None:
                hits[key] = entry
            else:
                todo.append(i)
        self.stats["prompt_cache_hits"] += len(prompts) - len(todo)
        return todo, hits

    def _extend(self, model, fused, entry: tuple, shared: int, prompt: list[int]) -> tuple:
        """(keys, values, last logits) of `prompt` from a cached entry whose first `shared` tokens it shares:
        only the remaining tokens run, attending to the cached keys / values."""
        t0 = time.perf_counter()
        keys, values, _ = entry
        n, dev = len(prompt), self._device
        buf = KVBuffer(1, n, dev)
        for bufs, cached in ((buf.keys, keys), (buf.values, values)):
            for part in cached:
                new = torch.zeros((1, part.shape[0], n, part.shape[-1]), dtype=part.dtype, device=dev)
                new[0, :, :shared] = part[:, :shared]
                bufs.append(new)
        buf.write_pos = shared
        ids = torch.tensor([prompt[shared:]], device=dev)
        pos = torch.arange(shared, n, device=dev)[None]
        mask = (torch.arange(n, device=dev)[None, :] <= pos[0][:, None])[None, None]  # [1, 1, T, n] causal
        with eval_mode(model):
            last = fused.forward(ids, pos, mask, buf)[0]
        self.stats["prefill_s"] += time.perf_counter() - t0
        return [k[0] for k in buf.keys], [v[0] for v in buf.values], last

    def _assemble(self, prompts, prompt_keys, width, todo: list[int], tmp: KVBuffer | None, first,
                  hits) -> tuple[KVBuffer, torch.Tensor]:
        """Keys / values of every prompt (right-aligned at `width`, in order) and their first logits, from the
        prefill of prompts `todo` (indices; rows of `tmp` / `first`) and the cached `hits` (by `prompt_keys`);
        the prefilled text prompts are cached."""
        if tmp is not None and len(todo) == len(prompts):
            out, logits = tmp, first  # nothing cached, nothing repeated: as prefilled
        else:
            like = tmp.keys if tmp is not None else next(iter(hits.values()))[0]
            out = KVBuffer(len(prompts), width, self._device)
            for bufs, src in ((out.keys, like), (out.values, like)):
                for k in src:
                    h, d = k.shape[1] if tmp is not None else k.shape[0], k.shape[-1]
                    bufs.append(torch.zeros((len(prompts), h, width, d), dtype=k.dtype, device=self._device))
            row_of = {prompt_keys[i]: r for r, i in enumerate(todo)}
            logits = []
            for i, p in enumerate(prompts):
                key, n = prompt_keys[i], len(p)
                if key in row_of:
                    r = row_of[key]
                    for bufs, new in ((out.keys, tmp.keys), (out.values, tmp.values)):
                        for buf, part in zip(bufs, new):
                            buf[i, :, width - n :] = part[r, :, width - n :]
                    logits.append(first[r])
                else:
                    keys, values, last = hits[key]
                    for bufs, cached in ((out.keys, keys), (out.values, values)):
                        for buf, part in zip(bufs, cached):
                            buf[i, :, width - n :] = part
                    logits.append(last)
            logits = torch.stack(logits)
        if self.prompt_cache.max_bytes and tmp is not None:
            for r, i in enumerate(todo):
                p, n = prompts[i], len(prompts[i])
                if prompt_keys[i] != tuple(p):
                    continue  # an image prompt
                self.prompt_cache.put(tuple(p), [k[r, :, width - n :].clone() for k in tmp.keys],
                                      [v[r, :, width - n :].clone() for v in tmp.values], first[r].clone())
        return out, logits

    def _install(self, jobs: list[_Job], width: int, tmp: KVBuffer, first: torch.Tensor) -> None:
        """New rows for the jobs after the live ones: prefilled keys / values from `tmp` into their slots, first
        logits `first` [prompts, V] (one row per prompt, expanded to its n samples) appended to `self._logits`."""
        engine, model = self.engine, self.engine.weights.module
        total = len(self._rows) + sum(len(j.prompt_ids) * j.sampling.n for j in jobs)
        if self._cache is None or self._cache.batch < total:
            self._grow_slots(max(total, self.max_rows), tmp)
        self._cache.ensure(tmp, width + max(j.sampling.max_new_tokens for j in jobs) + 1)
        src, logits = [], []
        index = 0
        for job in jobs:
            job.stop_ids = stop_ids_for(model, engine.tokenizer, job.sampling)
            if job.grammar is not None:  # the grammar's eos ends the text, ignore_eos or not
                job.stop_ids = list(dict.fromkeys([*job.stop_ids, *job.grammar.eos_ids]))
            job.watcher = StopStringWatcher(engine.tokenizer, job.sampling.stop)
            for p, first_pos in zip(job.prompt_ids, job.first_positions):
                for j in range(job.sampling.n):
                    seed = job.sampling.seed
                    gen = None if seed is None else torch.Generator(device=self._device).manual_seed(
                        (int(seed) * 1_000_003 + len(job.rows)) % (1 << 63))
                    row = _Row(job, p, gen, start=width - len(p), end=width, position_offset=first_pos - len(p),
                               matcher=None if job.grammar is None else job.grammar.matcher())
                    job.rows.append(row)
                    self._rows.append(row)
                    src.append(index)
                logits.append(first[index : index + 1].expand(job.sampling.n, -1))
                index += 1
            self.stats["requests"] += 1
            self.stats["prompts"] += len(job.prompt_ids)
        dst = torch.arange(len(self._rows) - len(src), len(self._rows), device=self._device)
        s = torch.tensor(src, device=self._device)
        for bufs, new in ((self._cache.keys, tmp.keys), (self._cache.values, tmp.values)):
            for buf, part in zip(bufs, new):
                if buf is not None:
                    buf[dst, :, :width] = part[s]
        for key, state in tmp.__dict__.get("states", {}).items():
            self._cache.states[key][dst] = state[s]
        new_logits = torch.cat(logits)
        self._logits = new_logits if self._logits is None else torch.cat([self._logits, new_logits])
        self.stats["peak_rows"] = max(self.stats["peak_rows"], len(self._rows))

    def _grow_slots(self, slots: int, like: KVBuffer) -> None:
        old = self._cache
        self._cache = SlotCache(slots, self._device)
        self._cache.ensure(like, old.max_len if old is not None else 0)
        if old is not None and self._rows:
            n = len(self._rows)
            for new_bufs, old_bufs in ((self._cache.keys, old.keys), (self._cache.values, old.values)):
                for new, prev in zip(new_bufs, old_bufs):
                    if new is not None:
                        new[:n, :, : old.max_len] = prev[:n]
            for key, state in old.states.items():
                self._cache.states[key][:n] = state[:n]

    def _sample(self, logits: torch.Tensor) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
        """One token per live row: (tokens, logprobs, top-k pairs per row)."""
        rows = self._rows
        logits = suppress_vision_tokens(logits.float(), self._vision_ids)
        if any(r.job.logit_bias for r in rows):
            logits = logits.clone()
            for i, r in enumerate(rows):
                if r.job.logit_bias:
                    ids = torch.tensor(list(r.job.logit_bias), device=logits.device)
                    logits[i, ids] += torch.tensor(list(r.job.logit_bias.values()), device=logits.device)
        penalized = [i for i, r in enumerate(rows) if r.job.sampling.penalized]
        if penalized:  # after logit_bias, as vLLM orders them
            logits = logits.clone()
            vocab = logits.shape[-1]
            for i in penalized:
                s = rows[i].job.sampling
                seen, counts = rows[i].penalty_state(vocab, logits.device)
                logits[i] = apply_penalties(logits[i : i + 1], seen[None], counts[None], s.repetition_penalty,
                                            s.presence_penalty, s.frequency_penalty)[0]
        constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
        if constrained:
            allowed = allowed_tokens([(rows[i].matcher, rows[i].job.grammar) for i in constrained], logits.shape[-1])
            idx = torch.tensor(constrained, device=logits.device)
            logits = logits.index_put((idx,), logits[idx].masked_fill(~allowed.to(logits.device), float("-inf")))
        tokens = [0] * len(rows)
        logps = [0.0] * len(rows)
        tops: list[list[tuple[int, float]]] = [[] for _ in rows]
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(r.sampling_key(), []).append(i)
        for (do_sample, temperature, top_k, top_p, min_p), idx in groups.items():
            part = logits[idx]
            if do_sample:
                logp = torch.log_softmax(warp_logits(part, temperature, top_k, top_p, min_p), dim=-1)
                u = torch.empty((len(idx), 1), dtype=torch.float64, device=logits.device)
                shared = [k for k, i in enumerate(idx) if rows[i].generator is None]
                if shared:
                    u[shared] = torch.rand((len(shared), 1), generator=self._shared, dtype=torch.float64,
                                           device=logits.device)
                for k, i in enumerate(idx):
                    if rows[i].generator is not None:
                        u[k] = torch.rand((1,), generator=rows[i].generator, dtype=torch.float64,
                                          device=logits.device)
                chosen = draw_with_uniforms(logp.exp(), u)
            else:
                logp = torch.log_softmax(part, dim=-1)
                chosen = logp.argmax(dim=-1)
            chosen_lp = logp.gather(-1, chosen[:, None]).squeeze(-1)
            k_max = max(rows[i].job.top_logprobs for i in idx)
            top_vals = top_ids = None
            if k_max:
                top = torch.topk(logp, k_max, dim=-1)
                top_vals, top_ids = top.values.clamp_min(-9999.0).tolist(), top.indices.tolist()
            for k, (i, t, lp) in enumerate(zip(idx, chosen.tolist(), chosen_lp.tolist())):
                tokens[i], logps[i] = t, lp
                want = rows[i].job.top_logprobs
                if want:
                    tops[i] = list(zip(top_ids[k][:want], top_vals[k][:want]))
        return tokens, logps, tops

    def _step(self, jobs: list[_Job] = ()) -> None:
        """Sample for every live row, retire finished rows, decode one step for the rest; new `jobs` are
        prefilled in the same pass (their rows join after the live ones)."""
        rows = self._rows
        t0 = time.perf_counter()
        tokens, logps, tops = self._sample(self._logits)
        self.stats["steps"] += 1
        self.stats["tokens"] += len(rows)
        for r, t, lp, top in zip(rows, tokens, logps, tops):
            r.tokens.append(t)
            r.logprobs.append(lp)
            r.top.append(top)
            r.versions.append(self._logits_version)
            r.end += 1 if len(r.tokens) > 1 else 0
            if r.matcher is not None:
                r.matcher.consume_token(t)  # a forbidden token cannot be drawn; a failure shows in is_error()
        self._check_done(rows)
        self._drop_abandoned(rows)
        self._retire()
        self.stats["sample_s"] += time.perf_counter() - t0
        if not self._rows:
            self._logits = None
            if jobs:
                self._admit(jobs)
            return
        t0 = time.perf_counter()
        self._decode(jobs)
        self.stats["decode_s"] += time.perf_counter() - t0

    def _check_done(self, rows: list[_Row]) -> None:
        for job in {id(r.job): r.job for r in rows}.values():
            live = [r for r in job.rows if not r.done]
            broken = next((r.matcher.get_error() for r in live if r.matcher is not None and r.matcher.is_error()), None)
            if broken is not None:  # e.g. a grammar past llguidance's per-step limits
                for r in job.rows:
                    r.done = True
                if not job.future.done():
                    job.future.set_exception(RuntimeError(f"constrained decoding failed: {broken}"))
                continue
            hits = job.watcher.hits([r.tokens[-job.watcher.window:] for r in live]) if job.watcher else [False] * len(live)
            for r, hit in zip(live, hits):
                if hit or r.tokens[-1] in job.stop_ids or len(r.tokens) >= job.sampling.max_new_tokens:
                    r.done = True
                    r.result = finalize_row(r.tokens, r.logprobs, job.stop_ids, job.watcher)
            if all(r.done for r in job.rows) and not job.future.done():
                out = DetailedOutput()
                for r in job.rows:
                    ids, lps, reason = r.result
                    out.prompt_ids.append(r.prompt)
                    out.response_ids.append(ids)
                    out.logprobs.append(lps)
                    out.finish_reason.append(reason)
                    out.top_logprobs.append(r.top[: len(ids)])
                    if self.weights_hook is not None:
                        out.token_versions.append(r.versions[: len(ids)])
                job.future.set_result(out)

    def _drop_abandoned(self, rows: list[_Row]) -> None:
        """Rows of abandoned requests are done: `_retire` frees their slots before the next decode step."""
        for job in {id(r.job): r.job for r in rows}.values():
            if job.future.abandoned and not job.future.done():
                for r in job.rows:
                    r.done = True
                self.stats["abandoned"] += 1  # (counted before the future settles: its callback frees the queue)
                job.future.set_exception(RequestAbandoned("the request was abandoned (its client left)"))

    def _retire(self) -> None:
        """Drop finished rows; the last live rows move into the freed slots (live rows stay in front)."""
        rows = self._rows
        live = [not r.done for r in rows]
        if all(live):
            return
        order = list(range(len(rows)))
        lo, hi, src, dst = 0, len(rows) - 1, [], []
        while True:
            while lo < len(rows) and live[lo]:
                lo += 1
            while hi >= 0 and not live[hi]:
                hi -= 1
            if lo >= hi:
                break
            src.append(hi)
            dst.append(lo)
            order[lo], live[lo], live[hi] = hi, True, False
        n_live = sum(live)
        if src:
            self._cache.move_rows(src, dst, max(rows[i].end for i in src) + 1)
        self._rows = [rows[order[i]] for i in range(n_live)]
        self._logits = None

    def _decode(self, jobs: list[_Job] = ()) -> None:
        """One decode step of the live rows: feeds each row's last token; sets `self._logits`. New `jobs` are
        admitted too: with the fused decoder their prompts (one prefill chunk's worth) run in the same pass as the
        decode rows, so the weights stream from memory once for both (as vLLM mixes prefill and decode);
        otherwise they are prefilled after it."""
        engine, cache, rows = self.engine, self._cache, self._rows
        model = self._sync_weights() if jobs else engine.weights.module
        dev = self._device
        key_len = max(r.end for r in rows) + 1
        cache.ensure(cache, key_len)
        start = torch.tensor([r.start for r in rows], device=dev)
        end = torch.tensor([r.end for r in rows], device=dev)
        slot_step = self._slot_step(model)
        if slot_step is not None:  # the static step (CUDA graphs on a GPU); new jobs are prefilled after it
            slot_step.bind(cache.keys, cache.values)
            self._logits = slot_step.forward(
                torch.tensor([r.tokens[-1] for r in rows], device=dev),
                torch.tensor([len(r.prompt) + len(r.tokens) - 1 for r in rows], device=dev), start, end, key_len)
            self.stats["static_steps"] += 1
            if jobs:
                self._admit(jobs)
            return
        cache.set_write_cols(end)
        cache.key_len = key_len
        cols = torch.arange(cache.key_len, device=dev)
        valid = ((cols[None, :] >= start[:, None]) & (cols[None, :] <= end[:, None]))[:, None, None, :]
        dtype = next(model.parameters()).dtype
        impl = model.config._attn_implementation
        # sequence positions: a row's token at column c is its (c - start)-th
        mask = self._layout.masks(valid, (end - start)[:, None], cols[None, :] - start[:, None], None,
                                  lambda m: engine._mask(m, dtype, impl))
        tokens = torch.tensor([[r.tokens[-1]] for r in rows], device=dev)
        positions = torch.tensor([[len(r.prompt) + len(r.tokens) - 1 + r.position_offset] for r in rows], device=dev)
        fused = engine._fused if engine._fused is not None and engine._fused.model is model else None
        prompts, images = _prompts_of(jobs)
        width = max((len(p) for p in prompts), default=0)
        if fused is not None and prompts and images is None and len(prompts) * width <= engine.prefill_tokens:
            keys = _prompt_keys(prompts, None)
            todo, hits = self._lookup(model, prompts, keys)
            tmp = first = None
            if todo:
                ids, pos, valid = prefill_inputs([prompts[i] for i in todo], pad_token_id(model, engine.tokenizer), dev)
                w = ids.shape[1]
                tmp = KVBuffer(len(todo), width, dev)
                tmp.prefill_rows, tmp.prefill_cols = torch.arange(len(todo), device=dev), slice(width - w, width)
                self._logits, first = fused.forward_parts([(tokens, positions, mask, cache),
                                                           (ids, pos, valid[:, None], tmp)])
                tmp.prefill_rows = tmp.prefill_cols = None
                first = first.float()
                self.stats["prefills_in_decode"] += 1
            else:
                with eval_mode(model):
                    self._logits = fused.step(tokens, positions, mask, cache)
            self._install(jobs, width, *self._assemble(prompts, keys, width, todo, tmp, first, hits))
            return
        with eval_mode(model):
            if fused is not None:
                logits = fused.step(tokens, positions, mask, cache)
            else:
                logits = model(input_ids=tokens, attention_mask=mask, position_ids=positions,
                               use_cache=True, logits_to_keep=1,
                               **{cache_keyword(model) or 'past_key_values': cache}).logits[:, -1, :]
        self._logits = logits
        if jobs:
            self._admit(jobs)


def _prompts_of(jobs: list[_Job]) -> tuple[list[list[int]], list[dict | None] | None]:
    """The jobs' prompts in order, and their image inputs (None when no job has images)."""
    prompts = [p for job in jobs for p in job.prompt_ids]
    if all(job.multi_modal is None for job in jobs):
        return prompts, None
    return prompts, [m for job in jobs for m in (job.multi_modal or [None] * len(job.prompt_ids))]


def _prompt_keys(prompts: list[list[int]], images: list[dict | None] | None) -> list[tuple]:
    """Each prompt's key for the prompt cache and for sharing a prefill within an admission: its tokens; an image
    prompt gets a key of its own (its pixels are not in the key), so it is never shared or cached."""
    return [tuple(p) if images is None or images[i] is None else (None, i) for i, p in enumerate(prompts)]


class _Closed(Exception):
    pass


class RequestAbandoned(Exception):
    """The result of an abandoned request (set on its future; nobody waits for it)."""


class EpisodeGenerator:
    """One sequence at a time for many concurrent episodes on one event loop (`await generate(ids, params)`): the
    native engine's requests share decode steps through a `ContinuousBatcher` (`weights_hook`: asynchronous RL's);
    other engines take one call at a time, off the event loop. `close()` stops the batcher."""

    def __init__(self, engine, weights_hook=None):
        import asyncio

        self.engine = engine
        self.batcher = (ContinuousBatcher(engine, max_rows=256, weights_hook=weights_hook)
                        if isinstance(engine, NativeRolloutEngine) else None)
        self.lock = asyncio.Lock()

    async def generate(self, ids: list[int], params):
        import asyncio

        if self.batcher is not None:
            return await asyncio.wrap_future(self.batcher.submit([ids], params))
        async with self.lock:
            return await asyncio.to_thread(self.engine.generate, [ids], params)

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
