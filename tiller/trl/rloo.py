"""TRL 1.16's `RLOOConfig` / `RLOOTrainer` on tiller's RL driver (the RL front end of `tiller.trl.rl_front`).

TRL's RLOO, field by field on verl's keys:

- reward: nansum(rewards x reward_weights), clipped to `reward_clip_range` (reward_model.clip_range: tiller clips
  the scalar reward before any shaping, as TRL), minus beta x the sequence's summed k1 KL log pi_old - log pi_ref
  (KL in the reward: algorithm.use_kl_in_reward, kl_penalty=kl, a fixed controller with kl_coef = beta; TRL's
  default beta 0.05 brings in the reference model).
- advantage: r_i - the mean of the other completions of its group = algorithm.adv_estimator=rloo.
  `normalize_advantages` (whitening over the batch) is refused.
- loss: TRL clips the *sequence's* ratio exp(sum_t log pi / pi_old) and averages -min(r A, clip(r) A) over
  sequences. On-policy (one optimizer step per generation batch, num_iterations=1: TRL's default) the ratio is 1
  and its gradient is -(1/B) sum_i A_i sum_t grad log pi(y_i,t), the gradient of tiller's token-level clip
  aggregated seq-mean-token-sum (vanilla loss); the two differ once the ratio moves (several optimizer steps or
  iterations per generation batch), so that is refused. The logged loss values differ (TRL's is -mean(A) x 1).
"""

from __future__ import annotations

from typing import Any

from tiller.errors import ConfigError
from tiller.trl.common import Rule, make_config_class, mapped, refuse_value, to
from tiller.trl.base import refuse_arguments
from tiller.trl.grpo import generation_post_init
from tiller.trl.rl_front import RL_SHARED_RULES, TRLRLTrainer


def _normalize(value: Any, args: Any) -> dict:
    if value:
        raise refuse_value("normalize_advantages", value, "tiller's rloo estimator does not whiten the advantages "
                           "over the batch")
    return {}


def _clip_range(value: Any, args: Any) -> dict:
    if value is None:
        return {}
    low, high = (float(v) for v in value)
    if not low < high:
        raise refuse_value("reward_clip_range", value, "(min, max) with min < max")
    return {"reward_clip_range": [low, high]}


RLOO_RULES: dict[str, Rule] = {
    **RL_SHARED_RULES,
    "beta": mapped("KL in the reward: algorithm.use_kl_in_reward (beta > 0), kl_penalty=kl (k1, summed over the "
                   "sequence), kl_ctrl fixed, kl_coef = beta; TRL's default 0.05", to("beta", float)),
    "num_iterations": mapped("actor.ppo_epochs; > 1 refused (TRL clips the sequence's ratio, tiller per token: the "
                             "same only on-policy)", to("num_iterations", int)),
    "normalize_advantages": mapped("False (TRL's default); True refused", _normalize),
    "reward_clip_range": mapped("reward_model.clip_range", _clip_range),
}


RLOOConfig = make_config_class("RLOOConfig", RLOO_RULES, lambda self: generation_post_init(self, "RLOO"))


class RLOOTrainer(TRLRLTrainer):
    """TRL's RLOOTrainer (1.16 signature) on tiller: `train()`, `save_model()`, `state.log_history`, `model`."""

    config_class = RLOOConfig

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Any = None, optimizers: tuple = (None, None), peft_config: Any = None,
                 rollout_func: Any = None):
        refuse_arguments("RLOOTrainer", optimizers=optimizers, rollout_func=rollout_func)
        self._set_up_rl(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                        reward_processing_classes, peft_config, callbacks=callbacks)
        if self.arithmetic["k"] != 1:
            raise ConfigError(f"num_iterations={self.args.num_iterations}, steps_per_generation="
                              f"{self.args.steps_per_generation}: refused: TRL's RLOO clips the sequence's "
                              "importance ratio, tiller's per token; they agree only on-policy (num_iterations=1, "
                              "steps_per_generation = gradient_accumulation_steps)")

    def _algorithm_keys(self) -> dict[str, Any]:
        lg, actor = self.logical, "actor_rollout_ref.actor"
        keys: dict[str, Any] = {
            "algorithm.adv_estimator": "rloo", f"{actor}.policy_loss.loss_mode": "vanilla",
            f"{actor}.loss_agg_mode": "seq-mean-token-sum", f"{actor}.use_kl_loss": False,
            "algorithm.use_kl_in_reward": lg["beta"] > 0, f"{actor}.entropy_coeff": 0.0,
        }
        if lg["beta"] > 0:
            keys.update({"algorithm.kl_penalty": "kl", "algorithm.kl_ctrl.type": "fixed",
                         "algorithm.kl_ctrl.kl_coef": lg["beta"]})
        if lg.get("reward_clip_range"):
            keys["reward_model.clip_range"] = lg["reward_clip_range"]
        return keys


__all__ = ["RLOOConfig", "RLOOTrainer", "RLOO_RULES"]
