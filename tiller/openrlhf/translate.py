"""Translate a parsed OpenRLHF command line (`tiller.openrlhf.parse.Command`) into tiller config values.

`translate(cmd) -> Translation`: the tiller job (sft | rm | dpo | kto | rl), the config values (dotted key ->
value, OpenRLHF's defaults written out wherever tiller's differ), the environment variables to set (W&B) and the
notice lines (one per hint flag given, plus the meaning differences that apply). A refused flag, or a mapped
flag with a value tiller cannot honour, raises `ConfigError` naming the flag as the user spelled it.

Every mapped flag is read by the translator: `Args` records the reads and `translate` fails loudly (an
internal error, caught by the tests) if a mapped flag of the job was never read, so no flag is dropped.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from tiller.errors import ConfigError
from tiller.openrlhf.parse import Command, flag_index
from tiller.openrlhf.table import HINT, MAPPED, REFUSED

TILLER_JOB = {"train_sft": "sft", "train_rm": "rm", "train_dpo": "dpo", "train_kto": "kto", "train_ppo_ray": "rl"}
ESTIMATORS = {"gae": "gae", "reinforce": "reinforce_plus_plus", "rloo": "rloo",
              "reinforce_baseline": "reinforce_plus_plus_baseline", "group_norm": "grpo", "dr_grpo": "grpo"}
KL_KINDS = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
NO_DUAL_CLIP = 1e9  # actor.clip_ratio_c this large never binds: OpenRLHF has no dual clip unless --dual_clip


@dataclass
class Translation:
    job: str  # tiller job: sft | rm | dpo | kto | rl
    values: dict[str, Any]  # tiller key -> value
    notices: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


class Args:
    """Read access to a `Command`'s values by table row name, recording which rows were read."""

    def __init__(self, cmd: Command):
        self.cmd, self.read = cmd, set()

    def __call__(self, name: str, default: Any = None) -> Any:
        if name not in self.cmd.values:
            return default
        self.read.add(name)
        return self.cmd.values[name]

    def has(self, name: str) -> bool:
        return name in self.cmd.values

    def given(self, name: str) -> bool:
        return name in self.cmd.given

    def flag(self, name: str) -> str:
        return self.cmd.spelled.get(name, f"--{name}")

    def refuse(self, name: str, why: str) -> ConfigError:
        return ConfigError(f"{self.flag(name)} {_show(self.cmd.values.get(name))}: refused: {why}".replace(" True:", ":"))


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def _csv(value: Any) -> list[str]:
    return [s.strip() for s in str(value).split(",") if s.strip()]


def _floats(a: "Args", name: str) -> list[float]:
    try:
        return [float(x) for x in _csv(a(name))]
    except ValueError:
        raise a.refuse(name, "a comma-separated list of numbers") from None


# ------------------------------------------------------------------------------------------- shared


def _schedule(a: Args, o: dict, prefix: str, *, offline: bool, name: str = "lr_scheduler",
              warm: str = "lr_warmup_ratio", floor: str = "min_lr_ratio") -> None:
    """OpenRLHF's schedule (default cosine_with_min_lr: warm-up then cosine to 0.1 x lr) on tiller's keys."""
    sched, ratio, min_ratio = a(name), a(warm), a(floor, 0.1)
    if sched == "cosine_with_min_lr":
        style, floor_ratio = "cosine", min_ratio
    elif sched == "cosine":
        style, floor_ratio = "cosine", 0.0
    elif sched == "constant_with_warmup":
        style, floor_ratio = "constant", 0.0
    elif sched in ("linear", "cosine_with_restarts", "polynomial", "inverse_sqrt"):
        style, floor_ratio = sched, 0.0  # transformers' formulas with their default keywords, as OpenRLHF builds them
    else:
        raise a.refuse(name, "tiller schedules are cosine_with_min_lr, cosine, constant_with_warmup, linear, "
                             "cosine_with_restarts, polynomial and inverse_sqrt (OpenRLHF passes warmup_stable_decay "
                             "no num_decay_steps)")
    if offline:
        o.update({f"{prefix}.lr_scheduler": style, f"{prefix}.warmup_steps_ratio": ratio,
                  f"{prefix}.min_lr_ratio": floor_ratio})
    else:
        o.update({f"{prefix}.warmup_style": style, f"{prefix}.lr_warmup_steps_ratio": ratio,
                  f"{prefix}.min_lr_ratio": floor_ratio})


def _dtype(a: Args) -> str:
    if a.has("ds.param_dtype"):
        value = a("ds.param_dtype")
        if value not in ("bf16", "fp32"):
            raise a.refuse("ds.param_dtype", "tiller trains in bf16 or fp32 (fp16 is not supported)")
        return "bfloat16" if value == "bf16" else "float32"
    return "bfloat16" if a("bf16") else "float32"


def _tracking(a: Args, o: dict, env: dict, keep_key: str) -> None:
    key = a("use_wandb")
    if key:
        o["trainer.logger"] = ["console", "jsonl", "tensorboard", "wandb"]
        if str(key).lower() not in ("true", "1"):
            env["WANDB_API_KEY"] = str(key)
    if a("wandb_org"):
        env["WANDB_ENTITY"] = str(a("wandb_org"))
    if a("wandb_group"):
        env["WANDB_RUN_GROUP"] = str(a("wandb_group"))
    o["trainer.project_name"] = a("wandb_project")
    o["trainer.experiment_name"] = time.strftime(str(a("wandb_run_name")))
    o["trainer.default_local_dir"] = a("save_path")
    o["trainer.save_freq"] = a("save_steps")
    o[keep_key] = a("max_ckpt_num")
    o["trainer.resume_mode"] = "auto" if a("load_checkpoint") else "disable"
    o["trainer.test_freq"] = a("eval_steps")


def _lora(a: Args, o: dict, prefix: str) -> None:
    if a("load_in_4bit"):  # OpenRLHF's BitsAndBytesConfig: nf4, double quantization (QLoRA)
        o.update({f"{prefix}.load_in_4bit": True, f"{prefix}.bnb_4bit_quant_type": "nf4",
                  f"{prefix}.bnb_4bit_use_double_quant": True})
    o[f"{prefix}.lora_rank"] = a("lora_rank")
    o[f"{prefix}.lora_alpha"] = a("lora_alpha")
    targets = a("target_modules")
    o[f"{prefix}.target_modules"] = targets if isinstance(targets, str) else list(targets)
    o[f"{prefix}.lora_dropout"] = a("lora_dropout")  # in the update's forward only (RL: eval-mode logprobs)


def _eps(a: Args, o: dict, name: str, key: str | None) -> None:
    eps = a(name, 1e-8)
    if key:
        o[key] = eps
    elif eps != 1e-8:
        raise a.refuse(name, "tiller's offline jobs use AdamW's eps 1e-8")


# ------------------------------------------------------------------------------------------- offline jobs


def _offline(a: Args, job: str, notices: list[str]) -> tuple[dict, dict]:
    o: dict[str, Any] = {}
    env: dict[str, str] = {}
    if not a("pretrain"):
        raise ConfigError(f"{a.flag('pretrain')} is required: the model to train")
    o["model.partial_pretrain"] = a("pretrain")
    if not a("dataset"):
        raise ConfigError(f"{a.flag('dataset')} is required: the training data")
    o["data.train_files"] = _csv(a("dataset"))
    if a("dataset_probs") is not None:
        o["data.train_probs"] = _floats(a, "dataset_probs")
    o["data.train_split"] = a("dataset_split")
    if a("eval_dataset"):
        o["data.val_files"] = _csv(a("eval_dataset"))
    o["data.val_split"] = a("eval_split")
    o["data.max_samples"] = a("max_samples")
    o["data.max_length"] = a("max_len")
    o["data.truncation"] = "right"  # OpenRLHF's tokenizer call truncates the end
    o["data.train_batch_size"] = a("train_batch_size")
    o["data.micro_batch_size_per_gpu"] = a("micro_train_batch_size")
    o["data.apply_chat_template"] = bool(a("apply_chat_template"))
    o["data.input_template"] = a("input_template")
    o["model.custom_chat_template"] = a("tokenizer_chat_template")
    o["trainer.total_epochs"] = a("max_epochs")
    o["trainer.seed"] = a("seed")
    o["optim.lr"] = a("learning_rate")
    o["optim.betas"] = list(a("adam_betas"))
    o["optim.weight_decay"] = a("l2")
    if a("l2"):  # OpenRLHF's Adam spares biases and norm weights (get_optimizer_grouped_parameters)
        o["optim.weight_decay_exempt"] = "openrlhf"
    _eps(a, o, "adam.eps", None)
    o["optim.clip_grad"] = a("max_norm")
    o["optim.dtype"] = _dtype(a)
    _schedule(a, o, "optim", offline=True)
    o["model.enable_gradient_checkpointing"] = bool(a("gradient_checkpointing"))
    _lora(a, o, "model")
    if a("aux_loss_coef"):  # (train_rm refuses it by its table entry)
        o["model.router_aux_loss_coef"] = float(a("aux_loss_coef"))
    _tracking(a, o, env, "trainer.max_ckpt_to_keep")
    stage = a("zero_stage", 3)  # OpenRLHF's FSDP2 backend (--fsdp.*) has no ZeRO stage: it shards like stage 3
    if stage not in (0, 1, 2, 3):
        raise a.refuse("zero_stage", "ZeRO stages are 0-3")
    o["trainer.strategy"] = "ddp" if stage < 2 else "fsdp"
    packing = a("packing_samples")
    if job == "train_sft":
        o["data.packing"] = bool(packing)
    elif packing:
        notices.append(f"{a.flag('packing_samples')}: tiller pads each micro-batch to its longest sequence "
                       "instead of packing (same loss)")
    if a("eval_dataset") and a("eval_steps") == -1 and a("max_epochs") > 1:
        notices.append(f"{a.flag('eval_steps')} -1: tiller evaluates at the end of training (OpenRLHF: after "
                       "every epoch); give a step count to evaluate more often")
    return o, env


def _sft(a: Args, o: dict, notices: list[str]) -> None:
    if a("multiturn"):
        o["data.format"] = "messages"
        o["data.messages_key"] = a("input_key")
    else:
        o["data.format"] = "prompt_response"
        o["data.input_key"] = a("input_key")
        if not a("output_key"):
            raise ConfigError(f"{a.flag('output_key')} is required (the response column) unless "
                              f"{a.flag('multiturn')}")
    o["data.output_key"] = a("output_key")
    if (a("ring_attn_size") or 1) > 1:  # ring attention's sequence split: tiller's SFT splits with Ulysses
        o["ulysses_sequence_parallel_size"] = a("ring_attn_size")


def _pairs(a: Args, o: dict, job: str) -> None:
    o["data.prompt_key"] = a("prompt_key")  # None: the prompt is inside the chosen / rejected conversations
    o["data.chosen_key"] = a("chosen_key")
    o["data.rejected_key"] = a("rejected_key")
    if (a("ring_attn_size") or 1) > 1:  # ring attention's sequence split: tiller's RM / DPO split with Ulysses
        o["ulysses_sequence_parallel_size"] = a("ring_attn_size")
    if job == "train_rm":
        o["algorithm.loss"] = "sigmoid" if a("loss") == "sigmoid" else "logexp"
        o["data.margin_key"] = "margin" if a("margin_loss") else None
    else:
        if a("ref_pretrain"):
            o["model.ref_path"] = a("ref_pretrain")
        smoothing = a("label_smoothing")
        if a("ipo"):
            if smoothing:
                raise a.refuse("label_smoothing", "label smoothing applies to DPO, not IPO (tiller)")
            o["algorithm.loss"] = "ipo"
        else:
            o["algorithm.loss"] = "cdpo" if smoothing else "dpo"
        o["algorithm.label_smoothing"] = smoothing
        o["algorithm.beta"] = a("beta")


def _kto(a: Args, o: dict) -> None:
    o["data.prompt_key"] = a("input_key")
    if not a("output_key"):
        raise ConfigError(f"{a.flag('output_key')} is required for KTO: the completion column")
    o["data.completion_key"] = a("output_key")
    o["data.label_key"] = a("label_key")
    o["algorithm.beta"] = a("beta")
    o["algorithm.desirable_weight"] = a("desirable_loss_weight")
    o["algorithm.undesirable_weight"] = a("undesirable_loss_weight")


# ------------------------------------------------------------------------------------------- PPO


def _ppo(a: Args, notices: list[str]) -> tuple[dict, dict]:
    o: dict[str, Any] = {}
    env: dict[str, str] = {}
    arr, actor, critic, rollout = "actor_rollout_ref", "actor_rollout_ref.actor", "critic", "actor_rollout_ref.rollout"
    if not a("pretrain"):
        raise ConfigError(f"{a.flag('pretrain')} is required: the policy to train")
    o[f"{arr}.model.path"] = a("pretrain")
    # ---- data
    if not a("prompt_data"):
        raise ConfigError(f"{a.flag('prompt_data')} is required: the RL prompts")
    o["data.train_files"] = _csv(a("prompt_data"))
    if a("prompt_data_probs") is not None:
        o["data.train_probs"] = _floats(a, "prompt_data_probs")
    o["data.train_split"] = a("prompt_split")
    if a("eval_dataset") and a("eval_steps") == -1:
        notices.append(f"{a.flag('eval_dataset')}: OpenRLHF never evaluates with {a.flag('eval_steps')} -1, so "
                       "neither does tiller; give a step count to evaluate")
    elif a("eval_dataset"):
        o["data.val_files"] = _csv(a("eval_dataset"))
    o["data.val_split"] = a("eval_split")
    o["data.prompt_key"] = a("input_key")
    o["data.label_key"] = a("label_key")
    o["data.default_data_source"] = "openrlhf"  # OpenRLHF rows carry no data_source column
    if a("data.image_key") is not None:  # image prompts (vision-language models): the column of the images
        o["data.image_key"] = a("data.image_key")
    o[f"{arr}.actor.freeze_vision_tower"] = bool(a("actor.freeze_visual_encoder"))
    o["data.input_template"] = a("input_template")
    o["data.apply_chat_template"] = bool(a("apply_chat_template"))
    o["data.max_samples"] = a("max_samples")
    o["data.truncation"] = "right"
    _lengths(a, o, notices)
    # ---- batches: rollout_batch_size counts prompts, train_batch_size samples (prompts x n)
    n = a("n_samples_per_prompt")
    train_bs, micro, rollout_micro = a("train_batch_size"), a("micro_train_batch_size"), a("micro_rollout_batch_size")
    if train_bs % n:
        raise a.refuse("train_batch_size", f"it counts samples and must be a multiple of "
                                           f"{a.flag('n_samples_per_prompt')} ({n}): tiller updates on whole groups")
    o["data.train_batch_size"] = a("rollout_batch_size")
    o[f"{rollout}.n"] = n
    o[f"{actor}.ppo_mini_batch_size"] = train_bs // n
    if a("advantage_estimator") == "gae":  # only gae trains a critic (None = the actor's, as verl)
        o[f"{critic}.ppo_mini_batch_size"] = train_bs // n
    o[f"{actor}.ppo_micro_batch_size_per_gpu"] = micro
    o[f"{critic}.ppo_micro_batch_size_per_gpu"] = micro
    for key in (f"{rollout}.log_prob_micro_batch_size_per_gpu", f"{arr}.ref.log_prob_micro_batch_size_per_gpu",
                f"{critic}.forward_micro_batch_size_per_gpu", "reward_model.micro_batch_size_per_gpu"):
        o[key] = rollout_micro
    o[f"{actor}.ppo_epochs"] = a("max_epochs")
    o[f"{critic}.ppo_epochs"] = a("max_epochs")
    o["trainer.total_epochs"] = a("num_episodes")
    dyn = bool(a("use_dynamic_batch"))
    o[f"{actor}.use_dynamic_bsz"] = dyn
    # OpenRLHF's budget is per GPU of a ring-attention x tensor-parallel group, whose micro-batch holds budget x group
    # tokens (seqlen_balancing.get_minimum_num_micro_batch_size); a longer sequence runs alone in its micro-batch
    group = max(1, a("ring_attn_size") or 1) * max(1, a("ds_tensor_parallel_size") or 1)
    seq = o["data.max_prompt_length"] + o["data.max_response_length"]

    def tokens(flag: str) -> int:
        value = a(flag)
        total = value * group
        if dyn and total < seq:
            times = f" x {group} (ring attention x tensor parallel group)" if group > 1 else ""
            notices.append(f"{a.flag(flag)} {value}{times} is below one whole sequence of {seq} tokens, which "
                           f"OpenRLHF runs alone in a micro-batch; tiller's micro-batches hold at least one: {seq}")
            total = seq
        return total

    o[f"{actor}.ppo_max_token_len_per_gpu"] = tokens("train_max_tokens_per_gpu")
    o[f"{critic}.ppo_max_token_len_per_gpu"] = o[f"{actor}.ppo_max_token_len_per_gpu"]
    fwd_tokens = tokens("rollout_max_tokens_per_gpu" if a("rollout_max_tokens_per_gpu") else "train_max_tokens_per_gpu")
    for key in (f"{rollout}.log_prob_max_token_len_per_gpu", f"{arr}.ref.log_prob_max_token_len_per_gpu",
                f"{critic}.forward_max_token_len_per_gpu"):
        o[key] = fwd_tokens
    o["trainer.seed"] = a("seed")
    o["data.seed"] = a("seed")
    # ---- optimizers
    o[f"{actor}.optim.lr"] = a("actor_learning_rate")
    o[f"{critic}.optim.lr"] = a("critic_learning_rate")
    betas = list(a("adam_betas"))
    o[f"{actor}.optim.betas"] = betas
    o[f"{critic}.optim.betas"] = list(a("critic.adam.betas", betas))
    o[f"{actor}.optim.weight_decay"] = a("l2")
    o[f"{critic}.optim.weight_decay"] = a("critic.adam.weight_decay", a("l2"))
    for role in (actor, critic):  # OpenRLHF's Adam spares biases and norm weights (get_optimizer_grouped_parameters)
        if o[f"{role}.optim.weight_decay"]:
            o[f"{role}.optim.weight_decay_exempt"] = "openrlhf"
    _eps(a, o, "adam.eps", f"{actor}.optim.eps")
    o[f"{critic}.optim.eps"] = a("critic.adam.eps", 1e-8)
    _schedule(a, o, f"{actor}.optim", offline=False)
    if a.has("critic.lr_scheduler"):
        _schedule(a, o, f"{critic}.optim", offline=False, name="critic.lr_scheduler", warm="critic.lr_warmup_ratio",
                  floor="critic.min_lr_ratio")
    else:
        _schedule(a, o, f"{critic}.optim", offline=False)
    o[f"{actor}.grad_clip"] = a("max_norm")
    o[f"{critic}.grad_clip"] = a("critic.max_norm", a("max_norm"))
    dtype = _dtype(a)
    o[f"{actor}.dtype"] = dtype
    o[f"{critic}.dtype"] = dtype
    o[f"{arr}.model.enable_gradient_checkpointing"] = bool(a("gradient_checkpointing"))
    _lora(a, o, f"{arr}.model")
    # ---- models and rewards
    _models(a, o, notices)
    # ---- algorithm
    _algorithm(a, o, notices)
    # ---- rollout
    o[f"{rollout}.temperature"] = a("temperature")
    o[f"{rollout}.top_p"] = a("top_p")
    # vLLM-only settings: written when given (tiller's own defaults suit its CPU / in-process engines)
    eager, memory = a("enforce_eager"), a("vllm_gpu_memory_utilization")
    if a.given("enforce_eager"):
        o[f"{rollout}.enforce_eager"] = bool(eager)
    if a.given("vllm_gpu_memory_utilization"):
        o[f"{rollout}.gpu_memory_utilization"] = memory
    eval_t = a("eval_temperature")
    o[f"{rollout}.val_kwargs.temperature"] = eval_t
    o[f"{rollout}.val_kwargs.do_sample"] = eval_t > 0
    eval_n = a("eval_n_samples_per_prompt")
    if eval_t <= 0 and eval_n > 1:  # greedy: n identical answers, so one gives the same scores
        notices.append(f"{a.flag('eval_temperature')} {eval_t}: greedy evaluation, so tiller samples 1 answer per "
                       f"prompt instead of {eval_n} identical ones")
        eval_n = 1
    o[f"{rollout}.val_kwargs.n"] = eval_n
    o["trainer.critic_warmup"] = max(0, a("freezing_actor_steps"))
    o["trainer.val_before_train"] = False  # OpenRLHF evaluates every --eval_steps only
    _tracking(a, o, env, "trainer.max_actor_ckpt_to_keep")
    if a("packing_samples"):  # OpenRLHF packs the update's micro-batches: tiller's packed forwards (same loss)
        o[f"{arr}.model.use_remove_padding"] = True
        o[f"{critic}.model.use_remove_padding"] = True
    return o, env


def _lengths(a: Args, o: dict, notices: list[str]) -> None:
    """Prompt / response budgets. 0.8.x: --prompt_max_len + --generate_max_len (--max_len caps the sum);
    0.10+: --data.max_len is the total and --rollout.max_new_tokens the response (None: what is left)."""
    total, new = a("max_len"), a("generate_max_len")
    if a.has("prompt_max_len"):
        prompt = a("prompt_max_len")
        response = new if total is None else min(new, total - prompt)
    elif new is not None:
        prompt, response = total - new, new
    else:
        prompt = min(1024, total // 2)
        response = total - prompt
        notices.append(f"{a.flag('max_len')} {total} without {a.flag('generate_max_len')}: tiller fixes the "
                       f"budgets up front: prompts up to {prompt} tokens, responses up to {response} (OpenRLHF: "
                       "max_len - prompt length per sample); set --rollout.max_new_tokens to choose")
    if prompt <= 0 or response <= 0:
        raise a.refuse("max_len", "leaves no room for the prompt or the response")
    o["data.max_prompt_length"] = prompt
    o["data.max_response_length"] = response


def _agent(a: Args, o: dict, notices: list[str]) -> bool:
    """--agent_func_path / --train.agent_func_path: OpenRLHF sets its reward to the agent's (remote_rm_url =
    "agent"), runs the file's AgentExecutor until the instance says done or the --max_len budget is spent."""
    path = a("agent_func_path")
    if not path:
        return False
    if not str(path).endswith(".py"):
        raise a.refuse("agent_func_path", "a Python file holding OpenRLHF's AgentExecutor class (as OpenRLHF)")
    agent = "actor_rollout_ref.rollout.agent"
    o[f"{agent}.env_path"] = path
    o[f"{agent}.env_name"] = "AgentExecutor"
    o[f"{agent}.max_turns"] = 10000  # OpenRLHF 0.8's max_steps default; 0.10+ has no cap but the budget
    o[f"{agent}.max_context"] = o["data.max_prompt_length"] + o["data.max_response_length"]
    for name in ("reward_pretrain", "remote_rm_url"):
        if a(name):
            notices.append(f"{a.flag(name)}: not used with {a.flag('agent_func_path')} (OpenRLHF takes the agent's "
                           "rewards)")
    return True


def _models(a: Args, o: dict, notices: list[str]) -> None:
    reward, remote = a("reward_pretrain"), a("remote_rm_url")
    if _agent(a, o, notices):
        reward = remote = None
    elif reward and remote:
        raise a.refuse("remote_rm_url", f"give {a.flag('reward_pretrain')} or {a.flag('remote_rm_url')}, not both")
    if reward:
        paths = _csv(reward)
        if len(paths) > 1:
            raise a.refuse("reward_pretrain", "one reward model only (tiller)")
        o["reward_model.enable"] = True
        o["reward_model.model.path"] = paths[0]
    elif remote:
        urls = _csv(remote)
        if len(urls) > 1:
            raise a.refuse("remote_rm_url", "one reward endpoint or reward_func file only (tiller)")
        if urls[0].endswith(".py"):
            o["custom_reward_function.path"] = urls[0]
            o["custom_reward_function.name"] = "reward_func"
            o["reward_model.reward_manager"] = "openrlhf"
        else:
            o["reward_model.remote_url"] = urls[0]
            o["reward_model.remote_format"] = "openrlhf"
    elif not a("agent_func_path"):
        raise ConfigError(f"give a reward: {a.flag('reward_pretrain')} (a reward model), "
                          f"{a.flag('remote_rm_url')} (an HTTP endpoint or a reward_func .py file) or "
                          f"{a.flag('agent_func_path')} (an agent that gives rewards)")
    o["reward_model.normalize"] = bool(a("normalize_reward"))
    if a("normalize_reward") and not reward:
        notices.append(f"{a.flag('normalize_reward')}: applies to a reward model's scores (mean / std in its "
                       "config.json); a remote server normalises its own scores")
    o["reward_model.clip_range"] = [float(x) for x in a("reward_clip_range")]
    # OpenRLHF's critic: --critic_pretrain, else the reward model, else (remote reward) the policy
    critic = a("critic_pretrain") or (_csv(reward)[0] if reward else a("pretrain"))
    if a("advantage_estimator") == "gae":
        o["critic.model.path"] = critic
        if a("lora_rank"):  # OpenRLHF builds its critic with the same --lora_* (and 4-bit) settings as the actor
            _lora(a, o, "critic.model")
            notices.append(f"{a.flag('lora_rank')}: the critic gets LoRA adapters on its body too, its value head "
                           "trains in full (verl's critic LoRA; OpenRLHF's peft config has no modules_to_save)")
    buffer = a("overlong_buffer_len")
    factor = a("overlong_penalty_factor")
    if buffer is not None:
        if not str(remote or "").endswith(".py"):
            raise a.refuse("overlong_buffer_len", "tiller's DAPO overlong shaping runs with a reward_func .py "
                                                  "(--remote_rm_url file.py)")
        o["reward_model.overlong_buffer.enable"] = True
        o["reward_model.overlong_buffer.len"] = int(buffer)
        o["reward_model.overlong_buffer.penalty_factor"] = factor
    stop_coef = a("reward.stop_properly_penalty_coef")
    if stop_coef is not None:
        o["reward_model.stop_properly_penalty_coef"] = float(stop_coef)


def _algorithm(a: Args, o: dict, notices: list[str]) -> None:
    actor = "actor_rollout_ref.actor"
    est = a("advantage_estimator")
    if est not in ESTIMATORS:
        raise a.refuse("advantage_estimator", f"one of {', '.join(ESTIMATORS)}")
    o["algorithm.adv_estimator"] = ESTIMATORS[est]
    o["algorithm.norm_adv_by_std_in_grpo"] = est != "dr_grpo"
    if a("no_advantage_std_norm") and est in ("gae", "reinforce", "reinforce_baseline"):
        raise a.refuse("no_advantage_std_norm", "tiller whitens gae / reinforce / reinforce_baseline advantages "
                                                "with the std (no mean-only option)")
    gamma = a("gamma")
    if gamma != 1.0 and est not in ("gae", "reinforce"):
        notices.append(f"{a.flag('gamma')} {gamma}: OpenRLHF sets gamma to 1.0 for {est}; so does tiller")
    o["algorithm.gamma"] = gamma if est in ("gae", "reinforce") else 1.0
    o["algorithm.lam"] = a("lambd")
    # KL: in the loss (GRPO style) or, OpenRLHF's default, in the reward
    coef, kind = a("init_kl_coef"), KL_KINDS.get(a("kl_estimator"))
    if kind is None:
        raise a.refuse("kl_estimator", "k1, k2 or k3")
    target, horizon = a("kl_target"), a("kl_horizon")
    if a("use_kl_loss"):
        o[f"{actor}.use_kl_loss"] = coef > 0
        o[f"{actor}.kl_loss_coef"] = coef
        o[f"{actor}.kl_loss_type"] = kind
        o["algorithm.use_kl_in_reward"] = False
        if target is not None:
            raise a.refuse("kl_target", "an adaptive KL coefficient applies to KL in the reward, not --use_kl_loss")
    else:
        o[f"{actor}.use_kl_loss"] = False
        o["algorithm.use_kl_in_reward"] = coef > 0
        o["algorithm.kl_penalty"] = kind
        o["algorithm.kl_ctrl.kl_coef"] = coef
        o["algorithm.kl_ctrl.type"] = "adaptive" if target is not None else "fixed"
        if target is not None:
            o["algorithm.kl_ctrl.target_kl"] = target
        o["algorithm.kl_ctrl.horizon"] = horizon
        if coef > 0 and est in ("rloo", "reinforce_baseline", "group_norm", "dr_grpo"):
            notices.append(f"KL in the reward ({a.flag('init_kl_coef')} {coef}) with {est}: tiller subtracts it from "
                           "the token rewards before the group baseline, OpenRLHF after it")
    # policy loss
    o[f"{actor}.clip_ratio"] = a("eps_clip")
    low_high = a("eps_clip_low_high")
    if low_high is not None:
        o[f"{actor}.clip_ratio_low"], o[f"{actor}.clip_ratio_high"] = float(low_high[0]), float(low_high[1])
    dual = a("dual_clip")
    if dual is not None and not dual > 1:
        raise a.refuse("dual_clip", "the dual-clip constant must be > 1")
    o[f"{actor}.clip_ratio_c"] = NO_DUAL_CLIP if dual is None else dual
    o["critic.cliprange_value"] = a("value_clip")
    loss = a("policy_loss_type")
    o[f"{actor}.policy_loss.loss_mode"] = {"ppo": "vanilla", "gspo": "gspo"}.get(loss, loss)
    entropy = a("entropy_loss_coef")
    o[f"{actor}.entropy_coeff"] = 0.0 if entropy is None else entropy
    if a("aux_loss_coef"):  # a mixture-of-experts actor's router load-balancing loss
        o[f"{actor}.router_aux_loss_coef"] = float(a("aux_loss_coef"))
    # dynamic filtering (DAPO dynamic sampling)
    if a("dynamic_filtering"):
        low, high = (float(x) for x in a("dynamic_filtering_reward_range"))
        if (low, high) != (0.0, 1.0):
            raise a.refuse("dynamic_filtering_reward_range", "tiller drops groups whose scores are all equal, which "
                                                             "is the (0, 1) range for 0 / 1 rewards only")
        if a("n_samples_per_prompt") < 2:
            raise a.refuse("dynamic_filtering", "needs --n_samples_per_prompt > 1")
        o["algorithm.filter_groups.enable"] = True
        o["algorithm.filter_groups.metric"] = "acc"  # OpenRLHF filters on `scores` (extras["acc"])
    else:
        a("dynamic_filtering_reward_range")
    _is_correction(a, o)
    _async(a, o)


def _async(a: Args, o: dict) -> None:
    """--async_train / --train.async_enable: OpenRLHF's generator takes one of --train.async_queue_size tokens
    before each batch and the trainer returns it when it takes the batch, weights going to vLLM after each
    train step, so a batch is at most queue-size policy versions old when it is trained on: tiller's
    async_training.staleness_threshold. --train.partial_rollout_enable: async_training.partial_rollout."""
    queue, partial = a("train.async_queue_size"), a("train.partial_rollout_enable")
    if not a("async_train"):
        if partial:
            raise a.refuse("train.partial_rollout_enable", "needs --train.async_enable (as in OpenRLHF)")
        return
    queue = 1 if queue is None else queue
    if queue < 1:
        raise a.refuse("train.async_queue_size", "must be >= 1 (batches the generator may run ahead)")
    o["async_training.staleness_threshold"] = queue
    o["async_training.partial_rollout"] = bool(partial)


def _is_correction(a: Args, o: dict) -> None:
    corr = "algorithm.rollout_correction"
    enabled = a("enable_vllm_is_correction")
    if a.has("vllm_is_truncated_threshold"):
        threshold = a("vllm_is_truncated_threshold")
        if enabled:
            o[f"{corr}.rollout_is"] = "token"
            o[f"{corr}.rollout_is_threshold"] = threshold
        return
    kind, (low, high) = a("algo.advantage.is_correction_type"), a("algo.advantage.is_correction_threshold")
    if not enabled:
        return
    if kind == "tis":
        o[f"{corr}.rollout_is"] = "token"
        o[f"{corr}.rollout_is_threshold"] = float(high)
    elif kind == "icepop":
        o[f"{corr}.rollout_rs"] = "token_k1"
        # OpenRLHF bounds p_old / p_rollout in [low, high]; verl's (and tiller's) k1 bounds p_rollout / p_old
        o[f"{corr}.rollout_rs_threshold"] = f"{1.0 / float(high)!r}_{1.0 / float(low)!r}"
    else:
        raise a.refuse("algo.advantage.is_correction_type", "seq-mask-tis is not available; use tis or icepop")


# ------------------------------------------------------------------------------------------- entry


UNUSED_WITHOUT = {  # PPO options that only act with another one (in OpenRLHF too): given alone, say so
    "dynamic_filtering_reward_range": "dynamic_filtering", "overlong_penalty_factor": "overlong_buffer_len",
    "vllm_is_truncated_threshold": "enable_vllm_is_correction",
    "algo.advantage.is_correction_threshold": "enable_vllm_is_correction",
    "algo.advantage.is_correction_type": "enable_vllm_is_correction",
    "train.async_queue_size": "async_train",
}


def _unused_notices(a: Args, notices: list[str]) -> None:
    for name, needs in UNUSED_WITHOUT.items():
        if a.given(name) and not a(needs):
            notices.append(f"{a.flag(name)}: has no effect without {a.flag(needs)} (as in OpenRLHF)")


def _device(values: dict, notices: list[str]) -> None:
    """OpenRLHF trains on GPUs: trainer.device=cuda when one is visible, else cpu with a notice."""
    import torch  # already loaded by the config layer's users; cheap here

    if torch.cuda.is_available():
        values["trainer.device"] = "cuda"
    else:
        values["trainer.device"] = "cpu"
        notices.append("no CUDA device visible: tiller runs this job on the CPU (trainer.device=cpu)")


def translate(cmd: Command) -> Translation:
    """The tiller job and config values for a parsed OpenRLHF command line (see the module docstring)."""
    a = Args(cmd)
    notices: list[str] = []
    by_name = {row.name: row for row in flag_index().values()}
    rows = {name: by_name[name] for name in cmd.values}
    for name, row in rows.items():
        kind, text = row.for_job(cmd.job)
        if kind == REFUSED and name in cmd.given and cmd.values[name] != cmd.defaults[name]:
            raise ConfigError(f"{a.flag(name)} {_show(cmd.values[name])}: refused: {text}".replace(" True:", ":"))
    if cmd.job == "train_ppo_ray":
        values, env = _ppo(a, notices)
    else:
        values, env = _offline(a, cmd.job, notices)
        {"train_sft": _sft, "train_kto": lambda a_, o_, _n: _kto(a_, o_),
         "train_rm": lambda a_, o_, _n: _pairs(a_, o_, "train_rm"),
         "train_dpo": lambda a_, o_, _n: _pairs(a_, o_, "train_dpo")}[cmd.job](a, values, notices)
    hints = []
    for name, row in rows.items():
        kind, text = row.for_job(cmd.job)
        if kind == HINT and name in cmd.given:
            hints.append(f"{a.flag(name)} {_show(cmd.values[name])}: {text}".replace(" True:", ":"))
        elif kind == MAPPED and name not in a.read:
            raise AssertionError(f"internal: mapped flag {a.flag(name)} of {cmd.job} was not translated")
    if cmd.job == "train_ppo_ray":
        _unused_notices(a, notices)
    _device(values, notices)
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: {value} is not a finite number")
    return Translation(TILLER_JOB[cmd.job], values, hints + notices, env)
