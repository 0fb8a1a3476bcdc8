"""TRL's experimental `CPOConfig` / `CPOTrainer` (CPO, Xu et al. 2024; SimPO, Meng et al. 2024) on `tiller dpo`.

`loss_type="sigmoid"` (CPO) is `algorithm.loss=cpo` (summed log-probs, plus `cpo_alpha` x the chosen completions'
NLL, `algorithm.cpo_alpha`), `hinge` / `ipo` are `cpo_hinge` / `cpo_ipo` (with the same NLL term); `loss_type="simpo"`
is SimPO (`algorithm.loss=simpo`, margin `simpo_gamma`) with TRL's NLL term: `[simpo, sft]` weighted
`[1, cpo_alpha]` (`cpo_alpha=0`: SimPO alone, the paper's). `alpha` != 0 is AlphaPO (`algorithm.alphapo_alpha`) with
simpo and ipo (on sigmoid / hinge's summed log-probs it overflows: refused). No reference model runs. Rows and
tokenization are DPOTrainer's (`tiller.trl.preference.dpo_rows`); the formulas are `tiller.algos.reference_free_loss`.
"""

from __future__ import annotations

from typing import Any

from tiller.trl.common import field_table, make_config_class, mapped, noop, refuse_value
from tiller.trl.dpo import PREFERENCE_RULES, PreferenceTrainer
from tiller.trl.fields import FIELDS
from tiller.trl.preference import dpo_rows
from tiller.trl.sft import COMMON_MODEL_RULES


def _loss(value: Any, args: Any) -> dict:
    alpha = float(args.cpo_alpha)
    if value in ("sigmoid", "hinge", "ipo"):
        name = {"sigmoid": "cpo", "hinge": "cpo_hinge", "ipo": "cpo_ipo"}[value]
        keys: dict[str, Any] = {"algorithm.loss": name, "algorithm.cpo_alpha": alpha}
    elif value == "simpo":
        keys = {"algorithm.loss": ["simpo", "sft"], "algorithm.loss_weights": [1.0, alpha]} if alpha else \
            {"algorithm.loss": "simpo"}
        keys["algorithm.simpo_gamma"] = float(args.simpo_gamma)
    else:
        raise refuse_value("loss_type", value, "TRL's CPOTrainer loss types are sigmoid, hinge, ipo and simpo")
    if float(args.alpha):
        if value in ("sigmoid", "hinge"):
            raise refuse_value("alpha", args.alpha, "AlphaPO's reward transformation on summed log-probs (loss_type "
                               f"{value!r}): p^-alpha overflows float32 from a ~350-nat completion at alpha 0.25; "
                               "tiller applies it with simpo and ipo (length-averaged, as the AlphaPO paper)")
        keys["algorithm.alphapo_alpha"] = float(args.alpha)
    smoothing = float(args.label_smoothing)
    if value in ("hinge", "ipo"):
        if smoothing:  # TRL ignores it there
            raise refuse_value("label_smoothing", args.label_smoothing, f"loss_type {value!r} does not read it "
                               "(sigmoid and simpo do)")
        return keys
    return {**keys, "algorithm.label_smoothing": smoothing}


def _decoder_only(field: str):
    def check(value: Any, args: Any) -> dict:
        if value:
            raise refuse_value(field, value, "tiller trains decoder-only causal LMs")
        return {}
    return check


def _no_completion_cap(value: Any, args: Any) -> dict:
    if value is not None:
        raise refuse_value("max_completion_length", value, "tiller truncates the whole sequence at max_length "
                           "(data.max_length, data.truncation); a separate completion cap is not built")
    return {}


REFERENCE_FREE_RULES = {
    **{k: PREFERENCE_RULES[k] for k in ("disable_dropout", "beta")},
    **{k: COMMON_MODEL_RULES[k] for k in ("max_length", "dataset_num_proc")},
    "max_completion_length": mapped("None: the completion is cut with the sequence at max_length; others refused",
                                    _no_completion_cap),
    "generate_during_eval": noop("tiller logs no sampled completions during preference evaluation"),
    "is_encoder_decoder": mapped("None / False (decoder-only); True refused", _decoder_only("is_encoder_decoder")),
}

CPO_RULES = {
    **REFERENCE_FREE_RULES,
    "loss_type": mapped("algorithm.loss: sigmoid / hinge / ipo -> cpo / cpo_hinge / cpo_ipo (+ algorithm.cpo_alpha); "
                        "simpo -> simpo, with TRL's NLL term [simpo, sft] weighted [1, cpo_alpha] when cpo_alpha > 0",
                        _loss),
    "label_smoothing": mapped("algorithm.label_smoothing (read with loss_type)", lambda v, a: {}),
    "cpo_alpha": mapped("algorithm.cpo_alpha / the sft weight (read with loss_type)", lambda v, a: {}),
    "simpo_gamma": mapped("algorithm.simpo_gamma (read with loss_type)", lambda v, a: {}),
    "alpha": mapped("algorithm.alphapo_alpha (AlphaPO's reward transformation, with simpo / ipo; read with "
                    "loss_type)", lambda v, a: {}),
}
CPO_RULES = {k: v for k, v in CPO_RULES.items() if k in FIELDS["CPOConfig"]}  # this class's fields only
CPOConfig = make_config_class("CPOConfig", CPO_RULES)


class ReferenceFreeTrainer(PreferenceTrainer):
    """A TRL preference trainer without a reference model, on `tiller dpo` (CPO, SimPO, ORPO)."""

    trl_metric_names = {}

    def __init__(self, model: Any = None, args: Any = None, data_collator: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, model_init: Any = None,
                 callbacks: Any = None, optimizers: Any = (None, None), preprocess_logits_for_metrics: Any = None,
                 peft_config: Any = None, compute_metrics: Any = None):
        # import cost: the config stack loads only when a run starts
        from tiller.config.jobs import DPOConfig as JobConfig
        # import cost: only the chosen job's trainer
        from tiller.trainer.preference import train_dpo

        type(self).job_schema, type(self).entry = JobConfig, staticmethod(train_dpo)
        self._set_up_job(model, args, train_dataset, eval_dataset, processing_class, peft_config,
                         data_collator=data_collator, compute_metrics=compute_metrics, callbacks=callbacks,
                         optimizers=optimizers, model_init=model_init,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self._set_ref(None)

    def _data(self, private: dict[str, Any]) -> dict[str, Any]:
        return self._preference_data(dpo_rows)


class CPOTrainer(ReferenceFreeTrainer):
    """TRL's experimental CPOTrainer: `CPOTrainer(model, args=CPOConfig(...), train_dataset=..., eval_dataset=None,
    processing_class=None, peft_config=None)`; runs `tiller dpo` (see the module docstring)."""

    config_class = CPOConfig


def cpo_field_table() -> str:
    """The markdown table of CPOConfig's fields (docs/trl.md)."""
    return field_table("CPOConfig", CPOConfig.RULES)


__all__ = ["CPOConfig", "CPOTrainer", "CPO_RULES"]
