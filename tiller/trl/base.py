"""The part of every TRL front-end trainer that is not about its algorithm: the model and tokenizer given as paths or
loaded objects, `peft_config`, constructor arguments tiller cannot honour, `train(resume_from_checkpoint=...)`,
`state.log_history` read from the run's metrics.jsonl and `save_model()` (a Hugging Face dir, LoRA merged).

A subclass sets `config_class` and implements `_tiller_config(resume: dict) -> config` (the validated tiller config
of this run, its data written under the run dir) and `_run(config) -> metrics` (the existing trainer entry), and
may add TRL-named metrics to each logged row (`_trl_metrics`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiller.errors import ConfigError, UserError
from tiller.trainer.hooks import installed as installed_hooks
from tiller.trl.callbacks import CallbackHooks, prepare_callbacks

INPUT_MODEL_DIR = "input_model"  # a loaded model / tokenizer object is saved here, then loaded by path
INPUT_TOKENIZER_DIR = "input_tokenizer"

# peft.LoraConfig fields tiller cannot honour, with their default (checked by duck typing: peft is not imported)
_LORA_REFUSED = {"bias": "none", "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}


@dataclass
class TrainerState:
    """The part of transformers' `TrainerState` a script reads after `train()`."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    log_history: list[dict] = field(default_factory=list)
    best_model_checkpoint: str | None = None
    best_metric: float | None = None
    is_world_process_zero: bool = True  # (callbacks read these two)
    is_local_process_zero: bool = True


@dataclass
class TrainOutput:
    """transformers' `TrainOutput` (a named tuple there): global_step, training_loss, metrics."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]

    def __iter__(self):
        return iter((self.global_step, self.training_loss, self.metrics))


def refuse_arguments(trainer: str, **given: Any) -> None:
    """A `ConfigError` naming the first constructor argument tiller cannot honour that is not None / empty."""
    for name, value in given.items():
        empty = value is None or (isinstance(value, (tuple, list)) and all(v is None for v in value))
        if not empty:
            raise ConfigError(f"{trainer}({name}=...): refused: {_ARGUMENT_WHY.get(name, 'not supported by tiller')}")


_ARGUMENT_WHY = {
    "optimizers": "tiller builds AdamW and the schedule from args (learning_rate, lr_scheduler_type, ...)",
    "optimizer_cls_and_kwargs": "tiller builds AdamW from args (learning_rate, weight_decay, adam_beta1, ...)",
    "compute_loss_func": "tiller's losses are set by args (loss_type, beta, ...)",
    "compute_metrics": "tiller's validation metrics are its own",
    "preprocess_logits_for_metrics": "tiller's validation metrics are its own",
    "model_init": "pass the model (a path or a loaded model)",
    "rollout_func": "tiller samples with its own rollout engine (an agent loop: `tiller rl` with "
                    "actor_rollout_ref.rollout.agent.path)",
    "environment_factory": "environments run in tiller's GRPOTrainer (TRL's tool loop), not in this trainer",
    "tools": "tools run in tiller's GRPOTrainer (TRL's tool loop), not in this trainer",
    "data_collator": "tiller collates its own batches",
}


def lora_settings(peft_config: Any, model_path: str) -> dict[str, Any]:
    """Logical LoRA settings of a `peft.LoraConfig` (duck typed): lora_rank, lora_alpha, target_modules,
    lora_dropout, exclude_modules, modules_to_save, target_parameters, use_rslora, use_dora. target_modules None is
    peft's default for the model type (as peft resolves it)."""
    if peft_config is None:
        return {}
    if type(peft_config).__name__ != "LoraConfig" or not hasattr(peft_config, "r"):
        raise ConfigError(f"peft_config: a {type(peft_config).__name__}: tiller trains LoRA adapters only "
                          "(peft.LoraConfig)")
    for name, default in _LORA_REFUSED.items():
        value = getattr(peft_config, name, default)
        if value not in (default, None) and not (default == {} and not value):
            raise ConfigError(f"peft_config.{name}={value!r}: refused: tiller's LoRA is plain LoRA (r, lora_alpha, "
                              "target_modules, target_parameters, exclude_modules, modules_to_save, lora_dropout, "
                              "use_rslora, use_dora)")
    targets = peft_config.target_modules
    if targets is None:
        targets = _peft_default_targets(model_path)
    elif isinstance(targets, (set, frozenset, tuple)):
        targets = sorted(targets)
    out = {"lora_rank": int(peft_config.r), "lora_alpha": peft_config.lora_alpha, "target_modules": targets,
           "lora_dropout": float(peft_config.lora_dropout or 0.0)}
    for flag in ("use_rslora", "use_dora"):
        if getattr(peft_config, flag, False):  # peft: True (use_rslora also takes a bool-like)
            out[flag] = True
    exclude = getattr(peft_config, "exclude_modules", None)
    if exclude:
        out["exclude_modules"] = sorted(exclude) if isinstance(exclude, (set, frozenset, tuple)) else exclude
    saved = getattr(peft_config, "modules_to_save", None)
    if saved:
        out["modules_to_save"] = [saved] if isinstance(saved, str) else sorted(saved)
    params = getattr(peft_config, "target_parameters", None)
    if params:
        out["target_parameters"] = [params] if isinstance(params, str) else sorted(params)
    return out


def _peft_default_targets(model_path: str) -> Any:
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping
    except ImportError:
        raise ConfigError("peft_config.target_modules=None: give the module names (peft is not installed to "
                          "resolve its default)") from None
    config = json.loads((Path(model_path) / "config.json").read_text())
    targets = mapping.get(config.get("model_type"))
    if targets is None:
        raise ConfigError(f"peft_config.target_modules=None: peft has no default for model type "
                          f"{config.get('model_type')!r}; give the module names")
    return sorted(targets)


def quant_settings(given: Any, args: Any) -> tuple[dict[str, Any], list[str]]:
    """tiller's QLoRA keys (load_in_4bit, bnb_4bit_quant_type, bnb_4bit_use_double_quant, no section prefix) of a
    trainer's `quantization_config` or its `model_init_kwargs["quantization_config"]` (a transformers
    BitsAndBytesConfig or its dict, as TRL's get_quantization_config builds it), and notices. 8-bit and the settings
    tiller's 4-bit loading does not take are refused."""
    inside = (getattr(args, "model_init_kwargs", None) or {}).get("quantization_config")
    if given is not None and inside is not None:
        raise ConfigError("quantization_config: given both as a trainer argument and in args.model_init_kwargs "
                          "(TRL refuses the pair too)")
    config = given if given is not None else inside
    if config is None:
        return {}, []
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if d.get("load_in_8bit"):
        raise ConfigError("quantization_config.load_in_8bit=True: refused: tiller's QLoRA takes 4-bit bases "
                          "(load_in_4bit=True); LLM.int8 quantizes the activations too, so no merge gives the "
                          "trained model")
    if d.get("quant_method", "bitsandbytes") != "bitsandbytes" or not d.get("load_in_4bit"):
        raise ConfigError(f"quantization_config={d.get('quant_method', type(config).__name__)}: tiller quantizes "
                          "with bitsandbytes load_in_4bit=True only")
    for name, neutral in (("bnb_4bit_quant_storage", ("uint8", None)), ("llm_int8_skip_modules", (None, []))):
        if d.get(name) not in neutral:
            raise ConfigError(f"quantization_config.{name}={d.get(name)!r}: refused: tiller's 4-bit loading keeps "
                              f"{name}={neutral[0]!r}")
    notices = []
    compute = str(d.get("bnb_4bit_compute_dtype") or "float32").replace("torch.", "")
    want = "bfloat16" if getattr(args, "bf16", False) else "float32"
    if compute != want:
        notices.append(f"quantization_config.bnb_4bit_compute_dtype={compute}: the 4-bit matmuls run in tiller's "
                       f"compute dtype, {want} (bf16={getattr(args, 'bf16', False)})")
    return {"load_in_4bit": True, "bnb_4bit_quant_type": d.get("bnb_4bit_quant_type", "fp4"),
            "bnb_4bit_use_double_quant": bool(d.get("bnb_4bit_use_double_quant"))}, notices


def lora_rl_keys(lora: dict[str, Any]) -> dict[str, Any]:
    """RL keys of the LoRA settings (the actor's; its lora_dropout acts in the update's forward, as TRL's model in
    train mode applies it there)."""
    if not lora:
        return {}
    m = "actor_rollout_ref.model"
    out = {f"{m}.lora_rank": lora["lora_rank"], f"{m}.lora_alpha": lora["lora_alpha"],
           f"{m}.target_modules": lora["target_modules"]}
    if lora.get("lora_dropout"):
        out[f"{m}.lora_dropout"] = float(lora["lora_dropout"])
    for name in ("exclude_modules", "modules_to_save", "target_parameters"):
        if name in lora:
            out[f"{m}.{name}"] = lora[name]
    for flag in ("use_rslora", "use_dora"):
        if lora.get(flag):
            out[f"{m}.{flag}"] = True
    return out


def lora_job_keys(lora: dict[str, Any]) -> dict[str, Any]:
    """SFT / RM / DPO / KTO keys of the LoRA settings."""
    out = {f"model.{k}": v for k, v in lora.items()}
    return out


class TRLTrainerBase:
    """What TRL's trainers share. Subclasses: `config_class`, `_tiller_config(resume)`, `_run(cfg)`."""

    config_class: type = None  # type: ignore[assignment]
    loss_key: str = "actor/pg_loss"  # the tiller metric reported as TRL's "loss" (training_loss is its mean)

    def _set_up_common(self, model: Any, args: Any, processing_class: Any, peft_config: Any,
                       quantization_config: Any = None, callbacks: Any = None) -> None:
        if args is None:
            name = model if isinstance(model, str) else type(model).__name__
            args = self.config_class(output_dir=f"{Path(str(name)).name}-{self.config_class.__name__[:-6]}")
        elif not isinstance(args, self.config_class):
            raise ConfigError(f"args: a {type(args).__name__}; {type(self).__name__} takes "
                              f"tiller.trl.{self.config_class.__name__}")
        self.args = args
        self.run_dir = Path(args.output_dir).expanduser()
        self._model_obj = None if isinstance(model, (str, os.PathLike)) else model
        self.model_path, self.tokenizer_path = self._model_paths(model, processing_class)
        self.processing_class = processing_class
        self.lora = lora_settings(peft_config, self.model_path)
        # QLoRA: a 4-bit base under the adapters (the keys' section prefix is the job's or the actor's)
        self.quant, quant_notices = quant_settings(quantization_config, self.args)
        if self.quant and not self.lora:  # before anything is written under output_dir
            raise ConfigError("quantization_config (load_in_4bit): QLoRA trains adapters on the frozen 4-bit base: "
                              "pass a peft_config (TRL's scripts: --use_peft)")
        if self.quant and importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError("quantization_config (load_in_4bit): needs the bitsandbytes package "
                              "(pip install bitsandbytes)")
        for line in quant_notices:
            print(f"tiller.trl: {line}")
        self.state = TrainerState()
        self._trained = False
        self.callbacks = prepare_callbacks(callbacks)  # transformers TrainerCallbacks on tiller's loops
        if self.callbacks:
            CallbackHooks(self, self.callbacks).call("on_init_end")

    # ------------------------------------------------------------------------------ model and tokenizer
    def _model_paths(self, model: Any, processing_class: Any) -> tuple[str, str | None]:
        """(model dir, tokenizer dir or None = the model's): a loaded object is saved under the run dir first."""
        # import cost: torch / safetensors load only when a model is saved or exported
        from tiller.models.checkpoint import save_pretrained_atomic

        if isinstance(model, (str, os.PathLike)):
            model_path = str(model)
            if not Path(model_path).expanduser().is_dir():
                raise ConfigError(f"model={model_path!r}: not a local model dir (tiller loads no hub models here)")
        elif hasattr(model, "save_pretrained") and hasattr(model, "config"):
            if hasattr(model, "peft_config"):
                raise ConfigError("model: a PeftModel: pass the base model and the adapter's peft.LoraConfig as "
                                  "peft_config (tiller attaches and merges LoRA itself)")
            if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
                raise ConfigError("model: a model loaded with bitsandbytes quantization: pass its dir with "
                                  "quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...) and a peft_config "
                                  "(tiller loads and quantizes it itself)")
            tok = processing_class if hasattr(processing_class, "save_pretrained") else None
            model_path = str(save_pretrained_atomic(self.run_dir / INPUT_MODEL_DIR, model, tok))
            if tok is not None:
                return model_path, None
            if processing_class is None:  # as TRL: the tokenizer of the model's own name / dir
                source = str(getattr(model.config, "_name_or_path", "") or "")
                if not Path(source).expanduser().is_dir():
                    raise ConfigError("processing_class: None with a loaded model whose source dir is unknown "
                                      f"({source!r}): pass its tokenizer")
                return model_path, source
        else:
            raise ConfigError(f"model: a {type(model).__name__}: give a model dir or a loaded PreTrainedModel")
        if processing_class is None:
            return model_path, None
        if isinstance(processing_class, (str, os.PathLike)):
            return model_path, str(processing_class)
        if not hasattr(processing_class, "save_pretrained"):
            raise ConfigError(f"processing_class: a {type(processing_class).__name__}: give a tokenizer (or processor)")
        out = self.run_dir / INPUT_TOKENIZER_DIR
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        processing_class.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        return model_path, str(out)

    @property
    def processing_class(self) -> Any:
        """The tokenizer given, or (as TRL) the one loaded from the model's dir (a vision-language model's: its
        processor)."""
        if self._processing_class is None or isinstance(self._processing_class, (str, os.PathLike)):
            from transformers import AutoTokenizer

            from tiller.models.loading import is_vision_checkpoint  # import cost: torch
            from tiller.models.vision import load_processor  # import cost: torch

            path = self.tokenizer_path or self.model_path
            self._processing_class = load_processor(path) if is_vision_checkpoint(path) else \
                AutoTokenizer.from_pretrained(path)
        return self._processing_class

    @processing_class.setter
    def processing_class(self, value: Any) -> None:
        self._processing_class = value

    @property
    def model(self) -> Any:
        """The trained model after `train()` (loaded from the run's newest checkpoint, LoRA merged), else the
        model given (loaded from its dir when a path was given)."""
        if self._trained:
            if getattr(self, "_trained_model", None) is None:
                self._trained_model = self._load_trained()
            return self._trained_model
        if self._model_obj is None:
            self._model_obj = _from_pretrained(self.model_path)
        return self._model_obj

    def _load_trained(self) -> Any:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="tiller-trl-model-") as tmp:
            self._export(Path(tmp) / "model")
            return _from_pretrained(Path(tmp) / "model")

    # ------------------------------------------------------------------------------------------- train
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> TrainOutput:
        """Train (the existing tiller trainer, with the translated config). resume_from_checkpoint: None / False
        starts afresh (an earlier run's checkpoints and metrics in output_dir are replaced, as transformers
        overwrites them); True resumes the newest checkpoint in output_dir; a path resumes that checkpoint."""
        for name in kwargs:
            if name != "trial" or kwargs[name] is not None:
                raise ConfigError(f"train({name}=...): refused: tiller's train() takes resume_from_checkpoint")
        if resume_from_checkpoint in (None, False):
            resume = {"trainer.resume_mode": "disable", "trainer.overwrite": True}
        elif resume_from_checkpoint is True:
            # import cost: torch / safetensors load only when a model is saved or exported
            from tiller.models.checkpoint import latest_checkpoint

            if latest_checkpoint(self.run_dir / "checkpoints") is None:
                raise UserError(f"resume_from_checkpoint=True: no valid checkpoint found in output directory "
                                f"({self.run_dir})")
            resume = {"trainer.resume_mode": "auto"}
        else:
            resume = {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": str(resume_from_checkpoint)}
        cfg = self._tiller_config(resume)
        self.state = TrainerState(log_history=[])  # (callbacks watch it grow)
        with installed_hooks(CallbackHooks(self, self.callbacks) if self.callbacks else None):
            self._run(cfg)
        self._trained, self._trained_model = True, None
        self.state = self._read_state()
        losses = [row["loss"] for row in self.state.log_history if isinstance(row.get("loss"), (int, float))]
        last = dict(self.state.log_history[-1]) if self.state.log_history else {}
        metrics = {k: v for k, v in last.items() if isinstance(v, (int, float))}
        loss = sum(losses) / len(losses) if losses else float("nan")
        metrics["train_loss"] = loss
        return TrainOutput(self.state.global_step, loss, metrics)

    def _tiller_config(self, resume: dict[str, Any]) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _run(self, cfg: Any) -> dict[str, float]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _trl_metrics(self, row: dict[str, Any]) -> dict[str, Any]:
        """TRL-named metrics of one logged row (tiller's metric names stay beside them)."""
        return {}

    def trl_step(self, step: int) -> int:
        """TRL's optimizer-step count of tiller step `step` (the RL front: k optimizer steps each)."""
        return int(self._trl_metrics({"step": step}).get("step", step))

    def _per_epoch(self, max_steps: int) -> int:
        return max(1, int(getattr(self, "steps_per_epoch", max_steps) or max_steps or 1))

    def history_entry(self, row: dict[str, Any], per_epoch: int | None = None) -> dict[str, Any]:
        """The `state.log_history` entry of one metrics.jsonl row: tiller's names, TRL's beside them, and epoch."""
        entry = dict(row)
        if self.loss_key in row:
            entry["loss"] = row[self.loss_key]
        entry.update(self._trl_metrics(row))
        per_epoch = per_epoch or self._per_epoch(int(getattr(self, "total_steps", 0) or 0))
        entry.setdefault("epoch", round(float(entry.get("step", 0)) / per_epoch, 4))
        return entry

    def _read_state(self) -> TrainerState:
        path = self.run_dir / "metrics.jsonl"
        rows = []
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    rows.append(json.loads(line))
        steps = [int(r["step"]) for r in rows if "step" in r]
        step = max(steps) if steps else 0
        max_steps = int(getattr(self, "total_steps", step) or step)
        per_epoch = self._per_epoch(max_steps)
        history = [self.history_entry(row, per_epoch) for row in rows]
        return TrainerState(global_step=step, max_steps=max_steps, epoch=step / per_epoch, log_history=history)

    # -------------------------------------------------------------------------------------- save_model
    def _export(self, out: Path) -> Path:
        # import cost: torch / safetensors load only when a model is saved or exported
        from tiller.models.checkpoint import export_hf, latest_checkpoint

        ckpt = latest_checkpoint(self.run_dir / "checkpoints")
        if ckpt is None:
            raise UserError(f"save_model: {self.run_dir} has no checkpoint yet: call train() first")
        return export_hf(ckpt, out)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the trained model (LoRA merged) and its tokenizer as a Hugging Face dir into output_dir (default:
        args.output_dir, beside the run's records), each file replaced atomically."""
        out = Path(output_dir or self.run_dir).expanduser()
        stage = out / ".tiller-save"
        shutil.rmtree(stage, ignore_errors=True)
        if not self._trained:  # before training: the model given, as transformers would save it
            # import cost: torch / safetensors load only when a model is saved or exported
            from tiller.models.checkpoint import save_pretrained_atomic

            save_pretrained_atomic(stage, self.model)
            return self._move_in(stage, out)
        self._export(stage)
        self._move_in(stage, out)

    @staticmethod
    def _move_in(stage: Path, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        for item in sorted(stage.iterdir()):
            target = out / item.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(item, target)
        stage.rmdir()


def _from_pretrained(path: Any) -> Any:
    """A model dir loaded as transformers loads it for TRL: a causal LM, or a vision-language model's image-text
    class (Qwen2-VL / Qwen2.5-VL / Qwen3-VL)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from tiller.models.loading import is_vision_checkpoint  # import cost: torch

    auto = AutoModelForImageTextToText if is_vision_checkpoint(path) else AutoModelForCausalLM
    return auto.from_pretrained(path)


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
