"""TRL's `callbacks=[...]` (transformers `TrainerCallback` objects or classes) on tiller's loops
(`tiller.trainer.hooks`).

Called, with transformers' arguments `(args, state, control, **kwargs)` and a transformers `TrainerControl`:
`on_init_end` (the trainer built), `on_train_begin`, `on_epoch_begin` before each epoch's first step, `on_step_begin`
before every step, `on_step_end` and `on_log` after every step (tiller logs every step: `logs` is the step's
`state.log_history` entry without its validation keys), `on_evaluate` when the step validated (`metrics`: the `eval_*`
entries), `on_save` after each checkpoint, `on_epoch_end` after an epoch's last step (and after the run's last or a
stopped step, as transformers ends its epoch loop there), `on_train_end`. kwargs: `model` (the live
policy), `processing_class`, `optimizer`, `lr_scheduler` where the loop runs in this process. `state` is the trainer's
`state`, its `log_history` growing as the run logs. `control.should_training_stop` ends training after that step (a
checkpoint of it is saved, so `save_model()` writes the model as stopped), `should_save` saves a checkpoint,
`should_evaluate` validates (with an eval_dataset), read after `on_step_end` / `on_log` / `on_evaluate` and again after
`on_epoch_end`; they are reset then, as transformers' flow does. `should_epoch_stop` (skip the rest of an epoch) stops
the run with an error: tiller's loops count steps, not an epoch's batches.

A callback that overrides a method transformers calls while training and tiller does not (`on_substep_end`,
`on_pre_optimizer_step`, `on_optimizer_step`: inside tiller's step; `on_prediction_step`: per evaluation batch) is
refused naming it, rather than never called; `on_predict` / `on_push_begin` (transformers' `predict()` /
`push_to_hub()` only) are taken and never called, as in a transformers run that does neither. GRPO / RLOO with k > 1 optimizer steps per generation batch: the
step methods run once per generation batch, `state.global_step` counting optimizer steps (a notice says so).
"""

from __future__ import annotations

from typing import Any

from tiller.errors import ConfigError, UserError
from tiller.trainer.hooks import Requests

CALLED = ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
          "on_step_end", "on_log", "on_evaluate", "on_save")
NOT_CALLED = ("on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_prediction_step")
"""Called by transformers while it trains, not by tiller's loops: a callback overriding one is refused."""
OUTSIDE_TRAINING = ("on_predict", "on_push_begin")
"""Called by transformers only from `predict()` / `push_to_hub()`, which tiller's trainers do not have: never called
while training there either, so a callback overriding them (WandbCallback: on_predict) is taken."""


def prepare_callbacks(callbacks: Any) -> list:
    """The callback objects (a class is instantiated, as transformers does); one overriding a method tiller does not
    call is refused naming it."""
    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)):
        raise ConfigError(f"callbacks: a {type(callbacks).__name__}; give a list of TrainerCallback objects")
    from transformers import TrainerCallback

    out = []
    for i, callback in enumerate(callbacks):
        if isinstance(callback, type):
            callback = callback()
        name = type(callback).__name__
        if not isinstance(callback, TrainerCallback):
            raise ConfigError(f"callbacks[{i}]: a {name}, not a transformers TrainerCallback")
        for method in NOT_CALLED:
            if getattr(type(callback), method, None) is not getattr(TrainerCallback, method):
                raise ConfigError(f"callbacks[{i}] ({name}).{method}: refused: tiller's loops call "
                                  f"{', '.join(CALLED)}, not {method}")
        out.append(callback)
    return out


class CallbackHooks:
    """`tiller.trainer.hooks.StepHooks` running a TRL trainer's callbacks (module docstring)."""

    def __init__(self, trainer: Any, callbacks: list):
        from transformers import TrainerControl

        self.trainer, self.callbacks, self.control = trainer, callbacks, TrainerControl()
        self.kwargs: dict[str, Any] = {"processing_class": trainer.processing_class}

    def call(self, event: str, **extra: Any) -> None:
        for callback in self.callbacks:
            result = getattr(callback, event)(self.trainer.args, self.trainer.state, self.control, **self.kwargs,
                                              **extra)
            if result is not None:
                self.control = result

    def begin(self, info: dict[str, Any]) -> None:
        self.kwargs.update({k: info.get(k) for k in ("model", "optimizer", "lr_scheduler")})
        if info.get("tokenizer") is not None and self.kwargs.get("processing_class") is None:
            self.kwargs["processing_class"] = info["tokenizer"]
        state = self.trainer.state
        state.global_step = self.trainer.trl_step(info.get("start", 0))
        state.max_steps = int(getattr(self.trainer, "total_steps", 0) or self.trainer.trl_step(info.get("total", 0)))
        self.call("on_train_begin")

    def _entry(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        entry = self.trainer.history_entry({"step": step, **metrics})
        state = self.trainer.state
        state.global_step = self.trainer.trl_step(step)
        state.epoch = float(entry.get("epoch", state.epoch))
        state.log_history.append(entry)
        return entry

    def epoch_begin(self, epoch: int) -> None:
        self.control.should_epoch_stop = False
        self.call("on_epoch_begin")

    def step_begin(self, step: int) -> None:
        self.trainer.state.global_step = self.trainer.trl_step(step)
        self.call("on_step_begin")

    def step(self, step: int, metrics: dict[str, Any]) -> Requests:
        entry = self._entry(step, metrics)
        self.call("on_step_end")
        self.call("on_log", logs={k: v for k, v in entry.items() if not _is_eval(k)})
        evals = {k: v for k, v in entry.items() if k.startswith("eval_")}
        if evals:  # transformers logs an evaluation's metrics, then calls on_evaluate
            self.call("on_log", logs=evals)
            self.call("on_evaluate", metrics=evals)
        return self._requests()

    def epoch_end(self, step: int) -> Requests:
        self.call("on_epoch_end")
        return self._requests()

    def _requests(self) -> Requests:
        """What the callbacks asked of the step (should_* flags), the flags then reset as transformers' flow does."""
        c = self.control
        if c.should_epoch_stop:
            raise UserError("a callback set control.should_epoch_stop: refused: tiller's loops count steps (an "
                            "epoch is steps, not a stream of batches to cut short); set should_training_stop to end "
                            "the run")
        asked = Requests(stop=bool(c.should_training_stop), save=bool(c.should_save), evaluate=bool(c.should_evaluate))
        c.should_save = c.should_evaluate = c.should_log = False
        return asked

    def evaluated(self, step: int, metrics: dict[str, Any]) -> None:
        entry = self._entry(step, metrics)
        evals = {k: v for k, v in entry.items() if k.startswith("eval_")}
        self.call("on_log", logs=evals)
        self.call("on_evaluate", metrics=evals)

    def saved(self, step: int, path: Any) -> None:
        self.call("on_save")

    def end(self, step: int, metrics: dict[str, Any]) -> None:
        self.call("on_train_end")


def _is_eval(key: str) -> bool:
    return key.startswith(("eval_", "val/", "val-"))
