"""Asynchronous RL: a rollout producer thread, a bounded queue of scored step batches, a staleness bound.

The same phases as the synchronous step (`tiller.trainer.rl`), split in two (verl's fully-async policy,
`verl/experimental/fully_async_policy`; AReaL, Fu et al. 2025, arXiv 2505.24298):

    producer thread: prompts -> gen (its own frozen copy of the weights) -> reward -> filter_groups -> queue
    trainer (driver thread): queue -> old/ref log-probs, values -> adv -> update -> publish weights (a sync)

Policy version `v` = the number of weight syncs the trainer has published (trainer step `s`, 1-based, runs
at version c(s) = (s - 1) // trigger with `trigger = async_training.trigger_parameter_sync_step`).

The producer's budget is verl's rule counted in step batches: after each sync it may generate at most
F = floor((1 + staleness_threshold) x trigger) batches, those queued or in flight included. In closed form
the batch for step s may start once version w(s) = ceil((s - F) / trigger) is published, and it starts with
the newest weights published by then. Its samples are then at most c(s) - w(s) <= MAX_AGE =
floor((F - 1) / trigger) versions old when used (= floor(staleness_threshold) with trigger 1); a sample
older than that (by its oldest token) is dropped and counted: a guard, since the schedule keeps every
sample within it. Agent rollouts: the producer runs whole episodes (every turn / request, on its own engine and
OpenAI endpoint); the sample is the episode, all its segments kept or dropped together (`staleness_filter`).

Threads, not processes: torch releases the GIL inside its kernels, so generation and the update overlap on
two cores. torch's thread count is per calling thread (OpenMP / MKL keep it per thread): the producer pins its
own when it starts (`trainer.num_threads`; 0: half of torch's default, the trainer thread keeps the other
half), and the trainer's follows the producer (`ThreadSharing`, `async_training.share_idle_threads`): its own
while the producer generates, the producer's as well while it waits for weights or for a free queue slot.
What the two threads share: the reward function and the prompt sampler (producer only), the worker object (the
producer only touches its own engine and weight copy through `generate_sequences` / `load_producer_weights`).

Faults: an exception in the producer is handed to the trainer, which raises it (UserError types as they
are, a `sys.exit()` in code the producer ran as a UserError naming the step, anything else as
`RolloutProducerError` naming the step, chained to the cause); the trainer never
waits on a dead producer. A trainer failure stops the producer (partial rollouts abort at the next decode
step, otherwise after the current generation; the thread is a daemon).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tiller.algos.staleness import batches_per_sync, earliest_version, max_age, trainer_version
from tiller.errors import UserError
from tiller.rollout.episodes import renumber_episodes


class RolloutProducerError(RuntimeError):
    """The rollout producer thread raised; the message names the step it was generating."""


class ProducerStopped(Exception):
    """Raised inside the producer (from a weight hook) when the trainer asked it to stop."""


@dataclass
class ProducedBatch:
    """One step's scored batch with what the trainer needs to account for it."""

    step: int
    batch: Any  # tiller.protocol.Batch (empty when no group passed the filter)
    metrics: dict[str, float]
    version: int  # the weights' version when generation started
    sampler_state: dict  # the prompt sampler's state after this step's prompts were drawn
    wait_s: float  # the producer's wait for the trainer before starting this batch
    busy_s: float  # the producer's generation + reward time for this batch


@dataclass
class _Weights:
    version: int
    state: Any


@dataclass
class RolloutProducer:
    """Runs `produce(step, weights_hook) -> (batch, metrics, sampler_state)` for steps `first_step..last_step`
    in a daemon thread, with the newest weights published, within the budget above.

    `load_weights(state)` installs a published weights object in the producer's engine (called in the producer
    thread); `weights_hook()` (for partial rollouts, called by the engine between decode steps) loads newer
    weights if any and returns the version in use.
    """

    produce: Callable[[int, Callable[[], int]], tuple[Any, dict, dict]]
    load_weights: Callable[[Any], None]
    first_step: int
    last_step: int
    staleness_threshold: float
    trigger: int
    partial_rollout: bool = False
    initial_version: int = 0
    queue_size: int = 0  # 0: F (the budget bounds it anyway)
    num_threads: int = 0  # torch threads of the producer thread, set when it starts (0: torch's default)
    _queue: queue.Queue = field(init=False)
    _cond: threading.Condition = field(default_factory=threading.Condition, init=False)
    _published: _Weights | None = field(default=None, init=False)
    _loaded_version: int = field(default=-1, init=False)
    _stop: bool = field(default=False, init=False)
    _error: BaseException | None = field(default=None, init=False)
    _error_step: int = field(default=0, init=False)
    _started_step: int = field(default=0, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _generating: threading.Event = field(default_factory=threading.Event, init=False)

    def __post_init__(self):
        self._queue = queue.Queue(maxsize=self.queue_size or batches_per_sync(self.staleness_threshold, self.trigger))

    # ---------------------------------------------------------------------- trainer side
    def publish(self, version: int, state: Any) -> None:
        """Make `state` (weights of `version`) the newest; wakes a producer waiting for it."""
        with self._cond:
            self._published = _Weights(version, state)
            self._cond.notify_all()

    @property
    def generating(self) -> bool:
        """True while the producer is generating or scoring a batch (not while it waits)."""
        return self._generating.is_set()

    @property
    def version(self) -> int:
        """The newest published version."""
        with self._cond:
            return self._published.version if self._published else -1

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tiller-rollout-producer", daemon=True)
        self._thread.start()

    def get(self, step: int) -> tuple[ProducedBatch, float]:
        """The batch for `step` and the seconds waited for it; raises the producer's failure, never hangs on it."""
        t0 = time.perf_counter()
        while True:  # batches produced before a failure are still trained on; the failure comes in their place
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                if self._thread is None or not self._thread.is_alive():
                    self._raise_if_failed()
                    raise RolloutProducerError(f"the rollout producer stopped before step {step}'s batch")
                continue
            if item is None:  # the producer's failure marker
                self._raise_if_failed()
                continue
            if item.step != step:
                raise RolloutProducerError(f"rollout producer out of order: expected step {step}, got {item.step}")
            return item, time.perf_counter() - t0

    def in_flight(self, step: int) -> int:
        """Batches generated, or being generated, for steps after `step`: what a restart regenerates."""
        return max(0, self._started_step - step)

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the producer to stop and wait up to `timeout` s for it (it is a daemon thread either way)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        try:  # unblock a producer waiting to put
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        if self._thread is not None:
            self._thread.join(timeout)

    def _raise_if_failed(self) -> None:
        err = self._error
        if err is None:
            return
        if isinstance(err, UserError):
            raise err
        if isinstance(err, SystemExit):  # user code (an agent, a hook) called sys.exit(): say so in one line
            raise UserError(f"the rollout producer stopped while generating step {self._error_step}: code it ran "
                            f"called sys.exit({err.code!r})") from None
        raise RolloutProducerError(f"the rollout producer failed while generating step {self._error_step}: "
                                   f"{type(err).__name__}: {err}") from err

    # --------------------------------------------------------------------- producer side
    def _run(self) -> None:
        step = self.first_step
        if self.num_threads > 0:
            import torch

            torch.set_num_threads(self.num_threads)  # this thread's own count, whatever the trainer's
        try:
            for step in range(self.first_step, self.last_step + 1):
                t_wait = time.perf_counter()
                version = self._wait_for(earliest_version(step, self.staleness_threshold, self.trigger))
                if version is None:
                    return
                wait_s = time.perf_counter() - t_wait
                t_busy = time.perf_counter()
                self._started_step = step
                self._generating.set()
                try:
                    batch, metrics, sampler_state = self.produce(step, self.weights_hook)
                finally:
                    self._generating.clear()
                busy_s = time.perf_counter() - t_busy
                item = ProducedBatch(step, batch, metrics, version, sampler_state, wait_s, busy_s)
                while True:
                    if self._stop:
                        return
                    try:
                        self._queue.put(item, timeout=0.2)
                        break
                    except queue.Full:
                        continue
        except ProducerStopped:
            return
        except BaseException as err:  # noqa: BLE001 - handed to the trainer thread, which raises it
            self._error, self._error_step = err, step
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass

    def _wait_for(self, version: int) -> int | None:
        """Block until `version` (or newer) is published, load the newest weights; None when stopped."""
        with self._cond:
            while not self._stop and (self._published is None or self._published.version < version):
                self._cond.wait(0.5)
            if self._stop:
                return None
            newest = self._published
        self._install(newest)
        return newest.version

    def _install(self, weights: _Weights) -> None:
        if weights.version != self._loaded_version:
            self.load_weights(weights.state)
            self._loaded_version = weights.version

    def weights_hook(self) -> int:
        """Between decode steps: stop if asked; with partial rollouts load newer published weights. Returns the
        version in use."""
        if self._stop:
            raise ProducerStopped
        if self.partial_rollout:
            with self._cond:
                newest = self._published
            if newest is not None and newest.version > self._loaded_version:
                self._install(newest)
        return self._loaded_version


class ThreadSharing:
    """The trainer thread's torch threads follow the producer: `own` while it generates, `own + lent` (at most
    the machine's cores) while it waits. Called often from the trainer thread (the actor calls it at each
    decoder layer's forward and backward, `ActorWorker.set_thread_poll`); a call from another thread does
    nothing, so the same model can run elsewhere. Changing the count costs ~1 us and happens only on a
    change. The update's float rounding can depend on its thread count, so which steps ran on more threads
    (a matter of timing) can change the last bits of a run: `share_idle_threads=false` keeps them fixed."""

    def __init__(self, producer: RolloutProducer, own: int, lent: int):
        import os

        self.producer, self.own = producer, max(1, own)
        self.shared = max(self.own, min(self.own + max(0, lent), os.cpu_count() or 1))
        self.owner = threading.get_ident()
        self._current = self.own
        self.polls = self.borrowed = 0

    def __call__(self, *_args) -> None:
        if threading.get_ident() != self.owner:
            return
        n = self.own if self.producer.generating else self.shared
        self.polls += 1
        self.borrowed += n > self.own
        if n != self._current:
            import torch

            torch.set_num_threads(n)
            self._current = n

    def take_stats(self) -> dict[str, float]:
        """`async/threads_borrowed_frac`: the share of polls since the last call that ran on the producer's
        threads too (0 when the machine has no core to spare)."""
        frac = self.borrowed / self.polls if self.polls else 0.0
        self.polls = self.borrowed = 0
        return {"async/threads_borrowed_frac": frac}


# ------------------------------------------------------------------------- the trainer's staleness check
def sample_versions(batch, start_version: int):
    """Per sample: (oldest, newest) version of its response tokens [B] each; `start_version` where the engine
    recorded none (no partial rollout) or the response is empty."""
    import torch

    n = len(batch)
    if "rollout_token_version" not in batch:
        full = torch.full((n,), start_version, dtype=torch.long)
        return full, full.clone()
    versions, mask = batch["rollout_token_version"], batch["response_mask"].bool()
    big = torch.iinfo(torch.long).max
    oldest = torch.where(mask, versions, torch.full_like(versions, big)).min(-1).values
    newest = torch.where(mask, versions, torch.full_like(versions, -1)).max(-1).values
    empty = ~mask.any(-1)
    oldest[empty], newest[empty] = start_version, start_version
    return oldest, newest


def staleness_filter(batch, start_version: int, step: int, staleness_threshold: float, trigger: int):
    """Drop the samples more than `max_age` versions behind the trainer at `step` (by their oldest token);
    returns (kept batch, metrics): async/staleness_mean and _max (of the samples kept, in versions),
    async/dropped_stale (samples dropped), async/partial_samples (kept samples sampled by more than one
    version), async/policy_version (the trainer's), and verl's `training/off_policy/*` over the kept samples (each
    /mean, /max, /min): trajectory_spans (versions a sample was sampled by, newest - oldest + 1),
    trajectory_staleness (versions its newest token lags the trainer) and trajectory_staleness_worst (its oldest).
    Agent rollouts (field `episode`): the sample is the episode, over all its segments (rows): it is kept or dropped
    whole, its oldest token decides, and the episode ids of the kept rows are renumbered 0..k-1 in order
    (`renumber_episodes`)."""
    import torch

    now = trainer_version(step, trigger)
    metrics = {"async/policy_version": float(now), "async/dropped_stale": 0.0, "async/partial_samples": 0.0,
               "async/staleness_mean": 0.0, "async/staleness_max": 0.0}
    if not len(batch):
        return batch, metrics
    row_oldest, row_newest = sample_versions(batch, start_version)
    sample = renumber_episodes(batch["episode"]) if "episode" in batch else torch.arange(len(batch))
    n = int(sample.max()) + 1
    oldest = torch.full((n,), torch.iinfo(torch.long).max).scatter_reduce(0, sample, row_oldest, "amin")
    newest = torch.full((n,), -1, dtype=torch.long).scatter_reduce(0, sample, row_newest, "amax")
    age = now - oldest
    keep = age <= max_age(staleness_threshold, trigger)
    metrics["async/dropped_stale"] = float((~keep).sum())
    if not bool(keep.all()):
        batch = batch.index(keep[sample].nonzero().squeeze(-1).tolist())
        if "episode" in batch and len(batch):
            batch["episode"] = renumber_episodes(batch["episode"])
    if bool(keep.any()):
        metrics["async/staleness_mean"] = float(age[keep].float().mean())
        metrics["async/staleness_max"] = float(age[keep].max())
        metrics["async/partial_samples"] = float((newest[keep] != oldest[keep]).sum())
        off_policy = {"trajectory_spans": newest[keep] - oldest[keep] + 1, "trajectory_staleness": now - newest[keep],
                      "trajectory_staleness_worst": age[keep]}
        for name, values in off_policy.items():
            values = values.double()
            metrics.update({f"training/off_policy/{name}/mean": float(values.mean()),
                            f"training/off_policy/{name}/max": float(values.max()),
                            f"training/off_policy/{name}/min": float(values.min())})
    return batch, metrics
