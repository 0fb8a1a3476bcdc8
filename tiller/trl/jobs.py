"""What TRL's SFT / DPO / KTO / reward trainers share on tiller: the TRL config translated into the job config of
`tiller sft|dpo|kto|rm` (`tiller/config/jobs.py`), the datasets written as the run's data files, the run itself
through the job's existing entry (`train_sft`, `train_dpo`, `train_kto`, `train_rm`), and `evaluate()`.

A job trainer (`tiller.trl.sft`, `dpo`, `kto`, `reward`) sets `config_class`, `job_schema`, `entry` and implements
`_data(rows, eval_rows, args) -> {tiller data key: value}` (writing its files with `write_data`). Its job-specific
rules return tiller keys directly (dotted names, e.g. `data.max_length`) or private settings (a leading `_`, read by
the trainer); the TrainingArguments rules return the shared logical settings that `job_keys` translates.

Counting: one tiller optimizer step is `per_device_train_batch_size x gradient_accumulation_steps` rows (pairs for DPO
and reward models, examples for KTO), as transformers' Trainer counts them in one process; epochs become
`trainer.total_training_steps = ceil(num_train_epochs x ceil(rows / batch))`.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Callable

from tiller.errors import ConfigError
from tiller.trl.base import TRLTrainerBase, lora_job_keys, refuse_arguments
from tiller.trl.common import classify, job_keys, overrides, refuse_value, resolve_schedule
from tiller.trl.data import to_dataset_rows, write_rows_atomic

DATA_DIR = "data"  # the run's data files: <output_dir>/data/train.jsonl, eval.jsonl
RUN_RECORDS = ("metrics.jsonl", "checkpoints", "tensorboard", "config.yaml")  # replaced by a fresh train()


def write_data(run_dir: Path, name: str, rows: list[dict], suffix: str = ".jsonl") -> str:
    """Write `rows` to `<run_dir>/data/<name><suffix>` atomically (`.parquet` for rows holding image bytes);
    returns the path (a tiller data file)."""
    return str(write_rows_atomic(rows, Path(run_dir) / DATA_DIR / f"{name}{suffix}"))


def moe_config(model_path: str) -> dict | None:
    """The config.json of a mixture-of-experts model (its text config, for a VLM): one with output_router_logits, as
    TRL tells them; None for a dense model (or no readable config)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config) if "output_router_logits" not in config else config
    return config if "output_router_logits" in config else None


def moe_router_coef(model_path: str) -> float:
    """A mixture-of-experts model's config router_aux_loss_coef (its text config's, for a VLM); 0 for a dense model."""
    config = moe_config(model_path)
    return float(config.get("router_aux_loss_coef", 0.0) or 0.0) if config is not None else 0.0


def split_settings(logical: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(shared logical settings, tiller keys, private settings) of `classify`'s output."""
    keys = {k: v for k, v in logical.items() if "." in k}
    private = {k: v for k, v in logical.items() if k.startswith("_")}
    shared = {k: v for k, v in logical.items() if k not in keys and k not in private}
    return shared, keys, private


def eval_rows_of(eval_dataset: Any) -> list[dict] | None:
    if eval_dataset is None:
        return None
    if isinstance(eval_dataset, dict) and not hasattr(eval_dataset, "column_names"):
        names = ", ".join(map(str, eval_dataset))
        raise ConfigError(f"eval_dataset: a dict of {len(eval_dataset)} datasets ({names}): "
                          "refused: tiller validates on one eval_dataset")
    return to_dataset_rows(eval_dataset, "eval_dataset")


class JobTrainer(TRLTrainerBase):
    """A TRL trainer run by one of tiller's offline jobs (see the module docstring)."""

    job_schema: type = None  # type: ignore[assignment]  # tiller.config.jobs.SFTConfig, DPOConfig, ...
    entry: Callable[[Any], dict] = None  # type: ignore[assignment]
    loss_key = "train/loss"
    trl_metric_names: dict[str, str] = {}  # tiller metric -> TRL's name in log_history

    def _set_up_job(self, model: Any, args: Any, train_dataset: Any, eval_dataset: Any, processing_class: Any,
                    peft_config: Any, quantization_config: Any = None, callbacks: Any = None,
                    **unsupported: Any) -> None:
        refuse_arguments(type(self).__name__, **unsupported)
        self._set_up_common(model, args, processing_class, peft_config, quantization_config, callbacks)
        self.settings, self.notices = classify(self.args)  # refusals raise here, as TRL raises in __init__
        for line in self.notices:
            print(f"tiller.trl: {line}")
        self.train_rows = to_dataset_rows(train_dataset, "train_dataset")
        self.eval_rows = eval_rows_of(eval_dataset)

    # ------------------------------------------------------------------------------------------- config
    def _data(self, private: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def tokenizer_with_eos(self, eos_token: str) -> str:
        """eos_token: the tokenizer with that eos, saved under the run dir (it is what the trained model keeps)."""
        import os

        # import cost: transformers loads only when a tokenizer is read
        from tiller.models.loading import load_tokenizer

        tokenizer = load_tokenizer(self.tokenizer_path or self.model_path)
        if eos_token not in tokenizer.get_vocab():
            raise refuse_value("eos_token", eos_token, "not a token of the tokenizer's vocabulary (as TRL checks)")
        tokenizer.eos_token = eos_token
        out = self.run_dir / "input_tokenizer_eos"
        tmp = out.with_name(f".{out.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        self.tokenizer_path = str(out)
        return str(out)

    def _num_train_rows(self) -> int:
        return len(self.train_rows)

    def _model_keys(self, private: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"model.partial_pretrain": self.model_path}
        coef = private.get("_router_aux")
        if coef is None and "_router_aux" in private:  # TRL: a mixture-of-experts model's own coefficient
            coef = moe_router_coef(self.model_path)
        if coef:
            out["model.router_aux_loss_coef"] = float(coef)
        if self.tokenizer_path:
            out["model.tokenizer_path"] = self.tokenizer_path
        out.update(lora_job_keys(self.lora))
        out.update({f"model.{k}": v for k, v in self.quant.items()})
        return out

    def tiller_keys(self, resume: dict[str, Any] | None = None) -> dict[str, Any]:
        """The tiller job keys of this run (data files written under output_dir/data)."""
        shared, keys, private = split_settings(dict(self.settings))
        data_keys = self._data(private)
        batch = int(shared.get("micro_batch_size", 8)) * int(shared.get("grad_accum", 1))
        schedule = resolve_schedule(shared, math.ceil(self._num_train_rows() / batch))
        self.total_steps, self.steps_per_epoch = schedule["total_training_steps"], schedule["steps_per_epoch"]
        out = {**job_keys(schedule), **self._model_keys(private), **keys, **data_keys,
               "trainer.export_hf": False, "trainer.resume_mode": "disable"}
        out.update({k: v for k, v in (resume or {}).items() if k != "trainer.overwrite"})
        return out

    def _tiller_config(self, resume: dict[str, Any]) -> Any:
        # import cost: the config stack (omegaconf, hydra, torch via algos) loads only when a run starts
        from tiller.config import load_config
        # import cost: the config stack loads only when a run starts
        from tiller.config.jobs import validate_job

        cfg = load_config(overrides(self.tiller_keys(resume)), schema=self.job_schema, validate=validate_job)
        if resume.get("trainer.overwrite"):  # a fresh run replaces the records of an earlier one in output_dir
            for name in RUN_RECORDS:
                path = self.run_dir / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
        return cfg

    def _run(self, cfg: Any) -> dict[str, float]:
        return type(self).entry(cfg)

    def _trl_metrics(self, row: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for name, value in row.items():
            if name.startswith("val/"):
                out["eval_" + self.trl_metric_names.get(name[4:], name[4:]).replace("/", "_")] = value
            elif name.startswith("train/") and name[6:] not in ("loss", "lr", "epoch"):
                out[self.trl_metric_names.get(name[6:], name[6:])] = value
        if "train/lr" in row:
            out["learning_rate"] = row["train/lr"]
        return out

    # ---------------------------------------------------------------------------------------- evaluate
    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict:
        """TRL's `evaluate()`: the validation metrics of the trained model on eval_dataset (tiller validates at the
        end of `train()`, and every eval_steps with eval_strategy="steps"), named `eval_<metric>` as transformers
        names them. A different eval_dataset here is refused: give it to the trainer."""
        if eval_dataset is not None:
            raise ConfigError("evaluate(eval_dataset=...): refused: give eval_dataset to the trainer; tiller validates "
                              "it during train()")
        if self.eval_rows is None:
            raise ConfigError("evaluate(): no eval_dataset was given to the trainer")
        if not self._trained:
            raise ConfigError("evaluate(): call train() first (tiller validates during training)")
        rows = [row for row in self.state.log_history if any(k.startswith("val/") for k in row)]
        if not rows:
            raise ConfigError("evaluate(): the run logged no validation metrics")
        last = rows[-1]
        out = {f"{metric_key_prefix}_{self.trl_metric_names.get(k[4:], k[4:]).replace('/', '_')}": v
               for k, v in last.items() if k.startswith("val/")}
        out["epoch"] = last.get("epoch")
        return out

