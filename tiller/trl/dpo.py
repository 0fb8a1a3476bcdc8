"""TRL's `DPOConfig` / `DPOTrainer` on `tiller dpo` (`tiller.trainer.preference.train_dpo`).

Rows: `prompt` + `chosen` + `rejected` (standard strings or conversational), or only `chosen` / `rejected` (the
implicit prompt is extracted as TRL does): `tiller.trl.preference.dpo_rows`. Losses (TRL 1.16's formulas, in
`tiller.algos.dpo_loss`): all of TRL 1.16's loss types (sigmoid -> algorithm.loss=dpo; ipo and sigmoid_norm on
length-averaged scores; exo_pair, nca_pair, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop,
sft), lists of them with loss_weights (MPO), f-divergences, LD-DPO (ld_alpha) and WPO (use_weighting). TRL reads
label_smoothing for robust / exo_pair / aot only, so a non-zero one without any of them is refused rather than
silently dropped.
Reference: `ref_model=None` is the starting policy (with peft_config: the base model, adapters disabled, as TRL);
a path or a loaded model -> model.ref_path. Deviations: see `tiller.trl.sft` (tokenization at the prompt /
completion boundary, the end of a conversational turn); a prompt that fills max_length is an error naming the row
(TRL drops the row).
"""

from __future__ import annotations

from typing import Any

from tiller.errors import ConfigError
from tiller.trl.fields import FIELDS
from tiller.trl.common import field_table, make_config_class, mapped, noop, refuse_value
from tiller.trl.jobs import JobTrainer, write_data
from tiller.trl.preference import dpo_rows
from tiller.trl.sft import COMMON_MODEL_RULES, truncation

TRL_DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
SMOOTHED = ("robust", "exo_pair", "aot", "aot_unpaired")  # the losses TRL 1.16 reads label_smoothing for


def _loss(value: Any, args: Any) -> dict:
    names = [value] if isinstance(value, str) else list(value)
    unknown = [n for n in names if n not in TRL_DPO_LOSSES]
    if unknown or not names:
        raise refuse_value("loss_type", value, f"TRL 1.16's DPO losses are {', '.join(TRL_DPO_LOSSES)}")
    weights = args.loss_weights
    if weights is not None and len(weights) != len(names):
        raise refuse_value("loss_weights", weights, f"one weight per loss of loss_type={names}")
    smoothing = float(args.label_smoothing)
    if smoothing and not set(names) & set(SMOOTHED):
        raise refuse_value("label_smoothing", smoothing, f"TRL 1.16 reads it for {', '.join(SMOOTHED)} only (its "
                           f"{', '.join(names)} ignores it); for conservative DPO use `tiller dpo algorithm.loss=cdpo`")
    keys: dict[str, Any] = {"algorithm.loss": ("dpo" if names == ["sigmoid"] else names[0]) if len(names) == 1
                            else names, "algorithm.label_smoothing": smoothing}
    if weights is not None:
        keys["algorithm.loss_weights"] = [float(w) for w in weights]
    return keys


def _sync_ref(value: Any, args: Any) -> dict:
    if not value:
        return {}
    if args.precompute_ref_log_probs:
        raise refuse_value("precompute_ref_log_probs", True, "with sync_ref_model the reference changes during "
                           "training, so its log-probs cannot be computed up front (TRL raises too)")
    return {"algorithm.ref_model_sync_steps": int(args.ref_model_sync_steps),
            "algorithm.ref_model_mixup_alpha": float(args.ref_model_mixup_alpha)}


PREFERENCE_RULES = {
    **COMMON_MODEL_RULES,
    "disable_dropout": mapped("model.disable_dropout", lambda v, a: {"model.disable_dropout": bool(v)}),
    "precompute_ref_log_probs": noop("the reference is frozen: its log-probs are the same computed up front or per "
                                     "step (tiller computes them per step)"),
    "precompute_ref_batch_size": noop("the reference is frozen: its log-probs are the same computed up front or per "
                                      "step"),
    "beta": mapped("algorithm.beta", lambda v, a: {"algorithm.beta": float(v)}),
    "sync_ref_model": mapped("algorithm.ref_model_sync_steps / ref_model_mixup_alpha (TR-DPO: the reference follows "
                             "the policy every N optimizer steps)", _sync_ref),
    "ref_model_mixup_alpha": mapped("algorithm.ref_model_mixup_alpha (read with sync_ref_model)", lambda v, a: {}),
    "ref_model_sync_steps": mapped("algorithm.ref_model_sync_steps (read with sync_ref_model)", lambda v, a: {}),
}

DPO_RULES = {
    **PREFERENCE_RULES,
    "truncation_mode": mapped("data.truncation: keep_start -> right, keep_end -> left", truncation),
    "padding_free": noop("tiller pads micro-batches: the loss is the same"),
    "loss_type": mapped("algorithm.loss: TRL 1.16's names (sigmoid alone -> dpo; a list -> their weighted sum)",
                        _loss),
    "loss_weights": mapped("algorithm.loss_weights (read with loss_type)", lambda v, a: {}),
    "label_smoothing": mapped("algorithm.label_smoothing, for robust / exo_pair / aot / aot_unpaired (read with "
                              "loss_type)", lambda v, a: {}),
    "ld_alpha": mapped("algorithm.ld_alpha (LD-DPO)",
                       lambda v, a: {} if v is None else {"algorithm.ld_alpha": float(v)}),
    "f_divergence_type": mapped("algorithm.f_divergence", lambda v, a: {"algorithm.f_divergence": str(v)}),
    "f_alpha_divergence_coef": mapped("algorithm.f_alpha_divergence_coef",
                                      lambda v, a: {"algorithm.f_alpha_divergence_coef": float(v)}),
    "use_weighting": mapped("algorithm.use_weighting (WPO)", lambda v, a: {"algorithm.use_weighting": bool(v)}),
    "discopop_tau": mapped("algorithm.discopop_tau", lambda v, a: {"algorithm.discopop_tau": float(v)}),
}

DPO_RULES = {k: v for k, v in DPO_RULES.items() if k in FIELDS["DPOConfig"]}  # this class's fields only
DPOConfig = make_config_class("DPOConfig", DPO_RULES)


class PreferenceTrainer(JobTrainer):
    """DPO and KTO: a reference model given as None, a path or a loaded model."""

    def _set_ref(self, ref_model: Any) -> None:
        # import cost: torch / safetensors load only when a model is saved or exported
        from tiller.models.checkpoint import save_pretrained_atomic

        if ref_model is None:
            self.ref_path = None
        elif isinstance(ref_model, str) or hasattr(ref_model, "__fspath__"):
            self.ref_path = str(ref_model)
        elif hasattr(ref_model, "save_pretrained"):
            self.ref_path = str(save_pretrained_atomic(self.run_dir / "input_ref_model", ref_model))
        else:
            raise ConfigError(f"ref_model: a {type(ref_model).__name__}: give a model dir, a loaded PreTrainedModel "
                              "or None (the starting policy)")

    def _model_keys(self, private: dict[str, Any]) -> dict[str, Any]:
        out = super()._model_keys(private)
        if self.ref_path is not None:
            out["model.ref_path"] = self.ref_path
        return out

    def _eos(self) -> str | None:
        # import cost: transformers loads only when a tokenizer is read
        from tiller.models.loading import load_tokenizer

        return load_tokenizer(self.tokenizer_path or self.model_path).eos_token

    def _preference_data(self, convert: Any) -> dict[str, Any]:
        eos = self._eos()
        rows, keys = convert(self.train_rows, eos, "train_dataset")
        keys["data.train_files"] = [write_data(self.run_dir, "train", rows)]
        if self.eval_rows is not None:
            val, _ = convert(self.eval_rows, eos, "eval_dataset")
            keys["data.val_files"] = [write_data(self.run_dir, "eval", val)]
        return keys


class DPOTrainer(PreferenceTrainer):
    """TRL's DPOTrainer: `DPOTrainer(model, ref_model=None, args=DPOConfig(...), train_dataset=...,
    eval_dataset=None, processing_class=None, peft_config=None)`; runs `tiller dpo` (see the module docstring)."""

    config_class = DPOConfig
    trl_metric_names = {}

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 compute_metrics: Any = None, callbacks: Any = None, optimizers: Any = (None, None),
                 quantization_config: Any = None, peft_config: Any = None):
        # import cost: the config stack loads only when a run starts
        from tiller.config.jobs import DPOConfig as JobConfig
        # import cost: only the chosen job's trainer
        from tiller.trainer.preference import train_dpo

        type(self).job_schema, type(self).entry = JobConfig, staticmethod(train_dpo)
        self._set_up_job(model, args, train_dataset, eval_dataset, processing_class, peft_config,
                         data_collator=data_collator, compute_metrics=compute_metrics, callbacks=callbacks,
                         optimizers=optimizers, quantization_config=quantization_config)
        self._set_ref(ref_model)

    def _data(self, private: dict[str, Any]) -> dict[str, Any]:
        return self._preference_data(dpo_rows)


def dpo_field_table() -> str:
    """The markdown table of DPOConfig's fields (docs/trl.md)."""
    return field_table("DPOConfig", DPOConfig.RULES)
