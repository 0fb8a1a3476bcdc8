"""A micro-batching queue in front of a rollout engine.

HTTP handlers submit jobs (a list of prompts plus `SamplingParams`) and await a future. One worker thread
owns the engine (engines are not thread-safe and torch runs best from one thread): it takes the first
waiting job, waits up to `max_wait_s` for more, and runs every group of jobs with identical sampling
settings as one `engine.generate` call (at most `max_batch_prompts` prompts per call), then hands each job
its own rows. Jobs with a `seed` run alone, so a seeded request gives the same answer however the server
is loaded.

This is the static-batching half of what vLLM does with continuous batching: requests that arrive while
a batch runs wait for the next one.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import astuple, dataclass, field, replace

from tiller.rollout import RolloutOutput, SamplingParams


@dataclass
class Job:
    prompt_ids: list[list[int]]
    sampling: SamplingParams
    future: Future = field(default_factory=Future)
    multi_modal: list[dict | None] | None = None  # per prompt: None (text) or its pixel_values / image_grid_thw

    def key(self) -> tuple | None:
        """Jobs with equal keys share an engine call; None = run alone."""
        if self.sampling.seed is not None:
            return None
        return astuple(replace(self.sampling, stop_token_ids=tuple(self.sampling.stop_token_ids),
                               stop=tuple(self.sampling.stop)))


class QueueFull(Exception):
    """More requests are waiting or running than the batcher takes (`max_queue`): the server answers 429."""


class MicroBatcher:
    """`submit(prompt_ids, sampling) -> Future[RolloutOutput]`; a daemon thread runs the engine.

    At most `max_queue` requests wait or run at once (`submit` raises `QueueFull` past it). A request whose
    future is cancelled before its engine call starts (its client left) is dropped, never generated; an engine
    call that has started runs to its end (the engine is not interruptible mid-call).
    Stats (`self.stats`): requests, engine_calls, prompts, tokens, dropped (for /stats and tests).
    """

    def __init__(self, engine, *, max_batch_prompts: int = 64, max_wait_s: float = 0.005, max_queue: int = 256):
        self.engine = engine
        self.max_queue = max(1, int(max_queue))
        self.pending = 0
        self._pending_lock = threading.Lock()
        self.max_batch_prompts = max(1, int(max_batch_prompts))
        self.max_wait_s = max(0.0, float(max_wait_s))
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.stats = {"requests": 0, "engine_calls": 0, "prompts": 0, "tokens": 0, "dropped": 0}
        self._thread = threading.Thread(target=self._loop, name="tiller-serve-engine", daemon=True)
        self._thread.start()

    @property
    def overloaded(self) -> bool:
        return self.pending >= self.max_queue

    def submit(self, prompt_ids: list[list[int]], sampling: SamplingParams,
               multi_modal: list[dict | None] | None = None) -> Future:
        """Queue one request; `multi_modal` (image prompts) goes to the engine's `generate` with the prompts."""
        with self._pending_lock:
            if self.pending >= self.max_queue:
                raise QueueFull(f"{self.pending} requests are waiting or running; this server takes at most "
                                f"{self.max_queue} at once (--max-queue): retry later")
            self.pending += 1
        job = Job([list(p) for p in prompt_ids], sampling, multi_modal=multi_modal)
        job.future.add_done_callback(self._done)
        self.queue.put(job)
        return job.future

    def _done(self, _future) -> None:
        with self._pending_lock:
            self.pending -= 1

    def close(self, timeout: float = 10.0) -> None:
        self.queue.put(None)
        self._thread.join(timeout)

    # --------------------------------------------------------------------------------- worker thread
    def _collect(self, first: Job) -> tuple[list[Job], bool]:
        """The first job plus those that arrive within max_wait_s (up to max_batch_prompts prompts)."""
        jobs, size, stop = [first], len(first.prompt_ids), False
        deadline = time.monotonic() + self.max_wait_s
        while size < self.max_batch_prompts:
            timeout = deadline - time.monotonic()
            try:
                job = self.queue.get(timeout=timeout) if timeout > 0 else self.queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                stop = True
                break
            jobs.append(job)
            size += len(job.prompt_ids)
        return jobs, stop

    def _loop(self) -> None:
        while True:
            first = self.queue.get()
            if first is None:
                return
            jobs, stop = self._collect(first)
            groups: dict[object, list[Job]] = {}
            for i, job in enumerate(jobs):
                key = job.key()
                groups.setdefault(("alone", i) if key is None else key, []).append(job)
            for group in groups.values():
                self._run_group(group)
            if stop:
                return

    def _run_group(self, jobs: list[Job]) -> None:
        """Run jobs sharing sampling settings in engine calls of at most max_batch_prompts prompts."""
        batch: list[Job] = []
        for job in jobs:
            if batch and sum(len(j.prompt_ids) for j in batch) + len(job.prompt_ids) > self.max_batch_prompts:
                self._run(batch)
                batch = []
            batch.append(job)
        if batch:
            self._run(batch)

    def _run(self, jobs: list[Job]) -> None:
        live = [job for job in jobs if job.future.set_running_or_notify_cancel()]  # cancelled: the client left
        self.stats["dropped"] += len(jobs) - len(live)
        jobs = live
        if not jobs:
            return
        prompts = [p for job in jobs for p in job.prompt_ids]
        sampling = jobs[0].sampling
        images = {}
        if any(job.multi_modal is not None for job in jobs):
            images["multi_modal"] = [m for job in jobs for m in (job.multi_modal or [None] * len(job.prompt_ids))]
        try:
            out = self.engine.generate(prompts, sampling, **images)
        except BaseException as err:  # noqa: BLE001 - the error belongs to the waiting requests
            for job in jobs:
                job.future.set_exception(err)
            return
        self.stats["requests"] += len(jobs)
        self.stats["engine_calls"] += 1
        self.stats["prompts"] += len(prompts)
        self.stats["tokens"] += out.num_tokens
        row, n = 0, sampling.n
        for job in jobs:
            rows = slice(row, row + len(job.prompt_ids) * n)
            job.future.set_result(RolloutOutput(out.prompt_ids[rows], out.response_ids[rows], out.logprobs[rows],
                                                out.finish_reason[rows]))
            row = rows.stop
