"""What TRL's online RL trainers (GRPO, RLOO) share on tiller: their generation / batch / sampling fields, the
batch arithmetic onto verl's keys, the prompt data written under the run dir, the reward functions called
in-process and the run through `tiller.trainer.rl.run` (no training code here).

TRL's batch arithmetic (one process): a generation batch of `generation_batch_size` completions =
`generation_batch_size / num_generations` prompts x `num_generations`; it is split into `steps_per_generation`
slices of `per_device_train_batch_size` completions, `gradient_accumulation_steps` slices per optimizer step, and
reused `num_iterations` times. On verl's keys:

    data.train_batch_size                   = generation_batch_size / num_generations      (prompts per step)
    actor_rollout_ref.rollout.n             = num_generations
    actor.ppo_mini_batch_size               = per_device_train_batch_size x gradient_accumulation_steps
                                              / num_generations                            (prompts per update)
    actor.ppo_micro_batch_size_per_gpu      = per_device_train_batch_size                  (completions)
    actor.ppo_epochs                        = num_iterations

so one tiller step is k = num_iterations x steps_per_generation / gradient_accumulation_steps of TRL's optimizer
steps (k = 1 by default); TRL's step counts (max_steps, warmup, save / eval steps, global_step) are divided by k.
Refused: steps_per_generation not a multiple of gradient_accumulation_steps (an optimizer step spanning
generation batches), and a mini-batch that is not whole prompt groups.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from tiller.errors import ConfigError, DataError, UserError
from tiller.trl.base import TRLTrainerBase, lora_rl_keys, refuse_arguments
from tiller.trl.common import (
    NOTICE, Rule, classify, mapped, noop, overrides, refuse_value, refused, resolve_schedule, rl_keys, to,
)
from tiller.models.loading import VISION_FAMILIES, is_vision_checkpoint
from tiller.trl.data import dataset_decoder, to_dataset_rows, write_rows_atomic
from tiller.trl.jobs import moe_config, moe_router_coef
from tiller.trl.images import image_column, image_entry, multimodal_row, row_images
from tiller.trl.rewards import ROW_KEY, SPLIT_KEY, RewardModelFunc, TRLRewards, callable_name
from tiller.trl.tool_loop import EnvironmentPool, TRLToolLoop, environment_rewards, prepare_tokenizer, tool_of

MIN_IS_BOUND = 1e-30  # the lower IcePop bound standing for TRL's "no clip_min"
NO_DUAL_CLIP = 1e9  # actor.clip_ratio_c so large it never binds: TRL has no dual clip unless `delta`
DATA_DIR = "data"  # under the run dir: the prompts tiller reads (train.jsonl, eval.jsonl)
EMPTY_PROMPT = [{"role": "user", "content": ""}]  # TRL's prompt of an environment row without one
ENV_PROMPT_ROOM = 2048  # tokens a reset() observation may add to a prompt (within the model's context)


def _when_vllm(name: str, key: str) -> Callable[[Any, Any], dict]:
    """A vLLM field: read only with use_vllm (as TRL), then set on `key`."""
    return lambda value, args: {key: value} if args.use_vllm else {}


def _vllm(value: Any, args: Any) -> dict:
    if not value:
        return {}
    if args.vllm_mode != "colocate":
        raise refuse_value("vllm_mode", args.vllm_mode, "tiller runs vLLM in the trainer's process (colocate); "
                           "a separate vLLM server (trl vllm-serve) is not used")
    return {"rollout_name": "vllm"}


def vllm_is_keys(value: Any, args: Any) -> dict:
    """TRL's vLLM importance sampling (read only with use_vllm) on tiller's rollout correction (verl's keys)."""
    if not (args.use_vllm and value):
        return {}
    mode, lo, hi = args.vllm_importance_sampling_mode, args.vllm_importance_sampling_clip_min, \
        args.vllm_importance_sampling_clip_max
    level = "token" if mode.startswith("token") else "sequence"
    if getattr(args, "loss_type", None) == "vespo" and level != "token":
        raise ConfigError(f"VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or "
                          f"'token_mask'. Got: {mode}.")
    if mode.endswith("_truncate"):
        if lo is not None:
            raise refuse_value("vllm_importance_sampling_clip_min", lo, "tiller's truncated IS caps the weights "
                               "from above only (vllm_importance_sampling_clip_max)")
        return {"rollout_is": level, "rollout_is_threshold": str(float(hi))}
    # *_mask: weights outside [min, max] are 0, inside they weight the loss (IcePop, verl's "lo_hi" threshold); no
    # clip_min: tiller's bound must be > 0, so 1e-30 (a weight below it is 0 either way to float32 precision)
    low = float(lo) if lo else MIN_IS_BOUND
    return {"rollout_is": level, "rollout_is_threshold": f"{low}_{float(hi if hi is not None else 1e30)}"}


GEN_NEUTRAL = {"do_sample": True, "n": 1, "skip_special_tokens": True}  # generation_kwargs values that change nothing
GEN_FIELDS = ("temperature", "top_p", "top_k", "min_p")
GEN_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")  # rollout keys of the same names


def _generation_kwargs(value: Any, args: Any) -> dict:
    """TRL's generation_kwargs (vLLM SamplingParams or transformers GenerationConfig keywords, applied over the
    sampling fields): stop strings and the penalties map (a penalty here wins over the repetition_penalty field, as
    in TRL); a sampling field's keyword must equal the field (TRL would sample at the keyword's value but compute
    the loss's log-probs at the field's)."""
    if not value:
        return {}
    if not isinstance(value, dict):
        raise refuse_value("generation_kwargs", value, "a dict of generation keywords")
    stop: list[str] = []
    penalties: dict[str, float] = {}
    for key, v in value.items():
        if key in ("stop", "stop_strings"):
            stop += [v] if isinstance(v, str) else [str(s) for s in v]
        elif key in GEN_PENALTIES:
            penalties[key] = float(v)
        elif key in GEN_FIELDS:
            field = getattr(args, key)
            if key == "top_k":
                same = (int(v or 0) if v is not None else 0) <= 0 and (field or 0) <= 0 or v == field
            else:
                same = v == field or (key == "min_p" and not v and not field)
            if not same:
                raise refuse_value(f"generation_kwargs[{key!r}]", v, f"set {key}={v!r} in the config instead (TRL "
                                   f"would sample at {v!r} but compute the loss's log-probs at {key}={field!r})")
        elif key not in GEN_NEUTRAL or v != GEN_NEUTRAL[key]:
            raise refuse_value(f"generation_kwargs[{key!r}]", v, "tiller maps stop / stop_strings and "
                               f"{' / '.join(GEN_PENALTIES)} (and the sampling fields at their values; neutral "
                               f"{', '.join(f'{k}={n!r}' for k, n in GEN_NEUTRAL.items())})")
    return {**({"stop": stop} if stop else {}), **({"generation_penalties": penalties} if penalties else {})}


def _sync_ref(value: Any, args: Any) -> dict:
    if not value:
        return {}
    if not args.beta:
        raise refuse_value("sync_ref_model", value, "with beta=0.0 no reference model is used, so there is nothing to "
                           "synchronize (TRL raises too); set beta > 0")
    return {"ref_sync": {"ref_model_sync_steps": int(args.ref_model_sync_steps),
                         "ref_model_mixup_alpha": float(args.ref_model_mixup_alpha)}}


GEN_NOOP_VLLM = "a vLLM engine setting: tiller's vllm engine takes its own defaults"

# the generation / batch fields GRPOConfig and RLOOConfig share (each trainer adds its algorithm's)
def _no_rl_best(value: Any) -> dict:
    raise refuse_value("load_best_model_at_end", value, "tiller's RL trainers keep the last policy (select a "
                       "checkpoint by its val-core reward yourself: checkpoints/global_step_N)")


RL_SHARED_RULES: dict[str, Rule] = {
    "load_best_model_at_end": mapped("False: tiller's RL run keeps its last policy (its validation is the reward, "
                                     "not an eval loss); True refused", lambda v, a: {} if not v else _no_rl_best(v)),
    "neftune_noise_alpha": refused("NEFTune noise in the policy's training forward would perturb the log-probs its "
                                   "ratio and KL compare with the rollout's (TRL would add it there); tiller's SFT / "
                                   "DPO / KTO / reward trainers take it"),
    "router_aux_loss_coef": mapped("actor_rollout_ref.actor.router_aux_loss_coef (None: a mixture-of-experts "
                                   "model's config router_aux_loss_coef, as TRL; a dense model: off, and a coefficient "
                                   "refused, as TRL)", lambda v, a: {}),
    "disable_dropout": mapped("True: the actor's LoRA dropout off (TRL's disable_dropout_in_model zeroes every "
                              "nn.Dropout, peft's lora_dropout too); the actor trains in train mode as transformers' "
                              "Trainer does", lambda v, a: {}),
    "num_generations": mapped("actor_rollout_ref.rollout.n", to("num_generations", int)),
    "num_generations_eval": mapped("actor_rollout_ref.rollout.val_kwargs.n (None: num_generations)",
                                   lambda v, a: {"num_generations_eval": int(v or a.num_generations)}),
    "max_completion_length": mapped("data.max_response_length", to("max_completion_length", int)),
    "ds3_gather_for_generation": noop("a DeepSpeed ZeRO-3 setting: tiller does not use DeepSpeed"),
    "shuffle_dataset": mapped("data.shuffle", to("shuffle", bool)),
    "generation_batch_size": mapped("data.train_batch_size = generation_batch_size / num_generations prompts",
                                    to("generation_batch_size", int)),
    "steps_per_generation": mapped("actor.ppo_mini_batch_size: generation_batch_size / steps_per_generation x "
                                   "gradient_accumulation_steps completions", to("steps_per_generation", int)),
    "temperature": mapped("actor_rollout_ref.rollout.temperature (and val_kwargs)", to("temperature", float)),
    "top_p": mapped("actor_rollout_ref.rollout.top_p (and val_kwargs)", to("top_p", float)),
    "top_k": mapped("actor_rollout_ref.rollout.top_k (TRL's 0 = off: -1)", to("top_k", lambda v: int(v or 0) or -1)),
    "min_p": mapped("actor_rollout_ref.rollout.min_p", to("min_p", lambda v: float(v or 0.0))),
    "generation_kwargs": mapped("stop / stop_strings: actor_rollout_ref.rollout.stop; repetition_penalty / "
                                "presence_penalty / frequency_penalty: actor_rollout_ref.rollout's keys of those "
                                "names; TRL's own sampling fields at their GRPOConfig values and neutral settings "
                                "accepted; anything else refused", _generation_kwargs),
    "chat_template_kwargs": mapped("data.apply_chat_template_kwargs", to("chat_template_kwargs",
                                                                        lambda v: dict(v or {}))),
    "repetition_penalty": mapped("actor_rollout_ref.rollout.repetition_penalty (training and evaluation, as TRL)",
                                 to("repetition_penalty", float)),
    "cache_implementation": noop("tiller's rollout engine has its own KV cache"),
    "use_vllm": mapped("actor_rollout_ref.rollout.name=vllm (vllm_mode colocate; server refused)", _vllm),
    "vllm_mode": mapped("colocate (server refused); read with use_vllm", lambda v, a: {}),
    "vllm_model_impl": noop(GEN_NOOP_VLLM),
    "vllm_enable_sleep_mode": noop("tiller's vllm engine sleeps between rollouts as verl's does"),
    "vllm_structured_outputs_regex": mapped("actor_rollout_ref.rollout.structured_outputs_regex: every completion "
                                            "matches it (training and evaluation; TRL reads it with use_vllm only, "
                                            "tiller constrains on its native engine too)",
                                            to("structured_outputs_regex")),
    "vllm_server_base_url": noop("only read with vllm_mode=server, which is refused"),
    "vllm_server_host": noop("only read with vllm_mode=server, which is refused"),
    "vllm_server_port": noop("only read with vllm_mode=server, which is refused"),
    "vllm_server_timeout": noop("only read with vllm_mode=server, which is refused"),
    "vllm_group_port": noop("only read with vllm_mode=server, which is refused"),
    "vllm_gpu_memory_utilization": mapped("actor_rollout_ref.rollout.gpu_memory_utilization (with use_vllm)",
                                          _when_vllm("vllm_gpu_memory_utilization", "gpu_memory_utilization")),
    "vllm_max_model_length": noop("tiller's vllm engine sizes its context from max prompt + completion length"),
    "vllm_tensor_parallel_size": mapped("actor_rollout_ref.rollout.tensor_model_parallel_size (with use_vllm)",
                                        _when_vllm("vllm_tensor_parallel_size", "tensor_model_parallel_size")),
    "beta": mapped("GRPO: actor.use_kl_loss = beta > 0, kl_loss_coef = beta, kl_loss_type = low_var_kl (k3); beta "
                   "0: no reference model", to("beta", float)),
    "num_iterations": mapped("actor.ppo_epochs", to("num_iterations", int)),
    "epsilon": mapped("actor.clip_ratio_low (and clip_ratio_high unless epsilon_high)", to("epsilon", float)),
    "epsilon_high": mapped("actor.clip_ratio_high (None: epsilon)", to("epsilon_high")),
    "reward_weights": mapped("the weights of TRL's nansum of the reward functions (None: all 1)",
                             to("reward_weights")),
    "mask_truncated_completions": mapped("actor.mask_truncated_responses (truncated completions leave the loss, "
                                         "still counted as sequences)", to("mask_truncated", bool)),
    "sync_ref_model": mapped("actor_rollout_ref.ref.ref_model_sync_steps / ref_model_mixup_alpha (TR-DPO: the "
                             "reference follows the policy, counted in optimizer steps as TRL's)", _sync_ref),
    "ref_model_mixup_alpha": mapped("ref.ref_model_mixup_alpha (read with sync_ref_model)", lambda v, a: {}),
    "ref_model_sync_steps": mapped("ref.ref_model_sync_steps (read with sync_ref_model)", lambda v, a: {}),
    "log_completions": mapped("trainer.rollout_data_dir = <output_dir>/completions: every step's prompts, "
                              "completions and rewards as <step>.jsonl", to("log_completions", bool)),
    "log_multimodal": noop("tiller's completion logs (log_completions) hold the prompts' text, not their images "
                           "(the run's images are in output_dir/data/<split>.parquet)"),
    "num_completions_to_print": noop("tiller prints no completion table (log_completions writes them all)"),
    "log_unique_prompts": noop("tiller prints no completion table (log_completions writes them all)"),
    "use_transformers_continuous_batching": noop("tiller's rollout engine batches continuously itself"),
    "transformers_continuous_batching_config": noop("tiller's rollout engine batches continuously itself"),
    "use_transformers_paged": noop("tiller's rollout engine batches continuously itself"),
}


# ------------------------------------------------------------------------------------------ arithmetic


def batch_arithmetic(args: Any) -> dict[str, int]:
    """TRL's batch sizes on verl's keys (module docstring); a `ConfigError` naming the field when they do not map.
    Returns prompts per step, mini-batch prompts, micro-batch completions, epochs and k (TRL optimizer steps per
    tiller step)."""
    g, b, ga = int(args.num_generations), int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
    gen, spg, iters = int(args.generation_batch_size), int(args.steps_per_generation), int(args.num_iterations)
    if spg % ga:
        raise ConfigError(f"steps_per_generation={spg}: refused: an optimizer step of gradient_accumulation_steps="
                          f"{ga} slices would span generation batches; tiller updates within one (use a multiple of "
                          f"gradient_accumulation_steps)")
    if (b * ga) % g:
        raise ConfigError(f"per_device_train_batch_size={b} x gradient_accumulation_steps={ga} = {b * ga} completions "
                          f"per optimizer step: refused: tiller's mini-batches are whole groups of num_generations={g} "
                          "(make it a multiple)")
    return {"prompts": gen // g, "mini_prompts": b * ga // g, "micro": b, "epochs": iters, "k": iters * spg // ga}


def trl_steps_per_epoch(n_rows: int, arithmetic: dict[str, int]) -> int:
    """transformers' optimizer steps per epoch of TRL's RepeatSampler: (N // prompts) generation batches, k each."""
    batches = n_rows // arithmetic["prompts"]
    if batches == 0:
        raise DataError(f"train_dataset has {n_rows} rows, fewer than the {arithmetic['prompts']} prompts of one "
                        "generation batch (generation_batch_size / num_generations)")
    return batches * arithmetic["k"]


def to_tiller_steps(logical: dict[str, Any], k: int) -> tuple[dict[str, Any], list[str]]:
    """TRL optimizer-step counts (after `resolve_schedule`) -> tiller steps (k TRL steps each)."""
    if k == 1:
        return logical, []
    out, notices = dict(logical), []
    total = out["total_training_steps"]
    if total % k:
        raise ConfigError(f"max_steps={total}: refused: with k = num_iterations x steps_per_generation / "
                          f"gradient_accumulation_steps = {k} optimizer steps per generation batch, tiller trains "
                          f"whole generation batches (use a multiple of {k})")
    out["total_training_steps"] = total // k
    for key in ("save_freq", "test_freq"):
        if out.get(key, -1) > 0:
            out[key] = max(1, math.ceil(out[key] / k))
    if out.get("warmup_steps"):
        out["warmup_steps"] = math.ceil(out["warmup_steps"] / k)
    kwargs = dict(out.get("lr_scheduler_kwargs") or {})
    for key in ("num_decay_steps", "num_stable_steps", "timescale"):  # transformers' schedules count steps too
        if kwargs.get(key):
            kwargs[key] = math.ceil(kwargs[key] / k)
    if kwargs:
        out["lr_scheduler_kwargs"] = kwargs
    if out.get("lr_scheduler") != "constant" or out.get("warmup_steps"):
        notices.append(f"lr_scheduler_type: tiller moves the learning rate once per generation batch ({k} optimizer "
                       "steps), TRL once per optimizer step")
    return out, notices


# ------------------------------------------------------------------------------------------ the trainer


class TRLRLTrainer(TRLTrainerBase):
    """GRPO / RLOO on tiller's RL driver. Subclasses set `config_class` and `_algorithm_keys(args, logical)`."""

    loss_key = "actor/pg_loss"

    def _set_up_rl(self, model: Any, reward_funcs: Any, args: Any, train_dataset: Any, eval_dataset: Any,
                   processing_class: Any, reward_processing_classes: Any, peft_config: Any, tools: Any = None,
                   environment_factory: Any = None, quantization_config: Any = None, callbacks: Any = None) -> None:
        self._set_up_common(model, args, processing_class, peft_config, quantization_config, callbacks)
        self.logical, self.notices = classify(self.args)
        self.tools, self.environments = _tool_setup(tools, environment_factory)
        self.tool_loop = None
        self.arithmetic = self._batch_arithmetic()
        if self.callbacks and self.arithmetic["k"] > 1:
            print(f"tiller.trl: callbacks: on_step_end / on_log run once per generation batch ({self.arithmetic['k']} "
                  "optimizer steps), state.global_step counting optimizer steps")
        self.train_rows = to_dataset_rows(train_dataset, "train_dataset")
        self.eval_rows = None
        if eval_dataset is not None:
            if isinstance(eval_dataset, dict) and not hasattr(eval_dataset, "column_names"):
                raise ConfigError("eval_dataset: a dict of datasets: tiller validates on one dataset")
            self.eval_rows = to_dataset_rows(eval_dataset, "eval_dataset")
        self.image_columns: dict[str, str | None] = {}
        for split, rows in (("train", self.train_rows), ("eval", self.eval_rows or [])):
            if rows and "prompt" not in rows[0] and self.environments is None:
                raise DataError(f"{split}_dataset: no 'prompt' column (columns: {', '.join(sorted(rows[0]))})")
            self.image_columns[split] = image_column(rows) if rows else None
            if self.image_columns[split] and not is_vision_checkpoint(self.model_path):
                raise ConfigError(f"{split}_dataset: an {self.image_columns[split]!r} column (image prompts) but "
                                  f"model {self.model_path!r} is not a vision-language model tiller trains "
                                  f"({VISION_FAMILIES}); drop the column or use such a model")
        self.conversational = isinstance(self.train_rows[0].get("prompt", EMPTY_PROMPT), (list, tuple))
        if self.uses_tools and not self.conversational:
            raise DataError("train_dataset: tools / environment_factory need conversational prompts (lists of "
                            "{'role', 'content'} messages): the tool calls are parsed from chat turns")
        if self.uses_tools and any(self.image_columns.values()):
            raise ConfigError("tools / environment_factory with image prompts: not supported by tiller's TRL front "
                              "end in this version")
        self.rewards = self._reward_functions(reward_funcs, reward_processing_classes)
        if self.uses_tools:
            self._set_up_tools()
        self.rewards.image_columns = self.image_columns
        self.rewards.decoders = {"train": dataset_decoder(train_dataset), "eval": dataset_decoder(eval_dataset)}
        self.steps_per_epoch = trl_steps_per_epoch(len(self.train_rows), self.arithmetic)

    def _batch_arithmetic(self) -> dict[str, int]:
        return batch_arithmetic(self.args)

    def _set_up_tools(self) -> None:
        """The tokenizer set up for tool calling as TRL's constructor does (response template, training template):
        a template that cannot render or parse tool calls is refused here, before any work."""
        # import cost: transformers loads only when a tokenizer is read
        from tiller.models.loading import load_tokenizer

        self.tool_tokenizer = load_tokenizer(self.tokenizer_path or self.model_path,
                                             trust_remote_code=bool(self.args.trust_remote_code))
        self.tool_template = prepare_tokenizer(self.tool_tokenizer, self.tokenizer_path or self.model_path)
        if self.tool_template is not None:  # (the prompts are measured with the template TRL renders them with)
            self.tool_tokenizer.chat_template = self.tool_template

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) or self.environments is not None

    def _reward_functions(self, reward_funcs: Any, processing_classes: Any) -> TRLRewards:
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        env_rewards = environment_rewards(self.environments) if self.environments is not None else []
        if reward_funcs is None and env_rewards:
            funcs = []  # the environments own the reward (TRL: reward_funcs optional then)
        elif not funcs or any(f is None for f in funcs):
            raise ConfigError("reward_funcs: give at least one reward function or reward model (or an "
                              "environment_factory whose environment defines get_reward)")
        procs = processing_classes if isinstance(processing_classes, list) else [processing_classes] * len(funcs) \
            if processing_classes is None else [processing_classes]
        if len(procs) != len(funcs):
            raise ConfigError(f"reward_processing_classes: {len(procs)} for {len(funcs)} reward functions")
        kwargs = self.logical.get("chat_template_kwargs")
        out, names = [], []
        for func, proc in zip(funcs, procs):
            if isinstance(func, (str, Path)):
                func = RewardModelFunc.load(str(func), proc, bool(self.args.trust_remote_code), kwargs)
            elif _is_module(func):
                if proc is None:
                    from transformers import AutoTokenizer

                    proc = AutoTokenizer.from_pretrained(func.config._name_or_path)
                func = RewardModelFunc(func, proc, kwargs)
            elif not callable(func):
                raise ConfigError(f"reward_funcs: a {type(func).__name__} is neither a function nor a reward model")
            names.append(func.name if isinstance(func, RewardModelFunc) else callable_name(func))
            out.append(func)
        weights = list(self.args.reward_weights) if self.args.reward_weights is not None else [1.0] * len(out)
        if len(weights) != len(out):
            raise ConfigError(f"reward_weights has {len(weights)} weights for {len(out)} reward functions: give one "
                              "weight per reward function")
        for name, func in env_rewards:  # TRL: each environment class with get_reward, weight 1, after the others
            out.append(func)
            names.append(name)
            weights.append(1.0)
        rewards = TRLRewards(out, names, weights, {"train": [], "eval": []}, self.conversational)
        rewards.environments = self.environments is not None
        return rewards

    # ------------------------------------------------------------------------------------ translation
    def _write_data(self) -> dict[str, Any]:
        """The prompts as tiller's RL rows (data_source "trl", the row index in extra_info), written under the
        run dir; returns the data keys (files, max prompt length, chat template)."""
        # import cost: transformers / images load only when prompts are measured
        from tiller.data.rl_dataset import render_prompt
        # import cost: transformers loads only when a tokenizer is read
        from tiller.models.loading import load_tokenizer
        from tiller.models.vision import load_processor  # import cost: torch

        kwargs = self.logical.get("chat_template_kwargs") or {}
        schemas = None
        if self.uses_tools:  # TRL renders every prompt with the tools' schemas (the tokenizer of `_set_up_tools`)
            tokenizer = self.tool_tokenizer
            union = self.environments.union() if self.environments is not None else self.tools
            schemas = [t.schema for t in union]
        else:
            tokenizer = load_tokenizer(self.tokenizer_path or self.model_path,
                                       trust_remote_code=bool(self.args.trust_remote_code))
        keys: dict[str, Any] = {"data.apply_chat_template": self.conversational,
                                "data.apply_chat_template_kwargs": kwargs, "data.prompt_key": "prompt",
                                "data.truncation": "error", "data.filter_overlong_prompts": False}
        longest, processor = 0, None
        self.rewards.rows = {"train": self.train_rows, "eval": self.eval_rows or []}
        for split, rows in (("train", self.train_rows), ("eval", self.eval_rows)):
            if not rows:
                continue
            if isinstance(rows[0]["prompt"], (list, tuple)) != self.conversational:
                raise DataError(f"{split}_dataset: its prompts are in another format (standard / conversational) "
                                "than train_dataset's")
            column, out = self.image_columns.get(split), []
            if column is not None:
                processor = processor or load_processor(self.model_path, tokenizer=tokenizer,
                                                        trust_remote_code=bool(self.args.trust_remote_code))
            for i, row in enumerate(rows):
                where = f"{split}_dataset row {i}"
                prompt = row.get("prompt", EMPTY_PROMPT)  # (environment rows may leave it to reset())
                entry = {"data_source": "trl", "prompt": prompt, "extra_info": {ROW_KEY: i, SPLIT_KEY: split},
                         "reward_model": {"ground_truth": None}}
                if column is None:
                    text = render_prompt(prompt, tokenizer, self.conversational, where, chat_template_kwargs=kwargs,
                                         tool_schemas=schemas)
                    length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
                else:
                    entry["prompt"], _, images = multimodal_row(row["prompt"], row_images(row, column), where)
                    entry["images"] = [image_entry(img, f"{where} {column}") for img in images]
                    length = self._image_prompt_length(entry, processor, tokenizer, where)
                longest = max(longest, length)
                out.append(entry)
            # image rows carry their images' bytes: parquet (verl's multimodal files); both written atomically
            name = f"{split}.parquet" if column is not None else f"{split}.jsonl"
            path = write_rows_atomic(out, self.run_dir / DATA_DIR / name)
            keys["data.train_files" if split == "train" else "data.val_files"] = [str(path)]
        if processor is not None:
            keys["data.image_key"] = "images"
        # TRL 1.16 has no max_prompt_length: every prompt is used whole, so the longest one sets tiller's limit
        keys["data.max_prompt_length"] = longest
        if self.uses_tools:
            keys.update(self._tool_loop_keys(tokenizer, longest))
        return keys

    def _tool_loop_keys(self, tokenizer: Any, longest: int) -> dict[str, Any]:
        """Build `self.tool_loop` (TRL's tools / environments); the keys it needs (the batch's prompt width with
        room for reset observations, the template TRL renders with)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=bool(self.args.trust_remote_code))
        max_model_len = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        width = longest
        if self.environments is not None:  # reset() may append an observation to a prompt: room for it
            width = max(longest, min(max_model_len - int(self.logical["max_completion_length"]),
                                     longest + ENV_PROMPT_ROOM))
        self.tool_loop = TRLToolLoop(self.tools, self.environments, self.rewards.rows, self.rewards.decoders,
                                     self.logical.get("max_tool_calling_iterations"), self.tool_template,
                                     self.logical.get("chat_template_kwargs"), max_model_len, width,
                                     tokenizer=self.tool_tokenizer)
        keys: dict[str, Any] = {"actor_rollout_ref.rollout.prompt_length": width}
        if self.tool_template is not None:
            keys["actor_rollout_ref.model.custom_chat_template"] = self.tool_template
        return keys

    def _image_prompt_length(self, entry: dict, processor: Any, tokenizer: Any, where: str) -> int:
        """Tokens of a prompt as tiller's RL data path encodes it (an image's tokens included)."""
        # import cost: transformers / images load only when prompts are measured
        from tiller.data.rl_dataset import encode_image_row, row_images as images_of, render_prompt

        kwargs = self.logical.get("chat_template_kwargs") or {}
        images = images_of(entry, "images", where)
        if not images:
            text = render_prompt(entry["prompt"], tokenizer, True, where, chat_template_kwargs=kwargs)
            return len(tokenizer(text, add_special_tokens=False)["input_ids"])
        return len(encode_image_row(entry["prompt"], images, processor, where, kwargs).prompt_ids)

    def _shared_keys(self) -> dict[str, Any]:
        lg, ar = self.logical, self.arithmetic
        actor, rollout = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
        keys = {
            "data.train_batch_size": ar["prompts"], "data.max_response_length": lg["max_completion_length"],
            "data.shuffle": lg["shuffle"], f"{rollout}.n": lg["num_generations"],
            f"{actor}.ppo_mini_batch_size": ar["mini_prompts"], f"{actor}.ppo_micro_batch_size_per_gpu": ar["micro"],
            f"{actor}.ppo_epochs": ar["epochs"], f"{rollout}.log_prob_micro_batch_size_per_gpu": ar["micro"],
            f"{rollout}.temperature": lg["temperature"], f"{rollout}.top_p": lg["top_p"],
            f"{rollout}.top_k": lg["top_k"], f"{rollout}.min_p": lg["min_p"], f"{rollout}.do_sample": True,
            f"{rollout}.val_kwargs.n": lg["num_generations_eval"], f"{rollout}.val_kwargs.do_sample": True,
            f"{rollout}.val_kwargs.temperature": lg["temperature"], f"{rollout}.val_kwargs.top_p": lg["top_p"],
            f"{rollout}.val_kwargs.top_k": lg["top_k"],
            f"{actor}.clip_ratio_low": lg["epsilon"],
            f"{actor}.clip_ratio_high": lg["epsilon_high"] if lg["epsilon_high"] is not None else lg["epsilon"],
            f"{actor}.clip_ratio_c": NO_DUAL_CLIP, "algorithm.use_kl_in_reward": False,
            f"{actor}.mask_truncated_responses": lg["mask_truncated"],
            "trainer.val_before_train": bool(lg.get("eval_on_start")),
            "trainer.resume_mode": "disable",
        }
        if lg.get("rollout_name"):
            keys[f"{rollout}.name"] = lg["rollout_name"]
        for name in ("gpu_memory_utilization", "tensor_model_parallel_size"):
            if name in lg:
                keys[f"{rollout}.{name}"] = lg[name]
        if lg.get("rollout_is"):
            rc = "algorithm.rollout_correction"
            keys.update({f"{rc}.rollout_is": lg["rollout_is"],
                         f"{rc}.rollout_is_threshold": lg["rollout_is_threshold"]})
        if lg.get("log_completions"):
            keys["trainer.rollout_data_dir"] = str(self.run_dir / "completions")
        if lg.get("stop"):
            keys[f"{rollout}.stop"] = list(lg["stop"])
        penalties = {"repetition_penalty": lg["repetition_penalty"], **lg.get("generation_penalties", {})}
        keys.update({f"{rollout}.{name}": value for name, value in penalties.items()})
        if lg.get("structured_outputs_regex") is not None:
            keys[f"{rollout}.structured_outputs_regex"] = lg["structured_outputs_regex"]
        for name, value in (lg.get("ref_sync") or {}).items():
            keys[f"actor_rollout_ref.ref.{name}"] = value
        return keys

    def _algorithm_keys(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _algorithm_notices(self) -> list[str]:
        """Lines on where this run's normalisation differs from TRL's (none by default)."""
        return []

    def translate(self) -> tuple[dict[str, Any], list[str]]:
        """(tiller RL keys, notices) of this trainer's arguments and data (the data is written under the run dir)."""
        notices = list(self.notices)
        schedule = resolve_schedule(self.logical, self.steps_per_epoch)
        schedule, more = to_tiller_steps(schedule, self.arithmetic["k"])
        notices += more
        self.total_steps = schedule["total_training_steps"] * self.arithmetic["k"]
        self.rewards.max_steps = self.total_steps
        self.rewards.optimizer_steps_per_step = self.arithmetic["k"]
        keys = {"actor_rollout_ref.model.path": self.model_path}
        if self.tokenizer_path:
            keys["actor_rollout_ref.model.tokenizer_path"] = self.tokenizer_path
        keys.update(rl_keys(schedule))
        keys.update(self._write_data())
        if not self.eval_rows or schedule.get("test_freq", -1) == -1 and not schedule.get("eval_on_start"):
            keys.pop("data.val_files", None)  # TRL evaluates only with an eval strategy (or eval_on_start)
        keys.update(self._shared_keys())
        keys.update(self._algorithm_keys())
        keys.update(lora_rl_keys(self.lora))
        if getattr(self.args, "disable_dropout", False):  # TRL's disable_dropout_in_model zeroes peft's dropout too
            keys.pop("actor_rollout_ref.model.lora_dropout", None)
        keys.update({f"actor_rollout_ref.model.{k}": v for k, v in self.quant.items()})
        keys.update(self._router_keys())
        return keys, notices + self._algorithm_notices()

    def _router_keys(self) -> dict[str, Any]:
        """TRL's router_aux_loss_coef (GRPO / RLOO / distillation): None takes a mixture-of-experts model's own
        coefficient (0.0 when its config declares none); a coefficient with a dense model is an error, as TRL's."""
        value = getattr(self.args, "router_aux_loss_coef", 0)
        if value is None:
            value = moe_router_coef(self.model_path)
        elif value and moe_config(self.model_path) is None:
            raise refuse_value("router_aux_loss_coef", value, f"{self.model_path} is not a mixture-of-experts model "
                               "(its config has no output_router_logits), so it has no router loss; set it to None "
                               "or 0")
        return {"actor_rollout_ref.actor.router_aux_loss_coef": float(value)} if value else {}

    def _tiller_config(self, resume: dict[str, Any]) -> Any:
        # import cost: the config stack (omegaconf, hydra, torch via algos) loads only when a run starts
        from tiller.config import load_config

        keys, notices = self.translate()
        keys.update(resume)
        for line in notices:
            print(f"tiller.trl: {line}")
        self.tiller_keys = keys
        return load_config(overrides(keys))

    def _run(self, cfg: Any) -> dict[str, float]:
        # import cost: the RL stack loads only when train() runs
        from tiller.trainer.rl import run

        return run(cfg, reward_fn=self.rewards, tool_loop=self.tool_loop)

    def _trl_metrics(self, row: dict[str, Any]) -> dict[str, Any]:
        k = self.arithmetic["k"]
        out: dict[str, Any] = {"step": int(row.get("step", 0)) * k, "tiller_step": row.get("step")}
        for trl, ours in (("learning_rate", "actor/lr"), ("entropy", "actor/entropy"), ("kl", "actor/kl_loss"),
                          ("completions/mean_length", "response_length/mean"),
                          ("completions/max_length", "response_length/max"),
                          ("completions/min_length", "response_length/min"),
                          ("completions/clipped_ratio", "response_length/clip_ratio"),
                          ("clip_ratio/region_mean", "actor/pg_clipfrac"), ("grad_norm", "actor/grad_norm"),
                          ("tools/call_frequency", "agent/tool_calls/mean"),
                          ("entropy_coef", "actor/adaptive_entropy_coeff")):
            if ours in row:
                out[trl] = row[ours]
        if "agent/tool_calls/mean" in row:  # TRL: failed calls / calls (0 without calls)
            calls = row["agent/tool_calls/mean"]
            out["tools/failure_frequency"] = row.get("agent/tool_errors/mean", 0.0) / calls if calls else 0.0
        for key, value in row.items():  # validation on eval_dataset: TRL's eval_reward (mean over its samples)
            if key.startswith("val-core/trl/acc/mean@"):
                out["eval_reward"] = value
        return out


def _tool_setup(tools: Any, environment_factory: Any) -> tuple[list, Any]:
    """(TRLTool per tool, EnvironmentPool or None) of GRPOTrainer's tools / environment_factory."""
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise ConfigError(f"tools: a {type(tools).__name__}; give a list of functions")
    standalone = [tool_of(fn, f"tools[{i}]") for i, fn in enumerate(tools or [])]
    names = [t.name for t in standalone]
    if len(set(names)) != len(names):
        raise ConfigError(f"tools: two functions share a name ({sorted(n for n in names if names.count(n) > 1)[0]!r}):"
                          " a call names its tool by function name")
    pool = EnvironmentPool(environment_factory, standalone) if environment_factory is not None else None
    return standalone, pool


def _is_module(obj: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, torch.nn.Module)


def refuse_trainer_arguments(trainer: str, **given: Any) -> None:
    refuse_arguments(trainer, **given)


__all__ = ["RL_SHARED_RULES", "TRLRLTrainer", "batch_arithmetic", "NOTICE", "UserError"]
