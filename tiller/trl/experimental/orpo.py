"""TRL's experimental `ORPOConfig` / `ORPOTrainer` (ORPO, Hong et al. 2024) on `tiller dpo algorithm.loss=orpo`.

The loss is the chosen completions' NLL plus `beta` x -log sigma(log odds ratio) (ORPO's lambda is TRL's beta), on
length-averaged log-probs, no reference model (`tiller.algos.reference_free_loss`); logged as TRL's ORPOTrainer
names them (`log_odds_ratio`, `log_odds_chosen`, `nll_loss`, rewards = beta x the averaged log-probs).
"""

from __future__ import annotations

from typing import Any

from tiller.trl.common import field_table, make_config_class, mapped, noop
from tiller.trl.experimental.cpo import REFERENCE_FREE_RULES, ReferenceFreeTrainer
from tiller.trl.fields import FIELDS

ORPO_RULES = {
    **REFERENCE_FREE_RULES,
    "beta": mapped("algorithm.loss=orpo, algorithm.beta (ORPO's lambda: the odds-ratio term's weight)",
                   lambda v, a: {"algorithm.loss": "orpo", "algorithm.beta": float(v)}),
    "padding_value": noop("tiller pads with the tokenizer's pad id and masks padding out of the loss"),
}
ORPO_RULES = {k: v for k, v in ORPO_RULES.items() if k in FIELDS["ORPOConfig"]}  # this class's fields only
ORPOConfig = make_config_class("ORPOConfig", ORPO_RULES)


class ORPOTrainer(ReferenceFreeTrainer):
    """TRL's experimental ORPOTrainer: `ORPOTrainer(model, args=ORPOConfig(...), train_dataset=..., eval_dataset=None,
    processing_class=None, peft_config=None)`; runs `tiller dpo algorithm.loss=orpo`."""

    config_class = ORPOConfig


def orpo_field_table() -> str:
    """The markdown table of ORPOConfig's fields (docs/trl.md)."""
    return field_table("ORPOConfig", ORPOConfig.RULES)


__all__ = ["ORPOConfig", "ORPOTrainer", "ORPO_RULES"]
