"""Reward managers: turn a list of `RewardRequest`s into scores with a rule / user function.

- `naive`: one call `compute_score(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)`
  per sample (verl's NaiveRewardManager).
- `batch`: one call per batch, `compute_score(data_sources=[...], solution_strs=[...],
  ground_truths=[...], extra_infos=[...], **reward_kwargs) -> list` (verl's BatchRewardManager).
- `parallel`: the per-sample calls spread over worker processes (`KillablePool`); a sample that
  runs past `timeout` seconds has its worker killed and scores 0 (counted in reward/num_timeouts).
- `dapo`: `naive` plus DAPO's overlong reward shaping (Yu et al. 2025, arXiv 2503.14476, eq. 13):

      r += min(-(|y| - (L_max - L_buf)) / L_buf * penalty_factor, 0)

  with |y| the response length in tokens and L_max = data.max_response_length: responses shorter
  than L_max - L_buf are untouched, the penalty grows linearly to -penalty_factor at L_max.

A return value may be a number or a dict with `score` (other numeric keys become per-sample extras,
NaN where a sample lacks them). A function that raises, or returns NaN / inf / no score, gives 0 and
is counted in `reward/num_errors`; a `UserError` (bad config or data) is raised, not counted, and so is a call
of `sys.exit()` inside the function (`RewardExit`: the run stops with one line naming the function, in the
synchronous loop and in asynchronous RL's producer alike).
"""

from __future__ import annotations

import math
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tiller.errors import ConfigError, UserError
from tiller.rewards._procpool import FuncRef, KillablePool, resolve_ref
from tiller.rewards.registry import default_compute_score
from tiller.rewards.types import RewardRequest

DEFAULT_REF: FuncRef = ("module", "tiller.rewards.registry", "default_compute_score")


@dataclass
class ScoreBatch:
    """Raw scores of a batch before shaping: scores [B], numeric extras [B] each, error counts."""

    scores: np.ndarray
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def load_function_ref(path: str | None, name: str) -> FuncRef:
    """A reference to `name` in the Python file `path` (checked now, so a typo fails at start)."""
    if not path:
        return DEFAULT_REF
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"custom_reward_function.path: file not found: {path}")
    ref: FuncRef = ("file", str(file.resolve()), name)
    try:
        fn = resolve_ref(ref)
    except AttributeError:
        raise ConfigError(f"custom_reward_function.name: {path} defines no function {name!r}") from None
    except SystemExit as exc:  # sys.exit() / exit() at import: name it, don't end the run without a word
        raise ConfigError(f"custom_reward_function.path: importing {path} called sys.exit({exc.code!r})") from None
    except Exception as exc:  # noqa: BLE001 - the user's file failed to import
        raise ConfigError(f"custom_reward_function.path: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    if not callable(fn):
        raise ConfigError(f"custom_reward_function.name: {name!r} in {path} is not callable")
    return ref


def unpack(value: Any) -> tuple[float, dict[str, float], bool]:
    """(score, numeric extras, is_error) of one return value."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            if key != "score" and isinstance(item, (bool, int, float, np.number)):
                extras[key] = float(item)
        value = value.get("score")
    try:
        score = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0, extras, True
    if not math.isfinite(score):
        return 0.0, extras, True
    return score, extras, False


def _collect(values: list[Any], errors: list[bool]) -> ScoreBatch:
    n = len(values)
    scores = np.zeros(n, dtype=np.float32)
    extras: dict[str, np.ndarray] = {}
    num_errors = 0
    for i, (value, failed) in enumerate(zip(values, errors)):
        if failed:
            num_errors += 1
            continue
        score, sample_extras, bad = unpack(value)
        num_errors += bad
        scores[i] = score
        for key, item in sample_extras.items():
            extras.setdefault(key, np.full(n, np.nan, dtype=np.float32))[i] = item
    return ScoreBatch(scores, extras, {"reward/num_errors": float(num_errors)})


class RewardExit(UserError):
    """The reward function called `sys.exit()` (raised `SystemExit`) while scoring: not a score, the run stops."""

    def __init__(self, fn: Any, code: str):
        where = getattr(fn, "__code__", None)
        name = getattr(fn, "__qualname__", repr(fn))
        at = f" ({where.co_filename}:{where.co_firstlineno})" if where is not None else ""
        super().__init__(f"the reward function {name}{at} called sys.exit({code}) while scoring a sample: a reward "
                         "function returns a score (or raises, to score 0 counted in reward/num_errors)")


class _Overran(BaseException):
    """Raised into a reward call that passed its time limit (a BaseException: `except Exception` in user code
    does not swallow it)."""


def call_or_error(fn: Callable, *args, timeout: float | None = None, **kwargs) -> tuple[Any, str]:
    """(value, "ok" | "error" | "timeout") of one reward call, bounded by `timeout` seconds.

    In the main thread (one-process runs) a SIGALRM timer interrupts the call; elsewhere (a Ray worker's thread)
    the call runs in a daemon thread that is abandoned when it overruns. A function that installs its own
    SIGALRM timer (math-verify does) replaces ours for its duration."""
    if not timeout:
        try:
            return fn(*args, **kwargs), "ok"
        except UserError:
            raise
        except SystemExit as err:
            raise RewardExit(fn, repr(err.code)) from None
        except Exception:  # noqa: BLE001 - a failing reward function scores 0, counted
            return None, "error"
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        def overran(signum, frame):
            raise _Overran

        previous = signal.signal(signal.SIGALRM, overran)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            return fn(*args, **kwargs), "ok"
        except _Overran:
            return None, "timeout"
        except UserError:
            raise
        except SystemExit as err:
            raise RewardExit(fn, repr(err.code)) from None
        except Exception:  # noqa: BLE001
            return None, "error"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - handed back to the caller below
            box["error"] = err

    worker = threading.Thread(target=run, daemon=True, name="tiller-reward-call")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return None, "timeout"
    if isinstance(box.get("error"), UserError):
        raise box["error"]
    if isinstance(box.get("error"), SystemExit):
        raise RewardExit(fn, repr(box["error"].code))
    return (None, "error") if "error" in box else (box["value"], "ok")


def _call_each(fn: Callable, calls: list[tuple], timeout: float | None, kwargs: dict) -> list[tuple[Any, str]]:
    """`call_or_error(fn, *args, timeout=timeout, **kwargs)` for each `args` in `calls`, same results.

    Outside the main thread (asynchronous RL's rollout producer, a Ray worker's thread) the calls run in
    sequence on one helper thread that the caller checks only at the running call's deadline, instead of one
    thread per call: with another busy Python thread in the process each hand-over of the GIL can cost
    milliseconds, which per-call threads paid twice per sample. An overrunning call is abandoned with its
    helper (scored as a timeout) and the rest continue on a fresh one."""
    if not timeout or threading.current_thread() is threading.main_thread() or not calls:
        return [call_or_error(fn, *args, timeout=timeout, **kwargs) for args in calls]
    import time

    results: list[tuple[Any, str] | None] = [None] * len(calls)
    cond = threading.Condition()
    state = {"next": 0, "started": time.monotonic(), "abandoned": -1}

    def helper(first: int, token: int) -> None:
        for i in range(first, len(calls)):
            with cond:
                if state["abandoned"] >= token:
                    return
                state["next"], state["started"] = i, time.monotonic()
            try:
                value = (fn(*calls[i], **kwargs), "ok")
            except UserError as err:
                value = (err, "user_error")
            except SystemExit as err:
                value = (RewardExit(fn, repr(err.code)), "user_error")
            except Exception:  # noqa: BLE001 - a failing reward function scores 0, counted
                value = (None, "error")
            except BaseException as err:  # noqa: BLE001 - e.g. KeyboardInterrupt raised by the function: the
                value = (err, "user_error")  # caller re-raises it instead of waiting out this helper's deadline
            with cond:
                if state["abandoned"] >= token:
                    return
                results[i] = value
        with cond:
            state["next"] = len(calls)
            cond.notify_all()

    token = 0
    threading.Thread(target=helper, args=(0, token), daemon=True, name="tiller-reward-calls").start()
    with cond:
        while state["next"] < len(calls) or any(r is None for r in results):
            i, started = state["next"], state["started"]
            remaining = started + timeout - time.monotonic()
            if remaining > 0:
                cond.wait(remaining)
                continue
            if i < len(calls) and results[i] is None:  # call i overran: abandon its helper, go on after it
                results[i] = (None, "timeout")
                state["abandoned"], token = token, token + 1
                state["next"], state["started"] = i + 1, time.monotonic()
                if i + 1 < len(calls):
                    threading.Thread(target=helper, args=(i + 1, token), daemon=True,
                                     name="tiller-reward-calls").start()
            else:  # call i just finished: the helper is taking the next one
                cond.wait(0.01)
    for value, status in results:  # type: ignore[misc]
        if status == "user_error":
            raise value
    return results  # type: ignore[return-value]


def _collect_calls(results: list[tuple[Any, str]]) -> "ScoreBatch":
    batch = _collect([v for v, _ in results], [status != "ok" for _, status in results])
    timeouts = sum(status == "timeout" for _, status in results)
    batch.metrics["reward/num_timeouts"] = float(timeouts)
    batch.metrics["reward/num_errors"] -= timeouts
    return batch


class NaiveRewardManager:
    """Per-sample calls in this process, each bounded by `timeout` seconds (a timeout scores 0, counted in
    `reward/num_timeouts`)."""

    def __init__(self, ref: FuncRef = DEFAULT_REF, reward_kwargs: dict | None = None, timeout: float = 30.0):
        check_timeout(timeout)
        self.ref = ref
        self.fn = resolve_ref(ref)
        self.reward_kwargs = dict(reward_kwargs or {})
        self.timeout = timeout

    def score(self, requests: list[RewardRequest]) -> ScoreBatch:
        calls = [(r.data_source, r.response, r.ground_truth, r.extra_info) for r in requests]
        return _collect_calls(_call_each(self.fn, calls, self.timeout, self.reward_kwargs))


def _default_batch(data_sources, solution_strs, ground_truths, extra_infos, **kwargs) -> list:
    return [default_compute_score(*args, **kwargs) for args in zip(data_sources, solution_strs, ground_truths, extra_infos)]


class BatchRewardManager:
    """One call for the whole batch, bounded by `timeout` seconds; the function returns one value per sample."""

    def __init__(self, ref: FuncRef | None = None, reward_kwargs: dict | None = None, timeout: float = 30.0):
        check_timeout(timeout)
        self.fn = _default_batch if ref in (None, DEFAULT_REF) else resolve_ref(ref)  # type: ignore[arg-type]
        self.reward_kwargs = dict(reward_kwargs or {})
        self.timeout = timeout

    def score(self, requests: list[RewardRequest]) -> ScoreBatch:
        values, status = call_or_error(
            self.fn, data_sources=[r.data_source for r in requests], solution_strs=[r.response for r in requests],
            ground_truths=[r.ground_truth for r in requests], extra_infos=[r.extra_info for r in requests],
            timeout=self.timeout, **self.reward_kwargs)
        if status == "ok" and (not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(requests)):
            status = "error"
        if status != "ok":
            return _collect_calls([(None, status)] * len(requests))
        return _collect_calls([(v, "ok") for v in values])


_USER_ERRORS = ("UserError:", "ConfigError:", "DataError:")


def check_timeout(timeout: float) -> None:
    if not timeout or timeout <= 0:
        raise ConfigError(f"reward_model.timeout must be > 0 seconds, got {timeout}")


class ParallelRewardManager:
    """Per-sample calls in `num_workers` processes, each sample bounded by `timeout` seconds."""

    def __init__(self, ref: FuncRef = DEFAULT_REF, reward_kwargs: dict | None = None,
                 num_workers: int = 2, timeout: float = 30.0):
        if timeout <= 0:
            raise ConfigError(f"reward_model.timeout must be > 0, got {timeout}")
        self.ref = ref
        self.reward_kwargs = dict(reward_kwargs or {})
        self.timeout = timeout
        self.pool = KillablePool(num_workers, preload=("tiller.rewards.registry",))

    def score(self, requests: list[RewardRequest]) -> ScoreBatch:
        args = [(r.data_source, r.response, r.ground_truth, r.extra_info) for r in requests]
        outcomes = self.pool.map(self.ref, args, self.timeout, self.reward_kwargs)
        for outcome in outcomes:
            if outcome.status == "error" and outcome.error.startswith(_USER_ERRORS):
                raise UserError(outcome.error.split(": ", 1)[1])
            if outcome.status == "error" and outcome.error.startswith("SystemExit:"):
                raise RewardExit(resolve_ref(self.ref), outcome.error.split(": ", 1)[1])
        batch = _collect([o.value for o in outcomes], [o.status != "ok" for o in outcomes])
        timeouts = sum(o.status == "timeout" for o in outcomes)
        batch.metrics["reward/num_timeouts"] = float(timeouts)
        batch.metrics["reward/num_errors"] -= timeouts
        return batch

    def close(self) -> None:
        self.pool.close()


def overlong_penalty(response_length: np.ndarray, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> np.ndarray:
    """DAPO overlong shaping term [B] (<= 0) for response lengths [B] in tokens.

    >>> overlong_penalty(np.array([10, 13, 16]), 16, 4, 1.0).tolist()
    [0.0, -0.25, -1.0]
    """
    if buffer_len <= 0 or buffer_len > max_response_length:
        raise ConfigError(f"reward_model.overlong_buffer.len must be in [1, data.max_response_length="
                          f"{max_response_length}], got {buffer_len}")
    expected = max_response_length - buffer_len
    exceed = response_length.astype(np.float64) - expected
    return np.minimum(-exceed / buffer_len * penalty_factor, 0.0).astype(np.float32)


class DapoRewardManager(NaiveRewardManager):
    """`naive` scoring plus overlong shaping (when `buffer_len` is set) and the `acc` extra."""

    def __init__(self, ref: FuncRef = DEFAULT_REF, reward_kwargs: dict | None = None, *,
                 max_response_length: int, buffer_len: int | None = None, penalty_factor: float = 1.0,
                 log_penalty: bool = True, timeout: float = 30.0):
        super().__init__(ref, reward_kwargs, timeout)
        self.max_response_length = max_response_length
        self.buffer_len = buffer_len
        self.penalty_factor = penalty_factor
        self.log_penalty = log_penalty
        if buffer_len is not None:
            overlong_penalty(np.zeros(1), max_response_length, buffer_len, penalty_factor)  # validate now

    def score(self, requests: list[RewardRequest]) -> ScoreBatch:
        batch = super().score(requests)
        batch.extras.setdefault("acc", batch.scores.copy())
        if self.buffer_len is None:
            return batch
        lengths = np.array([r.response_length for r in requests])
        penalty = overlong_penalty(lengths, self.max_response_length, self.buffer_len, self.penalty_factor)
        batch.scores = batch.scores + penalty
        if self.log_penalty:
            batch.extras["overlong_reward"] = penalty
            batch.extras["overlong"] = (penalty < 0).astype(np.float32)
        batch.metrics["reward/overlong_frac"] = float((penalty < 0).mean()) if len(penalty) else 0.0
        return batch


