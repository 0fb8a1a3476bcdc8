"""TRL's `callbacks=[...]` on tiller's loops (tiller.trl.callbacks): transformers' TrainerCallback methods are called in
transformers' order with its arguments, as TRL's own SFTTrainer calls them (the same script run on both); a callback
stops training (control.should_training_stop) in the SFT job and in GRPO; a method tiller never calls is refused."""

from __future__ import annotations

import pytest

from tests.trl_front.test_trl_sft import MEMO
from tiller.errors import ConfigError
from tiller.trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

ROWS = [{"prompt": p + " ", "completion": c} for p, c in MEMO]
COMMON = dict(per_device_train_batch_size=4, max_steps=4, logging_steps=1, bf16=False, report_to="none",
              learning_rate=1e-2, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, seed=0)


class Recorder(transformers.TrainerCallback):
    """Records the calls tiller makes (the methods it does not call are not overridden)."""

    def __init__(self, stop_at: int | None = None):
        self.events, self.stop_at, self.kwargs = [], stop_at, {}

    def _seen(self, name, state, **kw):
        self.events.append((name, state.global_step))
        self.kwargs.setdefault(name, set(kw))

    def on_init_end(self, args, state, control, **kw):
        self._seen("on_init_end", state, **kw)

    def on_train_begin(self, args, state, control, **kw):
        self._seen("on_train_begin", state, **kw)

    def on_epoch_begin(self, args, state, control, **kw):
        self._seen("on_epoch_begin", state, **kw)

    def on_step_begin(self, args, state, control, **kw):
        self._seen("on_step_begin", state, **kw)

    def on_epoch_end(self, args, state, control, **kw):
        self._seen("on_epoch_end", state, **kw)

    def on_predict(self, args, state, control, metrics=None, **kw):  # transformers' predict() only: never called
        self._seen("on_predict", state, **kw)

    def on_step_end(self, args, state, control, **kw):
        self._seen("on_step_end", state, **kw)
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kw):
        self._seen("on_log", state, **kw)
        self.logs = getattr(self, "logs", []) + [dict(logs)]

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        self._seen("on_evaluate", state, **kw)
        self.metrics = dict(metrics)

    def on_save(self, args, state, control, **kw):
        self._seen("on_save", state, **kw)

    def on_train_end(self, args, state, control, **kw):
        self._seen("on_train_end", state, **kw)


def _run(make_config, trainer_class, out, callback):
    trainer = trainer_class(model=str(out[1]), args=make_config(output_dir=str(out[0]), **COMMON),
                            train_dataset=datasets.Dataset.from_list(ROWS),
                            eval_dataset=datasets.Dataset.from_list(ROWS[:4]), callbacks=[callback])
    trainer.train()
    return trainer


def test_sft_calls_the_methods_in_transformers_order(tiny_model_dir, tmp_path):
    theirs, ours = Recorder(), Recorder()
    _run(lambda **kw: trl.SFTConfig(use_cpu=True, **kw), trl.SFTTrainer, (tmp_path / "trl", tiny_model_dir), theirs)
    trainer = _run(SFTConfig, SFTTrainer, (tmp_path / "tiller", tiny_model_dir), ours)
    # transformers ends with one more on_log (the run's summary: train_runtime, train_loss, ...)
    assert theirs.events[-2] == ("on_log", 4) and "train_runtime" in theirs.logs[-1]
    assert ours.events == theirs.events[:-2] + theirs.events[-1:]
    assert ours.events[:6] == [("on_init_end", 0), ("on_train_begin", 0), ("on_epoch_begin", 0), ("on_step_begin", 0),
                               ("on_step_end", 1), ("on_log", 1)]
    # step 2 (the first epoch's last: 8 rows, batches of 4): the step's logs, the evaluation's logs, on_evaluate,
    # on_save, the epoch's end, the next epoch's beginning and step
    assert [e for e in ours.events if e[1] == 2] == [("on_step_end", 2), ("on_log", 2), ("on_log", 2),
                                                     ("on_evaluate", 2), ("on_save", 2), ("on_epoch_end", 2),
                                                     ("on_epoch_begin", 2), ("on_step_begin", 2)]
    assert ours.events[-2:] == [("on_epoch_end", 4), ("on_train_end", 4)] and "on_predict" not in dict(ours.events)
    assert ours.kwargs["on_step_end"] >= {"model", "processing_class", "optimizer", "lr_scheduler"}
    assert set(ours.metrics) >= {"eval_loss"} and all("loss" in logs for logs in ours.logs if "eval_loss" not in logs)
    assert ours.logs[0]["loss"] == pytest.approx(trainer.state.log_history[0]["loss"])
    assert trainer.state.global_step == 4


def test_a_callback_stops_sft_and_the_model_saved_is_the_stopped_one(tiny_model_dir, tmp_path):
    callback = Recorder(stop_at=3)
    trainer = _run(SFTConfig, SFTTrainer, (tmp_path / "run", tiny_model_dir), callback)
    assert trainer.state.global_step == 3 and ("on_step_end", 4) not in callback.events
    assert (tmp_path / "run" / "checkpoints" / "global_step_3").is_dir()  # the stopped step is checkpointed
    assert callback.events[-3:] == [("on_save", 3), ("on_epoch_end", 3), ("on_train_end", 3)]
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "model.safetensors").exists()


def test_a_callback_stops_grpo(tiny_model_dir, tmp_path):
    from tests.trl_front.test_trl_grpo_translate import reward_len, rows

    callback = Recorder(stop_at=2)
    args = GRPOConfig(output_dir=str(tmp_path / "run"), bf16=False, max_steps=4, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4, logging_steps=1, report_to="none",
                      save_strategy="no")
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_len, args=args, train_dataset=rows(),
                          callbacks=[callback])
    trainer.train()
    assert trainer.state.global_step == 2 and [e for e in callback.events if e[0] == "on_step_end"] == \
        [("on_step_end", 1), ("on_step_end", 2)]
    assert all("reward" in logs or "loss" in logs for logs in callback.logs)
    # the stopped step is checkpointed (save_strategy="no" otherwise), after its step and log calls
    assert callback.events[-5:] == [("on_step_end", 2), ("on_log", 2), ("on_save", 2), ("on_epoch_end", 2),
                                    ("on_train_end", 2)]
    assert (tmp_path / "run" / "checkpoints" / "global_step_2").is_dir()


def test_a_method_tiller_does_not_call_is_refused(tiny_model_dir, tmp_path):
    class OptimizerStep(transformers.TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kw):
            return control

    with pytest.raises(ConfigError, match=r"callbacks\[0\] \(OptimizerStep\)\.on_optimizer_step: refused: tiller's "
                                          r"loops call"):
        SFTTrainer(model=str(tiny_model_dir), args=SFTConfig(output_dir=str(tmp_path / "r"), report_to="none"),
                   train_dataset=datasets.Dataset.from_list(ROWS), callbacks=[OptimizerStep])


class EpochSaver(transformers.TrainerCallback):
    """Asks for a checkpoint at each epoch's end (save_strategy="no" otherwise); records the epoch events."""

    def __init__(self):
        self.events = []

    def on_epoch_begin(self, args, state, control, **kw):
        self.events.append(("on_epoch_begin", state.global_step))

    def on_epoch_end(self, args, state, control, **kw):
        self.events.append(("on_epoch_end", state.global_step))
        control.should_save = True
        return control


def test_epoch_events_in_grpo_and_a_save_asked_at_an_epochs_end(tiny_model_dir, tmp_path):
    """GRPO over 2 prompts, one per step (4 generations each): an epoch is 2 steps, so 4 steps begin epochs at steps 0
    and 2 and end them at 2 and 4; the checkpoints asked for in on_epoch_end are written."""
    from tests.trl_front.test_trl_grpo_translate import reward_len, rows

    callback = EpochSaver()
    args = GRPOConfig(output_dir=str(tmp_path / "run"), bf16=False, max_steps=4, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4, report_to="none", save_strategy="no")
    GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_len, args=args, train_dataset=rows(2),
                callbacks=[callback]).train()
    assert callback.events == [("on_epoch_begin", 0), ("on_epoch_end", 2), ("on_epoch_begin", 2), ("on_epoch_end", 4)]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("global_step_*")) == \
        ["global_step_2", "global_step_4"]


def test_should_epoch_stop_is_refused(tiny_model_dir, tmp_path):
    from tiller.errors import UserError

    class CutEpoch(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_epoch_stop = True
            return control

    trainer = SFTTrainer(model=str(tiny_model_dir), args=SFTConfig(output_dir=str(tmp_path / "r"), report_to="none",
                                                                   max_steps=2, bf16=False),
                         train_dataset=datasets.Dataset.from_list(ROWS), callbacks=[CutEpoch])
    with pytest.raises(UserError, match="should_epoch_stop: refused: tiller's loops count steps"):
        trainer.train()
