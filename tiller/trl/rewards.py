"""TRL's reward functions, called as TRL 1.16's GRPOTrainer / RLOOTrainer call them, in the user's process.

`TRLRewards` is an in-process scorer for `tiller.trainer.rl.run(cfg, reward_fn=...)`: `score(requests)` calls each
reward function once per batch,

    reward_func(prompts=[...], completions=[...], completion_ids=[[...], ...], **kwargs)

with `kwargs` = every other column of the dataset rows as a list (the row reaches here by its index, carried in
`extra_info`, so columns of any type never round-trip through a file), plus `trainer_state` (`global_step`),
`log_extra(column, values)` and `log_metric(name, value)`, as TRL passes them. Completions are strings (standard
prompts) or `[{"role": "assistant", "content": text}]` (conversational prompts); with tools, each completion's
messages (assistant turns as parsed, tool messages) and, with environments, `environments` (each completion's
instance) and the prompts with their reset observations (`tiller.trl.tool_loop`). An async reward function is
awaited (all async ones of a batch together, as TRL gathers them). A reward model (a model dir or a loaded
sequence-classification model) scores `prompt + completion` (conversational: the chat template of the messages),
right padded, logits[:, 0], as TRL's.

A `None` reward is NaN; the scalar reward is TRL's `nansum(rewards_per_func x reward_weights)`. TRL leaves a
completion that every function scored None out of its group baseline with advantage 0; tiller needs one reward per
completion, so that is a `DataError` naming the row. A reward function that raises stops the run: a `UserError`
naming the function (the original exception chained).

Metrics as TRL names them: `rewards/<name>/mean` and `/std` (NaN-aware, Bessel-corrected std), `reward`,
`reward_std`, `frac_reward_zero_std` (fraction of groups whose rewards are all equal) and the `log_metric` names;
each function's per-completion rewards are extras `<name>` (tiller logs `reward_extra/<name>/mean` and writes them
in the generation dumps).

Image prompts (an `images` / `image` column): a row is decoded as TRL's data loader yields it (a `datasets` image
column: PIL images) only when its completions are scored, and `prompts` are TRL's multimodal messages (content
parts; the image parts hold their images, `tiller.trl.images`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from tiller.errors import DataError, UserError
from tiller.rewards.managers import ScoreBatch
from tiller.trl.images import multimodal_row, row_images

ROW_KEY = "trl_row"  # extra_info key of the dataset row index
SPLIT_KEY = "trl_split"  # extra_info key: "train" | "eval"
SKIP_COLUMNS = ("prompt", "completion", "completion_ids")


@dataclass
class TrainerStateView:
    """What a reward function reads from TRL's `trainer_state` (tiller's step)."""

    global_step: int = 0
    max_steps: int = 0


def callable_name(func: Any) -> str:
    """TRL's name of a reward function: a partial's wrapped function, a function's __name__, else the class name."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def is_async(func: Any) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


def nanstd(values: np.ndarray) -> float:
    """TRL's nanstd: the std of the non-NaN values with Bessel's correction; NaN for fewer than 2."""
    finite = values[~np.isnan(values)]
    return float(np.std(finite, ddof=1)) if finite.size > 1 else float("nan")


def nanmean(values: np.ndarray) -> float:
    finite = values[~np.isnan(values)]
    return float(finite.mean()) if finite.size else float("nan")


class RewardModelFunc:
    """A sequence-classification reward model used as a reward function (TRL's scoring of it)."""

    def __init__(self, model: Any, tokenizer: Any, chat_template_kwargs: dict | None):
        import torch

        self.model, self.tokenizer = model.eval(), tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
        self.torch = torch
        self.name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__).rstrip("/").split("/")[-1]

    @classmethod
    def load(cls, path: str, tokenizer: Any, trust_remote_code: bool, chat_template_kwargs: dict | None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1,
                                                                   trust_remote_code=trust_remote_code)
        tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
        return cls(model, tok, chat_template_kwargs)

    def __call__(self, prompts: list, completions: list, **_: Any) -> list[float]:
        if isinstance(prompts[0], list):
            texts = [self.tokenizer.apply_chat_template(p + c, tokenize=False, **self.chat_template_kwargs)
                     for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = self.tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                                add_special_tokens=False)
        with self.torch.inference_mode():
            return self.model(**inputs).logits[:, 0].float().tolist()


class TRLRewards:
    """In-process scorer of TRL reward functions (`score(list[RewardRequest]) -> ScoreBatch`)."""

    def __init__(self, funcs: list[Callable], names: list[str], weights: list[float], rows: dict[str, list[dict]],
                 conversational: bool):
        if len(weights) != len(funcs):
            raise UserError(f"reward_weights has {len(weights)} weights for {len(funcs)} reward functions: give one "
                            "weight per reward function")
        self.funcs, self.names, self.weights = funcs, names, np.asarray(weights, dtype=np.float64)
        self.rows, self.conversational = rows, conversational
        # image prompts (tiller.trl.images): per split, the image column and the dataset's row decoder (None: none)
        self.image_columns: dict[str, str | None] = {}
        self.decoders: dict[str, Callable[[dict], dict] | None] = {}
        self.global_step = 0  # tiller's completed steps: set by the RL driver before each step
        self.max_steps = 0  # TRL's optimizer steps of the run
        self.optimizer_steps_per_step = 1  # k: TRL's optimizer steps per tiller step
        self.environments = False  # environment_factory given: reward functions get `environments`
        self._pending_metrics: dict[str, list[float]] = {}
        self._pending_extras: dict[str, list] = {}

    # --------------------------------------------------------------------------------------- one batch
    def score(self, requests: list) -> ScoreBatch:
        cache: dict[tuple[str, int], tuple[dict, Any]] = {}  # the n completions of a prompt share its row
        rows, prompts = [], []
        for req in requests:
            row, prompt = self._row(req, cache)
            rows.append(row)
            prompts.append(prompt)
        texts = [req.response for req in requests]
        completions = [[{"role": "assistant", "content": t}] for t in texts] if self.conversational else texts
        if any(req.messages is not None for req in requests):  # tool conversations: their messages (TRL's loop)
            completions = [list(req.messages or []) for req in requests]
            prompts = [req.state.prompt if getattr(req.state, "prompt", None) is not None else p
                       for req, p in zip(requests, prompts)]
        completion_ids = [list(req.response_ids or []) for req in requests]
        keys = [k for k in rows[0] if k not in SKIP_COLUMNS]
        kwargs: dict[str, Any] = {k: [row.get(k) for row in rows] for k in keys}
        kwargs["trainer_state"] = TrainerStateView(self.global_step * self.optimizer_steps_per_step, self.max_steps)
        kwargs["log_extra"] = self._log_extra
        kwargs["log_metric"] = self._log_metric
        if self.environments:  # TRL: each completion's environment instance
            kwargs["environments"] = [getattr(req.state, "environment", None) for req in requests]
        per_func = np.full((len(requests), len(self.funcs)), np.nan, dtype=np.float64)
        call = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        pending = []
        for i, func in enumerate(self.funcs):
            if is_async(func):
                pending.append(i)
            else:
                per_func[:, i] = self._values(i, self._guarded(i, func, call), len(requests))
        if pending:
            for i, out in zip(pending, self._run_async([self.funcs[i] for i in pending], pending, call)):
                per_func[:, i] = self._values(i, out, len(requests))
        return self._batch(per_func, requests)

    def _row(self, req: Any, cache: dict) -> tuple[dict, Any]:
        """(the sample's dataset row, decoded as TRL's data loader yields it; the prompt TRL passes: with images,
        the messages in parts whose image parts hold their images)."""
        info = req.extra_info or {}
        try:
            split, index = info.get(SPLIT_KEY, "train"), int(info[ROW_KEY])
            row = self.rows[split][index]
        except (KeyError, IndexError, TypeError, ValueError):
            raise DataError(f"a sample without its dataset row ({ROW_KEY} in extra_info): the TRL front end writes "
                            "the data it trains on") from None
        if (split, index) not in cache:
            decode, column = self.decoders.get(split), self.image_columns.get(split)
            row = decode(row) if decode is not None else row
            prompt = row["prompt"]
            if column is not None:
                prompt = multimodal_row(prompt, row_images(row, column), f"{split}_dataset row {index}")[1]
            cache[split, index] = (row, prompt)
        return cache[split, index]

    def _guarded(self, i: int, func: Callable, call: dict) -> Any:
        try:
            return func(**call)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - TRL does not swallow it either: the run stops, naming the function
            raise UserError(f"reward function {self.names[i]!r} raised {type(exc).__name__}: {exc}") from exc

    def _run_async(self, funcs: list[Callable], index: list[int], call: dict) -> list[Any]:
        async def one(i: int, func: Callable) -> Any:
            try:
                return await func(**call)
            except UserError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise UserError(f"reward function {self.names[i]!r} raised {type(exc).__name__}: {exc}") from exc

        async def gather() -> list[Any]:
            return list(await asyncio.gather(*(one(i, f) for i, f in zip(index, funcs))))

        # a fresh event loop in a worker thread: works whether or not the caller's thread runs a loop (notebooks)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, gather()).result()

    def _values(self, i: int, out: Any, n: int) -> np.ndarray:
        values = list(out) if out is not None else []
        if len(values) != n:
            raise UserError(f"reward function {self.names[i]!r} returned {len(values)} rewards, but {n} were expected "
                            "(one per prompt-completion pair)")
        try:
            return np.asarray([np.nan if v is None else float(v) for v in values], dtype=np.float64)
        except (TypeError, ValueError):
            raise UserError(f"reward function {self.names[i]!r} returned a non-number: rewards are floats or None") \
                from None

    def _batch(self, per_func: np.ndarray, requests: list) -> ScoreBatch:
        unscorable = np.isnan(per_func).all(axis=1)
        if unscorable.any():
            i = int(np.flatnonzero(unscorable)[0])
            raise DataError(f"every reward function returned None for completion {i} (dataset row "
                            f"{requests[i].extra_info.get(ROW_KEY)}): tiller needs a reward for each completion "
                            "(TRL leaves such completions out with advantage 0)")
        total = np.nansum(per_func * self.weights[None, :], axis=1)
        metrics: dict[str, float] = {}
        extras: dict[str, np.ndarray] = {}
        for i, name in enumerate(self.names):
            metrics[f"rewards/{name}/mean"] = nanmean(per_func[:, i])
            metrics[f"rewards/{name}/std"] = nanstd(per_func[:, i])
            extras[name] = per_func[:, i].astype(np.float32)
        metrics["reward"] = float(total.mean())
        metrics["reward_std"] = nanstd(total)
        groups: dict[str, list[float]] = {}
        for req, value in zip(requests, total):
            groups.setdefault(req.group, []).append(float(value))
        metrics["frac_reward_zero_std"] = float(np.mean([math.isclose(float(np.std(v)), 0.0, abs_tol=1e-8)
                                                         for v in groups.values()]))
        for name, values in self._pending_metrics.items():
            metrics[name] = float(np.mean(values))
        for name, values in self._pending_extras.items():
            if len(values) == len(requests):
                extras[name] = np.asarray(values)
        self._pending_metrics, self._pending_extras = {}, {}
        return ScoreBatch(scores=total.astype(np.float32), extras=extras, metrics=metrics)

    def _log_metric(self, name: str, value: float) -> None:
        self._pending_metrics.setdefault(str(name), []).append(float(value))

    def _log_extra(self, column: str, values: list) -> None:
        self._pending_extras[str(column)] = list(values)
