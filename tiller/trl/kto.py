"""TRL's `KTOConfig` / `KTOTrainer` on `tiller kto` (`tiller.trainer.preference.train_kto`).

Rows: `prompt` / `completion` / `label` (standard or conversational), or paired preference rows, unpaired as TRL
does (`tiller.trl.preference.kto_rows`). The loss is TRL's `kto` (Ethayarajh et al. 2024, eq. 7; `tiller.algos.
kto_loss`) with beta, desirable_weight and undesirable_weight, or `apo_zero_unpaired` (the same losses with the KL
baseline 0, TRL's formulas: desirable 1 - sigma(beta r), undesirable sigma(beta r)). TRL's default
`train_sampling_strategy="sequential"` becomes data.shuffle=False (the rows in order, as TRL's KL pairs assume).
KL baseline: the prompt of each example with the completion of the one before it (TRL's rotation), averaged over the
whole optimizer step (TRL: per micro-batch; the same with gradient_accumulation_steps=1). Truncation keeps the start
of prompt + completion (TRL's KTO).
"""

from __future__ import annotations

from typing import Any

from tiller.trl.fields import FIELDS
from tiller.trl.common import field_table, make_config_class, mapped, refuse_value
from tiller.trl.dpo import PREFERENCE_RULES, PreferenceTrainer
from tiller.trl.preference import kto_rows


def _loss(value: Any, args: Any) -> dict:
    if value not in ("kto", "apo_zero_unpaired"):
        raise refuse_value("loss_type", value, "kto | apo_zero_unpaired")
    return {"algorithm.loss": value, "data.truncation": "right" if args.max_length is not None else "error"}


def _sampling(value: Any, args: Any) -> dict:
    if value == "random" and args.loss_type == "apo_zero_unpaired":
        return {"data.shuffle": True}  # no KL pairs: TRL allows random sampling
    if value != "sequential":
        raise refuse_value("train_sampling_strategy", value, "KTO's KL pairs are built over consecutive rows: "
                           "'sequential' (TRL requires it for the kto loss too)")
    return {"data.shuffle": False}


def _weight(name: str):
    return lambda v, a: {f"algorithm.{name}": float(v)}


KTO_RULES = {
    **PREFERENCE_RULES,
    "loss_type": mapped("algorithm.loss: kto | apo_zero_unpaired (KTO's losses with the KL baseline 0); truncation "
                        "keeps the start (data.truncation=right)", _loss),
    "desirable_weight": mapped("algorithm.desirable_weight", _weight("desirable_weight")),
    "undesirable_weight": mapped("algorithm.undesirable_weight", _weight("undesirable_weight")),
    "train_sampling_strategy": mapped("sequential -> data.shuffle=False; random -> data.shuffle=True with "
                                      "apo_zero_unpaired only (kto's KL pairs need sequential, as in TRL)", _sampling),
}

KTO_RULES = {k: v for k, v in KTO_RULES.items() if k in FIELDS["KTOConfig"]}  # this class's fields only
KTOConfig = make_config_class("KTOConfig", KTO_RULES)


class KTOTrainer(PreferenceTrainer):
    """TRL's KTOTrainer: `KTOTrainer(model, ref_model=None, args=KTOConfig(...), train_dataset=..., eval_dataset=None,
    processing_class=None, peft_config=None)`; runs `tiller kto` (see the module docstring)."""

    config_class = KTOConfig

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 compute_metrics: Any = None, callbacks: Any = None, optimizers: Any = (None, None),
                 quantization_config: Any = None, peft_config: Any = None):
        # import cost: the config stack loads only when a run starts
        from tiller.config.jobs import KTOConfig as JobConfig
        # import cost: only the chosen job's trainer
        from tiller.trainer.preference import train_kto

        type(self).job_schema, type(self).entry = JobConfig, staticmethod(train_kto)
        self._set_up_job(model, args, train_dataset, eval_dataset, processing_class, peft_config,
                         data_collator=data_collator, compute_metrics=compute_metrics, callbacks=callbacks,
                         optimizers=optimizers, quantization_config=quantization_config)
        self._set_ref(ref_model)

    def _num_train_rows(self) -> int:  # paired rows become two examples each
        return len(self.train_rows) * (2 if "chosen" in self.train_rows[0] else 1)

    def _data(self, private: dict[str, Any]) -> dict[str, Any]:
        return self._preference_data(kto_rows)


def kto_field_table() -> str:
    """The markdown table of KTOConfig's fields (docs/trl.md)."""
    return field_table("KTOConfig", KTOConfig.RULES)
