"""TRL 1.16's `DistillationConfig` / `DistillationTrainer` on tiller's RL driver (the RL front end of
`tiller.trl.rl_front`): on-policy knowledge distillation with the full-vocabulary generalized JSD.

TRL's trainer, field by field on tiller's keys:

- generation: one completion per prompt from the student (actor_rollout_ref.rollout.n=1), at `temperature` (also
  the loss temperature: tiller divides both models' logits by the rollout temperature, as TRL), top_p / top_k /
  min_p; no dataset completions are mixed in (TRL 1.16's trainer has no such fraction).
- loss: algorithm.distill.loss_mode=gjsd with algorithm.distill.beta = `beta` (0 forward KL, 1 reverse KL, TRL's
  default; `tiller.algos.distill.gjsd_loss`, TRL's `_chunked_divergence_loss`), supervised
  (use_policy_gradient=false), alone (use_outcome_reward=false: TRL's trainer has no reward). Reduction: TRL divides
  the summed per-token divergence by the generation batch's completion tokens (`num_items_in_batch`) = tiller's
  token-mean over the mini-batch, which is the whole generation batch here.
- batches: a generation batch = per_device_train_batch_size x gradient_accumulation_steps prompts, one optimizer
  step on it (data.train_batch_size = actor.ppo_mini_batch_size = that, micro-batch = per_device_train_batch_size,
  ppo_epochs = 1).
- the teacher: `teacher_model` (a dir or a loaded model, saved under output_dir/teacher_model) or
  `teacher_model_name_or_path`: algorithm.distill.teacher_path (its tokenizer must equal the student's: the
  vocabulary is shared).
- no reward: tiller's driver scores every completion; here with a constant 0 (`critic/score/mean` is 0).
- eval_dataset is refused: TRL's eval_loss (the divergence on eval prompts) is not what tiller's validation computes.

Logged under TRL's names beside tiller's: `loss` (distillation/loss), `entropy` (distillation/student_entropy, the
student's entropy at the loss temperature), `completions/*`, `learning_rate`, `grad_norm`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiller.errors import ConfigError
from tiller.trl.base import refuse_arguments
from tiller.trl.common import Rule, make_config_class, mapped, noop, refuse_value, refused, to
from tiller.trl.fields import FIELDS
from tiller.trl.rewards import TRLRewards
from tiller.trl.rl_front import RL_SHARED_RULES, TRLRLTrainer

TEACHER_DIR = "teacher_model"  # under output_dir: a teacher given as a loaded model, saved


def _beta(value: Any, args: Any) -> dict:
    return {"beta": float(value)}


def _teacher_init_kwargs(value: Any, args: Any) -> dict:
    """TRL's script passes {revision, trust_remote_code, attn_implementation, dtype}: tiller loads the teacher from
    a local dir in float32 with the student's trust_remote_code."""
    kwargs = dict(value or {})
    unknown = set(kwargs) - {"dtype", "torch_dtype", "attn_implementation", "revision", "trust_remote_code"}
    if unknown:
        raise refuse_value("teacher_model_init_kwargs", value, "tiller loads the teacher with its dtype only "
                           f"(not {', '.join(sorted(unknown))})")
    if kwargs.get("revision") not in (None, "main"):
        raise refuse_value("teacher_model_init_kwargs", value, "tiller loads the teacher from a local dir (no hub "
                           "revision)")
    if kwargs.get("trust_remote_code") not in (None, bool(args.trust_remote_code)):
        raise refuse_value("teacher_model_init_kwargs", value, "the teacher's trust_remote_code is the config's "
                           "trust_remote_code (the student's)")
    if kwargs.get("attn_implementation") not in (None, "eager", "sdpa"):
        raise refuse_value("teacher_model_init_kwargs", value, "tiller's teacher uses transformers' default "
                           "attention (eager / sdpa)")
    out: dict[str, Any] = {}
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype not in (None, "auto", "float32"):
        out["notices"] = [f"teacher_model_init_kwargs dtype={dtype!r}: tiller keeps the teacher's weights in "
                          "float32 and computes in the bf16 setting's dtype"]
    return out


_OWN = {
    "teacher_model_name_or_path": mapped("algorithm.distill.teacher_path (a local model dir; the trainer's "
                                         "teacher_model argument takes precedence)",
                                         to("teacher_path", lambda v: str(v) if v else None)),
    "teacher_model_revision": refused("tiller loads the teacher from a local dir (no hub revision)"),
    "teacher_model_init_kwargs": mapped("dtype (a notice: the teacher is float32), revision main, trust_remote_code "
                                        "= the config's, attn_implementation eager / sdpa; others refused",
                                        _teacher_init_kwargs),
    "temperature": mapped("actor_rollout_ref.rollout.temperature (and val_kwargs): the sampling and the loss "
                          "temperature, as TRL's", to("temperature", float)),
    "beta": mapped("algorithm.distill.beta with loss_mode=gjsd (0 forward KL, 1 reverse KL, else JSD)", _beta),
    "max_tool_calling_iterations": noop("read only with tools, which tiller's DistillationTrainer refuses"),
}
DISTILL_RULES: dict[str, Rule] = {
    **{k: v for k, v in RL_SHARED_RULES.items() if k in FIELDS["DistillationConfig"]}, **_OWN,
}


def _post_init(self: Any) -> None:
    """DistillationConfig.__post_init__'s checks (pad_to_multiple_of is a no-op in tiller)."""
    if self.auto_find_batch_size:
        raise ConfigError("auto_find_batch_size=True: refused: set per_device_train_batch_size")
    if self.beta < 0.0 or self.beta > 1.0:
        raise ConfigError(f"beta must be in [0.0, 1.0], got {self.beta}.")


DistillationConfig = make_config_class("DistillationConfig", DISTILL_RULES, _post_init)


def _zero_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """TRL's DistillationTrainer has no reward; tiller's driver scores every completion: with 0."""
    return [0.0] * len(completions)


class DistillationTrainer(TRLRLTrainer):
    """TRL's DistillationTrainer (1.16 signature) on tiller: `train()`, `save_model()`, `state.log_history`,
    `model`."""

    config_class = DistillationConfig
    loss_key = "distillation/loss"

    def __init__(self, model: Any, teacher_model: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, callbacks: Any = None,
                 optimizers: tuple = (None, None), quantization_config: Any = None, peft_config: Any = None,
                 tools: Any = None):
        refuse_arguments("DistillationTrainer", optimizers=optimizers, tools=tools)
        if train_dataset is None:
            raise ConfigError("train_dataset: required (the prompts the student completes)")
        if eval_dataset is not None:
            raise ConfigError("eval_dataset: refused: TRL's distillation eval_loss (the divergence on eval prompts) "
                              "is not computed by tiller's validation, which scores rewards; evaluate the saved "
                              "model instead")
        self._set_up_rl(model, [_zero_reward], args, train_dataset, eval_dataset, processing_class, None,
                        peft_config, quantization_config=quantization_config, callbacks=callbacks)
        self.teacher_path = self._teacher_path(teacher_model)

    def _reward_functions(self, reward_funcs: Any, processing_classes: Any) -> TRLRewards:
        return TRLRewards([_zero_reward], ["zero"], [1.0], {"train": [], "eval": []}, self.conversational)

    def _batch_arithmetic(self) -> dict[str, int]:
        b, ga = int(self.args.per_device_train_batch_size), int(self.args.gradient_accumulation_steps)
        return {"prompts": b * ga, "mini_prompts": b * ga, "micro": b, "epochs": 1, "k": 1}

    def _teacher_path(self, teacher_model: Any) -> str:
        """The teacher's model dir: `teacher_model` (a dir, or a loaded model saved under output_dir), else
        args.teacher_model_name_or_path."""
        # import cost: torch / safetensors load only when a model is saved
        from tiller.models.checkpoint import save_pretrained_atomic

        if teacher_model is None:
            teacher_model = self.args.teacher_model_name_or_path
        if teacher_model is None:
            raise ConfigError("teacher_model: a teacher is required for distillation: pass teacher_model or set "
                              "teacher_model_name_or_path")
        if isinstance(teacher_model, (str, Path)):
            if not Path(teacher_model).expanduser().is_dir():
                raise ConfigError(f"teacher_model={str(teacher_model)!r}: not a local model dir (tiller loads no "
                                  "hub models here)")
            return str(teacher_model)
        if hasattr(teacher_model, "save_pretrained") and hasattr(teacher_model, "config"):
            # the teacher's tokenizer: the student's (tiller checks the two vocabularies are equal)
            tok = self.processing_class if hasattr(self.processing_class, "save_pretrained") else None
            return str(save_pretrained_atomic(self.run_dir / TEACHER_DIR, teacher_model, tok))
        raise ConfigError(f"teacher_model: a {type(teacher_model).__name__}: give a model dir or a loaded "
                          "PreTrainedModel")

    def _shared_keys(self) -> dict[str, Any]:
        lg = self.logical
        lg.update(num_generations=1, num_generations_eval=1, epsilon=0.2, epsilon_high=None, mask_truncated=False)
        return super()._shared_keys()

    def _algorithm_keys(self) -> dict[str, Any]:
        actor, d = "actor_rollout_ref.actor", "algorithm.distill"
        return {"algorithm.adv_estimator": "grpo", f"{actor}.loss_agg_mode": "token-mean",
                f"{actor}.use_kl_loss": False, f"{actor}.entropy_coeff": 0.0,
                f"{d}.teacher_path": self.teacher_path, f"{d}.loss_mode": "gjsd", f"{d}.beta": self.logical["beta"],
                f"{d}.use_policy_gradient": False, f"{d}.use_outcome_reward": False}

    def _trl_metrics(self, row: dict[str, Any]) -> dict[str, Any]:
        out = super()._trl_metrics(row)
        out.pop("entropy", None)  # TRL's is the student's entropy at the loss temperature, over the loss's tokens
        if "distillation/student_entropy" in row:
            out["entropy"] = row["distillation/student_entropy"]
        return out


__all__ = ["DistillationConfig", "DistillationTrainer", "DISTILL_RULES"]
