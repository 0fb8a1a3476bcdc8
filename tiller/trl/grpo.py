"""TRL 1.16's `GRPOConfig` / `GRPOTrainer` on tiller's RL driver (`tiller.trainer.rl`).

Every GRPOConfig field is mapped, a no-op or refused (`GRPO_RULES` with TrainingArguments' and the RL front end's
shared rules; docs/trl.md prints the table). The algorithm fields on verl's keys:

- advantages: TRL's (r - mean_group) / (std_group + 1e-4) = algorithm.adv_estimator=grpo with
  algorithm.norm_adv_epsilon=1e-4 (Bessel-corrected group std in both); scale_rewards none = Dr.GRPO's mean-centring
  (norm_adv_by_std_in_grpo=False); batch = the whole batch's std (algorithm.norm_adv_std_scope=batch).
- loss_type -> the policy loss and its aggregation (TRL's normalisation per optimizer step):
    grpo     vanilla, seq-mean-token-mean      (per sequence 1/|o_i|, mean over sequences)
    bnpo     vanilla, token-mean               (TRL divides each micro-batch by its own tokens; tiller the
                                                mini-batch's: equal with gradient_accumulation_steps=1)
    dr_grpo  vanilla, seq-mean-token-sum-norm  with actor.loss_scale_factor = max_completion_length
    dapo     vanilla, token-mean               (the generation batch's tokens / (steps_per_generation /
                                                gradient_accumulation_steps): the mini-batch's tokens when one
                                                optimizer step takes the whole generation batch, TRL's default)
    luspo    vanilla, seq-mean-token-sum
    cispo    cispo, token-mean, clip_ratio_low=1 (no lower clip), clip_ratio_high = epsilon_high - 1 (TRL clamps
             the ratio at epsilon_high itself)
    sapo     sapo (actor.tau_pos / tau_neg = sapo_temperature_pos / neg), seq-mean-token-mean
    vespo    vespo (the vespo_* fields), token-mean; with use_vllm TRL's token-level IS ratio enters the sequence
             weight (tiller's rollout-correction weights go inside the vespo loss), sequence_* modes refused as TRL
- importance_sampling_level=sequence: GSPO (policy_loss.loss_mode=gspo) with the loss type's aggregation (the
  clip-family loss types only).
- delta: the dual clip actor.clip_ratio_c (TRL caps the ratio at delta on the unclipped side: for A < 0 that is
  verl's dual clip; for A > 0 the clipped term binds first when delta >= 1 + epsilon_high). None: no dual clip.
- top_entropy_quantile / off_policy_mask_threshold: actor.top_entropy_quantile (the policy gradient on the
  micro-batch's top share of tokens by entropy) / actor.off_policy_mask_threshold (OPSM: negative-advantage responses
  far off-policy leave the gradient; the KL is against the rollout's logprobs, TRL's vLLM case).
- beta: the k3 KL loss (verl's low_var_kl, which clamps the per-token KL to [-10, 10]) with coefficient beta;
- use_bias_correction_kl (TRL's default True): with beta > 0 the KL term times the importance ratio
  (actor.kl_loss_importance_weight; per sequence under GSPO, as TRL broadcasts its sequence weight).
"""

from __future__ import annotations

from typing import Any

from tiller.errors import ConfigError
from tiller.trl.common import Rule, make_config_class, mapped, refuse_value, refused, to
from tiller.trl.base import refuse_arguments
from tiller.trl.rl_front import RL_SHARED_RULES, TRLRLTrainer, vllm_is_keys

TRL_ADV_EPSILON = 1e-4  # TRL's (r - mean) / (std + 1e-4)

LOSS_TYPES = {  # loss_type -> (policy loss_mode, loss_agg_mode)
    "grpo": ("vanilla", "seq-mean-token-mean"), "bnpo": ("vanilla", "token-mean"),
    "dr_grpo": ("vanilla", "seq-mean-token-sum-norm"), "dapo": ("vanilla", "token-mean"),
    "luspo": ("vanilla", "seq-mean-token-sum"), "cispo": ("cispo", "token-mean"),
    "sapo": ("sapo", "seq-mean-token-mean"), "vespo": ("vespo", "token-mean"),
}


def _loss_type(value: Any, args: Any) -> dict:
    if value not in LOSS_TYPES:
        raise refuse_value("loss_type", value, f"tiller maps {', '.join(LOSS_TYPES)}")
    return {"loss_type": value}


def _scale_rewards(value: Any, args: Any) -> dict:
    value = {True: "group", False: "none"}.get(value, value)
    if value not in ("group", "batch", "none"):
        raise refuse_value("scale_rewards", value, "group | batch | none (or True / False)")
    return {"scale_rewards": value}


def _aggregation(value: Any, args: Any) -> dict:
    if value not in ("sum_then_normalize", "normalize_then_sum"):
        raise refuse_value("multi_objective_aggregation", value, "sum_then_normalize | normalize_then_sum")
    if value == "normalize_then_sum" and args.scale_rewards not in ("group", True):
        raise refuse_value("scale_rewards", args.scale_rewards, "TRL's normalize_then_sum ignores scale_rewards (it "
                           "divides each function's rewards by their group std, then the sum by the batch's std); "
                           "leave scale_rewards at 'group'")
    return {"multi_objective_aggregation": value}


def _importance_level(value: Any, args: Any) -> dict:
    if value not in ("token", "sequence"):
        raise refuse_value("importance_sampling_level", value, "token | sequence")
    return {"importance_sampling_level": value}


def _entropy(value: Any, args: Any) -> dict:
    if not value:
        return {}
    if args.gradient_accumulation_steps != 1:
        raise refuse_value("entropy_coef", value, "TRL's entropy bonus is a token mean per micro-batch (divided by "
                           "the accumulation steps), tiller's (actor.entropy_agg_mode=token-mean) the optimizer "
                           "step's: the same with gradient_accumulation_steps=1")
    return {"entropy_coef": float(value)}


def _adaptive_entropy(value: Any, args: Any) -> dict:
    if not value:
        return {}
    if args.gradient_accumulation_steps != 1 or args.steps_per_generation != 1 or args.num_iterations != 1:
        raise refuse_value("use_adaptive_entropy", value, "TRL updates the coefficient every optimizer step, tiller "
                           "every RL step: the same with one optimizer step per generation (gradient_accumulation_"
                           "steps=1, steps_per_generation=1, num_iterations=1)")
    if args.top_entropy_quantile < 1.0:
        raise refuse_value("use_adaptive_entropy", value, "TRL's controller then measures the entropy of the "
                           "top_entropy_quantile tokens, tiller's of all completion tokens")
    if not args.entropy_coef_min <= args.entropy_coef <= args.entropy_coef_max:
        raise refuse_value("entropy_coef", args.entropy_coef, f"the adaptive controller's start must lie in "
                           f"[entropy_coef_min, entropy_coef_max] = [{args.entropy_coef_min}, {args.entropy_coef_max}]")
    return {"adaptive_entropy": {"enable": True, "init_coeff": float(args.entropy_coef),
                                 "target_entropy": float(args.entropy_target), "delta": float(args.entropy_coef_delta),
                                 "max_coeff": float(args.entropy_coef_max), "min_coeff": float(args.entropy_coef_min),
                                 "inclusive": True}}


def _kl_correction(value: Any, args: Any) -> dict:
    return {"use_bias_correction_kl": bool(value)}


def _delta(value: Any, args: Any) -> dict:
    if value is None:
        return {}
    high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    if value < 1 + high:
        raise refuse_value("delta", value, f"tiller's dual clip (actor.clip_ratio_c) needs delta >= 1 + epsilon_high "
                           f"= {1 + high}")
    return {"delta": float(value)}


GRPO_RULES: dict[str, Rule] = {
    **RL_SHARED_RULES,
    "cast_lm_head_to_fp32": mapped("actor_rollout_ref.model.lm_head_fp32 (the policy's and the reference's LM head in "
                                   "float32 under bf16)", to("cast_lm_head_to_fp32", bool)),
    "use_liger_kernel": mapped("actor_rollout_ref.model.use_fused_kernels and model.use_remove_padding (the LM head "
                               "run with the log-probs chunk by chunk: the logits never whole, what Liger's fused "
                               "linear GRPO loss saves)", to("use_liger_kernel", bool)),
    "delta": mapped("actor.clip_ratio_c (dual clip; None: off)", _delta),
    "sapo_temperature_neg": mapped("actor.tau_neg (loss_type sapo)", to("sapo_temperature_neg", float)),
    "sapo_temperature_pos": mapped("actor.tau_pos (loss_type sapo)", to("sapo_temperature_pos", float)),
    **{f"vespo_{k}": mapped(f"actor.policy_loss.vespo_{k} (loss_type vespo)", to(f"vespo_{k}", float))
       for k in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")},
    "importance_sampling_level": mapped("sequence: policy_loss.loss_mode=gspo (GSPO)", _importance_level),
    "multi_objective_aggregation": mapped("sum_then_normalize: algorithm.adv_estimator=grpo; normalize_then_sum: "
                                          "gdpo, each reward function a channel (gdpo_reward_keys, its weight in "
                                          "gdpo_reward_weights), algorithm.gdpo_normalization=sequence",
                                          _aggregation),
    "scale_rewards": mapped("group: algorithm.adv_estimator=grpo, norm_adv_epsilon 1e-4; batch: "
                            "norm_adv_std_scope=batch; none: norm_adv_by_std_in_grpo=False", _scale_rewards),
    "loss_type": mapped("policy loss + loss_agg_mode (see the GRPO section)", _loss_type),
    "top_entropy_quantile": mapped("actor.top_entropy_quantile (the micro-batch's high-entropy tokens; with "
                                   "entropy_coef the bonus sums over them with tiller's denominator)",
                                   to("top_entropy_quantile", float)),
    "entropy_coef": mapped("actor.entropy_coeff, entropy_agg_mode=token-mean (gradient_accumulation_steps=1); with "
                           "use_adaptive_entropy: adaptive_entropy.init_coeff", _entropy),
    "use_adaptive_entropy": mapped("actor.adaptive_entropy (enable, inclusive: TRL's <=; one optimizer step per "
                                   "generation)", _adaptive_entropy),
    "entropy_coef_min": mapped("actor.adaptive_entropy.min_coeff (read with use_adaptive_entropy)", lambda v, a: {}),
    "entropy_coef_max": mapped("actor.adaptive_entropy.max_coeff (read with use_adaptive_entropy)", lambda v, a: {}),
    "entropy_coef_delta": mapped("actor.adaptive_entropy.delta (read with use_adaptive_entropy)", lambda v, a: {}),
    "entropy_target": mapped("actor.adaptive_entropy.target_entropy (read with use_adaptive_entropy)",
                             lambda v, a: {}),
    "max_tool_calling_iterations": mapped("with tools / environment_factory: the tool rounds of a completion (TRL's "
                                          "tool loop, tiller.trl.tool_loop; None: until no call or the budget)",
                                          to("max_tool_calling_iterations")),
    "vllm_importance_sampling_correction": mapped(
        "with use_vllm: algorithm.rollout_correction.rollout_is = token | sequence (the mode's level); *_truncate: "
        "rollout_is_threshold = clip_max; *_mask: 'clip_min_clip_max' (IcePop)", vllm_is_keys),
    "vllm_importance_sampling_mode": mapped("read with vllm_importance_sampling_correction", lambda v, a: {}),
    "vllm_importance_sampling_clip_max": mapped("read with vllm_importance_sampling_correction", lambda v, a: {}),
    "vllm_importance_sampling_clip_min": mapped("read with vllm_importance_sampling_correction", lambda v, a: {}),
    "off_policy_mask_threshold": mapped("actor.off_policy_mask_threshold (OPSM; the KL against the rollout's "
                                        "logprobs)", to("off_policy_mask_threshold")),
    "use_bias_correction_kl": mapped("with beta > 0: actor_rollout_ref.actor.kl_loss_importance_weight (the KL term "
                                     "times the importance ratio, per sequence with importance_sampling_level="
                                     "sequence)", _kl_correction),
    "log_completions_hub_repo": refused("tiller does not upload; log_completions writes them under output_dir"),
    "vllm_importance_sampling_cap": mapped("deprecated: vllm_importance_sampling_clip_max (TRL copies it there)",
                                           lambda v, a: {}),
}


def generation_post_init(self: Any, algorithm: str = "GRPO") -> None:
    """GRPOConfig / RLOOConfig.__post_init__: the batch arithmetic (one process) and its checks, as TRL raises them."""
    if hasattr(self, "scale_rewards"):
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
    if self.auto_find_batch_size:
        raise ConfigError("auto_find_batch_size=True: refused: set per_device_train_batch_size")
    b = self.per_device_train_batch_size
    if self.generation_batch_size is None and self.steps_per_generation is None:
        self.steps_per_generation = self.gradient_accumulation_steps
        self.generation_batch_size = b * self.steps_per_generation
    elif self.generation_batch_size is not None and self.steps_per_generation is None:
        if self.generation_batch_size % b:
            raise ConfigError(f"generation_batch_size ({self.generation_batch_size}) must be divisible by the global "
                              f"batch size ({b}).")
        self.steps_per_generation = self.generation_batch_size // b
    elif self.generation_batch_size is None:
        self.generation_batch_size = b * self.steps_per_generation
    else:
        raise ConfigError("'generation_batch_size' and 'steps_per_generation' can not be both configured at the "
                          "same time")
    if self.generation_batch_size % self.num_generations:
        raise ConfigError(f"generation_batch_size ({self.generation_batch_size}) must be divisible by num_generations "
                          f"({self.num_generations}).")
    if self.num_generations < 2:
        raise ConfigError(f"{algorithm} requires at least 2 generations per prompt to calculate the advantages. "
                          f"You provided {self.num_generations}, which is less than the minimum required.")
    if getattr(self, "vllm_importance_sampling_cap", None) is not None:
        self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap


GRPOConfig = make_config_class("GRPOConfig", GRPO_RULES, generation_post_init)


class GRPOTrainer(TRLRLTrainer):
    """TRL's GRPOTrainer (1.16 signature) on tiller: `train()`, `save_model()`, `state.log_history`, `model`."""

    config_class = GRPOConfig

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Any = None, optimizers: tuple = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: Any = None, rollout_func: Any = None,
                 environment_factory: Any = None):
        refuse_arguments("GRPOTrainer", optimizers=optimizers, rollout_func=rollout_func)
        self._set_up_rl(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                        reward_processing_classes, peft_config, tools=tools, environment_factory=environment_factory,
                        quantization_config=quantization_config, callbacks=callbacks)

    def _algorithm_notices(self) -> list[str]:
        loss_type, args = self.logical["loss_type"], self.args
        if loss_type == "bnpo" and args.gradient_accumulation_steps > 1:
            return ["loss_type='bnpo': TRL divides each micro-batch's loss by its own tokens, tiller by the tokens of "
                    "the optimizer step's whole mini-batch (equal with gradient_accumulation_steps=1)"]
        if loss_type in ("dapo", "cispo") and args.steps_per_generation > args.gradient_accumulation_steps:
            return [f"loss_type={loss_type!r}: TRL divides by the generation batch's tokens / (steps_per_generation / "
                    "gradient_accumulation_steps), tiller by each mini-batch's own tokens (equal when "
                    "steps_per_generation = gradient_accumulation_steps)"]
        return []

    def _algorithm_keys(self) -> dict[str, Any]:
        lg, actor = self.logical, "actor_rollout_ref.actor"
        loss_mode, agg = LOSS_TYPES[lg["loss_type"]]
        if lg["importance_sampling_level"] == "sequence":
            if loss_mode != "vanilla":
                raise ConfigError(f"importance_sampling_level=sequence with loss_type={lg['loss_type']}: refused: "
                                  "tiller's GSPO is the clipped loss (loss_type grpo / bnpo / dr_grpo / dapo / luspo)")
            loss_mode = "gspo"
        keys: dict[str, Any] = {
            "algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": lg["scale_rewards"] != "none",
            "algorithm.norm_adv_std_scope": "batch" if lg["scale_rewards"] == "batch" else "group",
            "algorithm.norm_adv_epsilon": TRL_ADV_EPSILON, f"{actor}.policy_loss.loss_mode": loss_mode,
            f"{actor}.loss_agg_mode": agg, f"{actor}.entropy_coeff": lg.get("entropy_coef", 0.0),
            f"{actor}.use_kl_loss": lg["beta"] > 0,
        }
        if lg.get("entropy_coef") or lg.get("adaptive_entropy"):
            keys[f"{actor}.entropy_agg_mode"] = "token-mean"  # TRL's bonus: a token mean, whatever the loss type
        if lg.get("adaptive_entropy"):
            keys[f"{actor}.entropy_coeff"] = 0.0  # (the controller's coefficient replaces it)
            keys.update({f"{actor}.adaptive_entropy.{k}": v for k, v in lg["adaptive_entropy"].items()})
        if lg.get("multi_objective_aggregation") == "normalize_then_sum":  # GDPO: each function z-scored apart
            names = list(self.rewards.names)
            if len(set(names)) < len(names):
                raise ConfigError(f"multi_objective_aggregation='normalize_then_sum': the reward functions' names "
                                  f"{names} repeat; tiller keeps each function's rewards under its name (rename one)")
            keys.update({"algorithm.adv_estimator": "gdpo", "algorithm.gdpo_reward_keys": names,
                         "algorithm.gdpo_reward_weights": [float(w) for w in self.rewards.weights],
                         "algorithm.gdpo_normalization": "sequence", "algorithm.norm_adv_by_std_in_grpo": True})
            del keys["algorithm.norm_adv_std_scope"]
        if lg["beta"] > 0:
            keys.update({f"{actor}.kl_loss_coef": lg["beta"], f"{actor}.kl_loss_type": "low_var_kl",
                         f"{actor}.kl_loss_importance_weight": lg["use_bias_correction_kl"]})
        if agg == "seq-mean-token-sum-norm":
            keys[f"{actor}.loss_scale_factor"] = lg["max_completion_length"]
        if loss_mode == "cispo":
            high = lg["epsilon_high"] if lg["epsilon_high"] is not None else lg["epsilon"]
            keys.update({f"{actor}.clip_ratio_low": 1.0, f"{actor}.clip_ratio_high": high - 1.0})
        if loss_mode == "sapo":
            keys.update({f"{actor}.tau_pos": lg["sapo_temperature_pos"],
                         f"{actor}.tau_neg": lg["sapo_temperature_neg"]})
        if loss_mode == "vespo":
            keys.update({f"{actor}.policy_loss.vespo_{k}": lg[f"vespo_{k}"]
                         for k in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")})
        if "delta" in lg:
            keys[f"{actor}.clip_ratio_c"] = lg["delta"]
        if lg.get("top_entropy_quantile", 1.0) < 1.0:
            keys[f"{actor}.top_entropy_quantile"] = lg["top_entropy_quantile"]
        if lg.get("off_policy_mask_threshold") is not None:
            keys[f"{actor}.off_policy_mask_threshold"] = float(lg["off_policy_mask_threshold"])
        if lg.get("cast_lm_head_to_fp32"):
            keys["actor_rollout_ref.model.lm_head_fp32"] = True
        if lg.get("use_liger_kernel"):
            keys.update({"actor_rollout_ref.model.use_fused_kernels": True,
                         "actor_rollout_ref.model.use_remove_padding": True})
        return keys


__all__ = ["GRPOConfig", "GRPOTrainer", "GRPO_RULES", "LOSS_TYPES"]
