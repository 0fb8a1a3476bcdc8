"""TRL's `RewardConfig` / `RewardTrainer` on `tiller rm` (`tiller.trainer.rm.train_rm`).

Rows: `chosen` / `rejected` (whole sequences, the prompt implicit) or `prompt` + `chosen` / `rejected`, standard or
conversational, with an optional `margin` column: `tiller.trl.preference.reward_rows` writes whole sequences as TRL
tokenizes them (a conversation through the chat template; a string with eos appended). The model is a one-label
`AutoModelForSequenceClassification` read at the last token; the loss is -log sigma(s_c - s_r - margin) averaged
over pairs, plus center_rewards_coefficient x mean((s_c + s_r)^2) (`tiller.algos.pairwise_rm_loss`). `save_model()`
writes that sequence-classification model: `tiller rl reward_model.enable=True reward_model.model.path=<dir>` and
transformers load it. Deviation: a pair longer than max_length is an error naming the row (TRL drops it).
"""

from __future__ import annotations

from typing import Any

from tiller.trl.fields import FIELDS
from tiller.trl.common import field_table, make_config_class, mapped, noop, refuse_value
from tiller.trl.dpo import PREFERENCE_RULES, PreferenceTrainer
from tiller.trl.preference import reward_rows
from tiller.trl.sft import COMMON_MODEL_RULES, SFT_RULES


def _center(value: Any, args: Any) -> dict:
    return {"algorithm.center_rewards_coefficient": float(value or 0.0)}


def _no_truncation(value: Any, args: Any) -> dict:
    out = COMMON_MODEL_RULES["max_length"].apply(value, args)
    out["data.truncation"] = "error"  # TRL filters out longer pairs; tiller names them
    return out


def _refuse_router(value: Any) -> dict:
    raise refuse_value("router_aux_loss_coef", value, "tiller's reward-model job adds no router load-balancing loss")


REWARD_RULES = {
    **COMMON_MODEL_RULES,
    "chat_template_path": SFT_RULES["chat_template_path"],
    "eos_token": SFT_RULES["eos_token"],
    "disable_dropout": PREFERENCE_RULES["disable_dropout"],
    "max_length": mapped("data.max_length; a longer pair is an error naming the row (TRL drops it)", _no_truncation),
    "center_rewards_coefficient": mapped("algorithm.center_rewards_coefficient (None: 0)", _center),
    "router_aux_loss_coef": mapped("None or 0 (tiller's reward-model job adds no router loss; others refused)",
                                   lambda v, a: {} if not v else _refuse_router(v)),
    "pad_token": noop("tiller pads with the tokenizer's pad token; the score reads the last real token"),
}

REWARD_RULES = {k: v for k, v in REWARD_RULES.items() if k in FIELDS["RewardConfig"]}  # this class's fields only
RewardConfig = make_config_class("RewardConfig", REWARD_RULES)


class RewardTrainer(PreferenceTrainer):
    """TRL's RewardTrainer: `RewardTrainer(model, args=RewardConfig(...), train_dataset=..., eval_dataset=None,
    processing_class=None, peft_config=None)`; runs `tiller rm` (see the module docstring)."""

    config_class = RewardConfig
    trl_metric_names = {"score_gap": "margin"}

    def __init__(self, model: Any, args: Any = None, data_collator: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, compute_metrics: Any = None,
                 callbacks: Any = None, optimizers: Any = (None, None), optimizer_cls_and_kwargs: Any = None,
                 preprocess_logits_for_metrics: Any = None, quantization_config: Any = None,
                 peft_config: Any = None):
        # import cost: the config stack loads only when a run starts
        from tiller.config.jobs import RMConfig as JobConfig
        # import cost: only the chosen job's trainer
        from tiller.trainer.rm import train_rm

        type(self).job_schema, type(self).entry = JobConfig, staticmethod(train_rm)
        self._set_up_job(model, args, train_dataset, eval_dataset, processing_class, peft_config,
                         data_collator=data_collator, compute_metrics=compute_metrics, callbacks=callbacks,
                         optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                         quantization_config=quantization_config)
        self.ref_path = None

    def _data(self, private: dict[str, Any]) -> dict[str, Any]:
        keys = self._preference_data(reward_rows)
        if "_eos_token" in private:
            keys["model.tokenizer_path"] = self.tokenizer_with_eos(private["_eos_token"])
        return keys

    @property
    def model(self) -> Any:
        """The trained reward model (a sequence-classification model) after train(), else the model given."""
        from transformers import AutoModelForSequenceClassification

        if self._trained and getattr(self, "_trained_model", None) is None:
            import tempfile
            from pathlib import Path

            with tempfile.TemporaryDirectory(prefix="tiller-trl-rm-") as tmp:
                self._export(Path(tmp) / "model")
                self._trained_model = AutoModelForSequenceClassification.from_pretrained(Path(tmp) / "model")
        if self._trained:
            return self._trained_model
        if self._model_obj is None:
            self._model_obj = AutoModelForSequenceClassification.from_pretrained(self.model_path, num_labels=1)
        return self._model_obj


def reward_field_table() -> str:
    """The markdown table of RewardConfig's fields (docs/trl.md)."""
    return field_table("RewardConfig", RewardConfig.RULES)
