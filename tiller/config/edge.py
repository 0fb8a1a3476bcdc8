"""The verl edge: every key of the RL schema is honoured, refused, or accepted as a stated no-op.

A verl command line ports by changing the entry point, so each of verl's keys that tiller accepts has one
of three states, and this module is where the two that are not "honoured" are written down:

- **honoured**: tiller reads the key and does what verl does with it. Found by a static scan of the package
  (`tiller.config.readers`), or declared here when the key is converted at load time (a deprecated verl
  key turned into its successor: `DEPRECATED`).
- **refused**: any value but the accepted ones is an error at load time that says why and what to use.
- **no-op**: the key only tunes machinery tiller does differently (CPU offload, sequence parallelism,
  vLLM knobs when the engine is tiller's own, ...). It is accepted; at start-up one line lists the no-op
  keys the user set. A no-op may be conditional: honoured when its condition holds (e.g. the vLLM knobs
  with `rollout.name=vllm`), a no-op otherwise.

`tests/test_verl_edge.py` walks the whole schema and fails on a key with no reader and no declared state,
and on a declared no-op / refusal that has a reader after all. `tiller config keys --markdown` prints the
table committed as `docs/verl-keys.md`.

Load-time work (`apply_edge`, called first by `validate_rl`): deprecated keys converted (global micro-batch
sizes divided by the number of workers, as verl does, with one deprecation line each; a deprecated key and
its successor both set is an error), keys that default to another key's value resolved, refusals raised.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable

from tiller.config.given import given_keys
from tiller.config.readers import config_reads, schema_sections
from tiller.config.schema import (DistillationInferenceConfig, FSDPConfig, LoraConfig, MtpConfig, OptimConfig,
                                  RLConfig, TraceConfig, TransferQueueConfig)
from tiller.config.schema_verl010 import MEGATRON_OPTIM_OPTIONS, QatConfig, SkipStageConfig
from tiller.errors import ConfigError

HONOURED, NOOP, REFUSED = "honoured", "no-op", "refused"
_SANDBOX_FUSION = ("{url, max_concurrent, memory_limit_mb}: with url set, verl's code data sources (codecontests, "
                   "apps, codeforces, taco) are scored on that SandboxFusion /run_code server, at most max_concurrent "
                   "requests in flight across the reward workers, each run limited to memory_limit_mb "
                   "(tiller.rewards.sandbox_fusion; docs/rewards.md)")


def _default_value(path: str) -> Any:
    """The schema's default at `path` (a dotted key)."""
    node: Any = RLConfig()
    for part in path.split("."):
        node = getattr(node, part)
    return node


@dataclass(frozen=True)
class Rule:
    """The declared state of one key (anything not declared must have a reader in the package)."""

    state: str
    reason: str
    use: str = ""  # refused: what to use instead
    allowed: tuple = ()  # refused: the values accepted
    honoured_if: Callable[[RLConfig], bool] | None = None  # conditional no-op: honoured when this holds
    condition: str = ""  # the condition in words, for the table and the start-up line


def noop(reason: str, honoured_if: Callable[[RLConfig], bool] | None = None, condition: str = "") -> Rule:
    return Rule(NOOP, reason, honoured_if=honoured_if, condition=condition)


def refused(reason: str, use: str, allowed: tuple) -> Rule:
    return Rule(REFUSED, reason, use=use, allowed=allowed)


def _vllm(cfg: RLConfig) -> bool:
    return cfg.actor_rollout_ref.rollout.name == "vllm"


def _ray(cfg: RLConfig) -> bool:
    return cfg.trainer.backend == "ray"


def _several_workers(cfg: RLConfig) -> bool:
    return num_workers(cfg) > 1


def async_enabled(cfg: RLConfig) -> bool:
    """Whether the rollout producer runs (staleness_threshold > 0 or trigger_parameter_sync_step > 1)."""
    at = cfg.async_training
    return at.staleness_threshold > 0 or at.trigger_parameter_sync_step > 1


def _ray_async(cfg: RLConfig) -> bool:
    """Asynchronous RL with trainer.backend=ray: the rollout pool runs."""
    return cfg.trainer.backend == "ray" and async_enabled(cfg)


def num_workers(cfg: RLConfig) -> int:
    """Data-parallel workers of the actor group: nnodes x n_gpus_per_node with trainer.backend=ray, else 1."""
    tr = cfg.trainer
    return tr.nnodes * tr.n_gpus_per_node if tr.backend == "ray" else 1


_PADDING = ("tiller pads this model's micro-batches and trims them to the columns its rows use (packing without "
            "padding is built for the actor's and the critic's forwards: actor_rollout_ref.model.use_remove_padding, "
            "critic.model.use_remove_padding)")
_ULYSSES = ("tiller runs whole sequences on each worker (the update is the same; memory per worker is not "
            "split); verl's per-GPU token budgets of the role are its share of a micro-batch of this many GPUs, so "
            "they are multiplied by this size at load time, as verl does, and micro-batches hold the same sequences")
_VLLM = "a vLLM engine knob"

RULES: dict[str, Rule] = {
    "distillation.distillation_loss.policy_loss_mode": refused(
        "the distillation surrogate is PPO's vanilla clipped loss (verl allows only vanilla too)",
        use="leave it vanilla", allowed=("vanilla",)),
    "distillation.distillation_loss.topk": noop("only the *_topk loss modes read it, and tiller refuses them"),
    "distillation.distillation_loss.log_prob_min_clamp": noop(
        "verl 0.10 reads it only in the *_topk loss (refused here), never for the k1/k2/k3/abs estimators, so "
        "algorithm.distill.log_prob_min_clamp is null (no clamp) in verl's layout"),
    "distillation.distillation_loss.clip_ratio": noop(
        "verl's vanilla surrogate reads clip_ratio_low / clip_ratio_high, which always have a value"),
    "distillation.num_workers": noop("tiller's teacher is a frozen model inside each actor worker"),
    "distillation.teacher_model.enable_resource_pool": noop("tiller's teacher is a frozen model inside each actor "
                                                            "worker"),
    "distillation.teacher_model.n_gpus_per_node": noop("tiller's teacher is a frozen model inside each actor worker"),
    "distillation.teacher_model.nnodes": noop("tiller's teacher is a frozen model inside each actor worker"),
    "actor_rollout_ref.model.lora.merge": noop("tiller always syncs merged weights (base + adapters) to the rollout "
                                               "engine"),
    "actor_rollout_ref.hybrid_engine": Rule(HONOURED, "True: actor, rollout and reference in one worker (verl's "
                                            "hybrid engine). False, verl fully-async's split layout: asynchronous RL "
                                            "with trainer.backend=ray, whose rollout pool generates apart (refused "
                                            "otherwise)"),
    "reward_model.model.use_remove_padding": noop(_PADDING),
    "actor_rollout_ref.model.use_shm": noop("tiller loads the model from model.path (no /dev/shm copy)"),
    "actor_rollout_ref.actor.calculate_sum_pi_squared": noop(
        "tiller's old-logprob forward returns sum pi^2 whenever algorithm.adv_estimator is an optimal token "
        "baseline (the only user), set or not"),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": noop(
        "one process runs whole sequences with trainer.backend=local (the update is the same; memory is not split); "
        "verl's per-GPU token budgets of the actor are its share of a micro-batch of this many GPUs, so they are "
        "multiplied by this size at load time, as verl does", _several_workers,
        "trainer.backend=ray with more than one worker (tiller.workers.ulysses)"),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": noop(
        "the reference's forward runs in the actor's workers, split as actor.ulysses_sequence_parallel_size says; "
        "verl's per-GPU token budget of the reference is its share of a micro-batch of this many GPUs, so it is "
        "multiplied by this size at load time, as verl does"),
    "critic.ulysses_sequence_parallel_size": noop(
        "one process runs whole sequences with trainer.backend=local (the update is the same; memory is not split); "
        "verl's per-GPU token budgets of the critic are its share of a micro-batch of this many GPUs, so they are "
        "multiplied by this size at load time, as verl does", _several_workers,
        "trainer.backend=ray with more than one worker (tiller.workers.ulysses)"),
    "actor_rollout_ref.rollout.mode": noop("tiller's engines run inside the actor worker; there is no separate "
                                           "async server mode to pick"),
    "actor_rollout_ref.rollout.load_format": noop("tiller's vllm engine loads model.path, then takes the "
                                                  "actor's weights at each sync"),
    "actor_rollout_ref.rollout.layered_summon": noop("tiller merges LoRA adapters into one state dict per sync"),
    "actor_rollout_ref.rollout.calculate_log_probs": noop(
        "tiller's engines always return the sampler's logprobs (rollout_log_probs)"),
    "data.dataloader_num_workers": noop("tiller tokenizes the prompt files once at start-up, in the driver"),
    "critic.model.tokenizer_path": noop("the critic reads the actor's token ids: it needs the actor's vocabulary, "
                                        "not a tokenizer of its own"),
    "reward_model.model.input_tokenizer": noop(
        "tiller always hands the reward model decoded text rendered with the RM's own chat template (what "
        "this key switches on in verl)"),
    "actor_rollout_ref.actor.optim.total_training_steps": noop(
        "derived from the data and trainer.total_epochs / total_training_steps (verl overwrites it too)"),
    "critic.optim.total_training_steps": noop(
        "derived from the data and trainer.total_epochs / total_training_steps (verl overwrites it too)"),
    "trainer.use_legacy_worker_impl": noop("tiller has one worker implementation"),
    "async_training.require_batches": noop(
        "tiller's step takes data.train_batch_size prompts, which is require_batches x ppo_mini_batch_size; "
        "any other value is refused at load time"),
    "trainer.nnodes": noop("one process runs everything with trainer.backend=local", _ray, "trainer.backend=ray"),
    "trainer.n_gpus_per_node": noop("one process runs everything with trainer.backend=local", _ray,
                                    "trainer.backend=ray"),
    "trainer.balance_batch": noop("one data-parallel worker has nothing to balance", _several_workers,
                                  "trainer.backend=ray with more than one worker"),
}
for _key in ("gpu_memory_utilization", "tensor_model_parallel_size", "free_cache_engine",
             "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching", "scheduling_policy",
             "disable_log_stats"):
    RULES[f"actor_rollout_ref.rollout.{_key}"] = noop(_VLLM, _vllm, "rollout.name=vllm")
_MIXED_PRECISION = ("verl's FSDP mixed precision {param_dtype, reduce_dtype, buffer_dtype}: param_dtype (bf16 / fp32) "
                    "is the role's compute dtype when {role}.dtype is unset (tiller keeps fp32 master weights and "
                    "computes under autocast, as verl's bf16 params over fp32 shards); reduce_dtype and buffer_dtype: "
                    "tiller reduces gradients and keeps buffers in fp32 (another value is said to have no effect)")
for _key, _role in (("actor_rollout_ref.actor.fsdp_config.mixed_precision", "actor_rollout_ref.actor"),
                    ("critic.model.fsdp_config.mixed_precision", "critic"), ("critic.fsdp.mixed_precision", "critic")):
    RULES[_key] = Rule(HONOURED, _MIXED_PRECISION.replace("{role}", _role))
RULES["actor_rollout_ref.ref.fsdp_config.mixed_precision"] = noop(
    "the reference runs in the actor's worker, in actor_rollout_ref.actor.dtype (set it, or the actor's "
    "fsdp_config.mixed_precision.param_dtype)")
RULES["actor_rollout_ref.rollout.enforce_eager"] = noop(
    "vLLM's CUDA graphs / torch.compile, or the native engine's CUDA-graph decode (CUDA) / compiled decode step (CPU)",
    lambda cfg: cfg.actor_rollout_ref.rollout.name in ("vllm", "native"), "rollout.name=vllm or native")
RULES["actor_rollout_ref.rollout.max_num_seqs"] = noop(
    "the rows an engine decodes together: the native engine's waves and CUDA-graph sizes; vLLM's max_num_seqs when set "
    "(else vLLM's default for its device)",
    lambda cfg: cfg.actor_rollout_ref.rollout.name in ("vllm", "native"), "rollout.name=vllm or native")
RULES["actor_rollout_ref.rollout.cudagraph_capture_sizes"] = noop(
    "the batch sizes CUDA graphs are captured for: the native engine's buckets; vLLM's compilation_config (as verl "
    "passes it; vLLM captures none under enforce_eager)",
    lambda cfg: cfg.actor_rollout_ref.rollout.name in ("vllm", "native"), "rollout.name=vllm or native")

# ----------------------------------------------------------------- verl 0.7 / 0.8.0.dev's tree (b178a3cd)
_MEGATRON = ("read only by verl's Megatron-Core workers (strategy=megatron, which tiller refuses: its workers shard "
             "with FSDP2 over data-parallel ranks, no tensor / pipeline / expert parallelism)")
_PROFILER = "verl's nsys / npu / torch profiler hooks; tiller has no profiler integration (use py-spy or torch.profiler)"
_LORA_VISION = ("verl's Megatron LoRA knob; tiller's LoRA adapts the modules named in lora.target_modules (the "
                "language model's, by default) and actor.freeze_vision_tower freezes the vision tower")
_VIDEO = ("tiller's vision-language path takes images only (Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE / "
          "Qwen3.5 image prompts); a row with a non-empty 'videos' column is refused at load")
_MEMORY = "a GPU memory tuning (recompute / offload / chunking) tiller does not have; the update is the same"
_CKPT = ("tiller saves and loads model, optimizer and trainer state together, synchronously (a checkpoint is "
         "always complete)")
_ROLE_DICTS = {  # leaf name of a role section -> its rule (actor, ref, critic, reward_model)
    "profiler": noop(_PROFILER),
    "megatron": noop(_MEGATRON),
    "load_weight": noop(_MEGATRON),
    "checkpoint": noop(_CKPT),
    "nccl_timeout": noop("tiller's process groups use torch.distributed's default timeout"),
    "rollout_n": Rule(HONOURED, "verl's copy of actor_rollout_ref.rollout.n: null or the same value (another value "
                                "is an error at load time)"),
    "entropy_from_logits_with_chunking": noop(_MEMORY),
    "entropy_checkpointing": noop(_MEMORY),
    "sum_pi_squared_checkpointing": noop(_MEMORY),
    "data_loader_seed": noop("tiller seeds the mini-batch shuffle from trainer.seed"),
}
RULES.update({
    # strategy / data-parallel shape
    "actor_rollout_ref.ref.strategy": Rule(HONOURED, "verl's copy of actor.strategy: null or the actor's value "
                                                     "(the reference runs in the actor's worker)"),
    "actor_rollout_ref.ref.use_torch_compile": Rule(HONOURED, "null: the actor's use_torch_compile; true / false: "
                                                              "the reference's decoder layers compiled or not"),
    "reward_model.strategy": noop("tiller runs the reward-model forward in the driver process (megatron is refused)"),
    "actor_rollout_ref.nccl_timeout": noop("tiller's process groups use torch.distributed's default timeout"),
    # model
    "actor_rollout_ref.model.hf_config_path": refused(
        "tiller reads the model's config.json from model.path", use="edit model.path's config.json or use "
                                                                    "+actor_rollout_ref.model.override_config.KEY=V",
        allowed=(None,)),
    "actor_rollout_ref.model.enable_activation_offload": noop(_MEMORY),
    "critic.model.enable_activation_offload": noop(_MEMORY),
    "actor_rollout_ref.model.use_liger": noop("tiller runs the Hugging Face modelling code (no Liger kernels); the "
                                              "math is the same"),
    "actor_rollout_ref.model.fused_kernel_options": noop(
        "model.use_fused_kernels runs tiller's one implementation (torch chunks, compiled by Inductor on CUDA), "
        "whatever impl_backend names"),
    "actor_rollout_ref.model.tiled_mlp": noop(_MEMORY),
    "critic.model.tiled_mlp": noop(_MEMORY),
    "actor_rollout_ref.model.mtp.enable": refused(
        "tiller's models have no multi-token-prediction heads to train or to draft with", use="leave it False",
        allowed=(False,)),
    "actor_rollout_ref.rollout.mtp": noop("verl's copy of model.mtp for the engine (mtp.enable is refused)"),
    "actor_rollout_ref.model.lora.type": refused("tiller trains plain LoRA adapters", use="type=lora",
                                                 allowed=("lora",)),
    "actor_rollout_ref.model.lora.dropout": refused("verl's Megatron LoRA section (its FSDP workers never read it); "
                                                    "tiller's LoRA dropout is actor_rollout_ref.model.lora_dropout",
                                                    use="dropout=0 and actor_rollout_ref.model.lora_dropout=P",
                                                    allowed=(0, 0.0)),
    "actor_rollout_ref.model.lora.freeze_language_model": noop("tiller always freezes the base weights under LoRA "
                                                               "adapters"),
    # actor
    "actor_rollout_ref.actor.calculate_entropy": noop("tiller computes and logs the entropy every update"),
    "actor_rollout_ref.actor.use_prefix_grouper": noop(
        "tiller's actor.share_prompt_forward (on by default) runs each group's shared prompt once, as the prefix "
        "grouper does"),
    "actor_rollout_ref.actor.use_fused_kernels": noop("verl's copy of model.use_fused_kernels, which tiller reads"),
    "actor_rollout_ref.actor.use_remove_padding": noop(
        "verl's copy of actor_rollout_ref.model.use_remove_padding, which is the key tiller reads (set that one)"),
    # rollout
    "actor_rollout_ref.rollout.data_parallel_size": refused(
        "tiller runs one engine per actor worker (data parallelism = the workers)", use="1; more workers with "
        "trainer.backend=ray", allowed=(1,)),
    "actor_rollout_ref.rollout.expert_parallel_size": refused(
        "tiller's vllm engine uses tensor parallelism only", use="1", allowed=(1,)),
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": refused(
        "tiller's vllm engine uses tensor parallelism only", use="1", allowed=(1,)),
    "actor_rollout_ref.rollout.logprobs_mode": refused(
        "tiller's engines return the logprobs of the distribution each token was sampled from (after temperature, "
        "top-k, top-p)", use="processed_logprobs", allowed=("processed_logprobs",)),
    "actor_rollout_ref.rollout.over_sample_rate": noop(
        "verl 0.10 declares it (abort the remaining requests once (1 - rate) of them are done) but none of its code "
        "reads it; tiller, like verl, waits for every sample of a step"),
    "actor_rollout_ref.rollout.skip_rollout": refused(
        "this pre-0.10 key's dump layout is not read (verl changed it twice)", allowed=(False,),
        use="verl 0.10's skip.rollout.enable=true skip.rollout.steps=[...] skip.rollout.dump_dir=DIR"),
    "actor_rollout_ref.rollout.skip_dump_dir": noop("only with rollout.skip_rollout, which is refused"),
    "actor_rollout_ref.rollout.quantization": refused(
        "tiller's rollout engines run the actor's weights unquantized", use="leave it null", allowed=(None,)),
    "actor_rollout_ref.rollout.quantization_config_file": refused(
        "only with rollout.quantization, which is refused", use="leave it null", allowed=(None,)),
    "actor_rollout_ref.rollout.profiler": noop(_PROFILER),
    "actor_rollout_ref.rollout.prometheus": noop("tiller's metrics go to trainer.logger (no Prometheus exporter)"),
    "actor_rollout_ref.rollout.layer_name_map": noop(_MEGATRON),
    "actor_rollout_ref.rollout.max_model_len": noop("tiller's engines size their context as prompt + response "
                                                    "length"),
    "actor_rollout_ref.rollout.skip_tokenizer_init": noop("tiller's engines decode with the actor's tokenizer"),
    "actor_rollout_ref.rollout.multi_stage_wake_up": noop(_MEMORY),
    **{f"actor_rollout_ref.{role}.router_replay.{k}": noop("declared by verl, read by none of its code: the routing "
                                                           "travels in the batch (routed_experts)")
       for role in ("actor", "ref") for k in ("record_file", "replay_file")},
    "actor_rollout_ref.rollout.checkpoint_engine.backend": refused(
        "verl's checkpoint engines (nccl, hccl, nixl, ...) move weights from trainer GPUs to separate rollout "
        "servers; tiller's engines live in the actor's process and take the weights in memory, which is verl's naive "
        "backend", use="naive", allowed=("naive",)),
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": noop(
        "tiller's vllm weight sync uses its own bucket size"),
    "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs": noop(
        "keyword arguments of a checkpoint-engine backend (only naive, which takes none)"),
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": refused(
        "simulated-user interactions are not built (tiller's multi-turn loop calls tools)",
        use="an environment rollout: actor_rollout_ref.rollout.agent.env_path", allowed=(None,)),
    "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template": noop(
        "tiller renders every turn with the tokenizer's chat template"),
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode": noop(
        "tiller tokenizes each turn once and appends the ids (nothing to re-check)"),
    "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts": noop("samples per prompt are rollout.n"),
    "actor_rollout_ref.rollout.agent.num_workers": noop(
        "tiller's episodes run in one event loop of the driver (agent.max_concurrency bounds them)"),
    "actor_rollout_ref.rollout.agent.default_agent_loop": Rule(
        HONOURED, "the loop of rows without agent_name: single_turn_agent, tool_agent (multi_turn.enable) or a loop "
        "of agent_loop_config_path"),
    "actor_rollout_ref.rollout.agent.agent_loop_config_path": Rule(
        HONOURED, "verl's custom agent loops (AgentLoopBase subclasses, per-row agent_name) on tiller's engine "
        "(tiller.rollout.verl_agent_loop, docs/agents.md)"),
    "actor_rollout_ref.rollout.agent.custom_async_server": refused(
        "a custom async rollout server class is not built", use="rollout.name=native|hf|vllm",
        allowed=({"path": None, "name": None},)),
    # critic
    "critic.enable": Rule(HONOURED, "null = auto; tiller trains a critic exactly when algorithm.adv_estimator=gae, "
                                    "so a value that disagrees is an error at load time"),
    "critic.model.external_lib": noop("tiller imports actor_rollout_ref.model.external_lib once for every model"),
    "critic.model.use_shm": noop("tiller loads the model from its path (no /dev/shm copy)"),
    "critic.model.lora": noop(_MEGATRON),
    # reward model
    "reward_model.enable_resource_pool": noop("tiller runs the reward model next to the trainer (no separate GPU "
                                              "pool)"),
    "reward_model.n_gpus_per_node": noop("only with reward_model.enable_resource_pool"),
    "reward_model.nnodes": noop("only with reward_model.enable_resource_pool"),
    "reward_model.model.external_lib": noop("tiller imports actor_rollout_ref.model.external_lib once for every "
                                            "model"),
    "reward_model.model.override_config": refused(
        "tiller loads the reward model's config as saved", use="edit the RM's config.json", allowed=({},)),
    "reward_model.model.use_shm": noop("tiller loads the model from its path (no /dev/shm copy)"),
    "reward_model.model.use_fused_kernels": noop("no fused kernels in tiller"),
    "reward_model.launch_reward_fn_async": noop(
        "tiller scores rewards in the driver (reward_manager=parallel runs them in processes)"),
    "reward_model.use_reward_loop": noop("tiller has one reward path"),
    "reward_model.sandbox_fusion": Rule(HONOURED, _SANDBOX_FUSION),
    "reward_model.ulysses_sequence_parallel_size": noop(_ULYSSES),
    "reward_model.rollout": noop(
        "the engine of a generative reward model in verl's reward loop; tiller's reward model is a sequence "
        "classifier (reward_model.model.path) or reward_model.remote_url"),
    # top-level reward_manager section (verl 0.7)
    # algorithm
    # data
    "data.use_shm": noop("tiller reads the data files where they are (no /dev/shm copy)"),
    "data.return_raw_input_ids": noop("tiller's reward path works on decoded text; the ids are on every sample"),
    "data.return_full_prompt": noop("tiller keeps the rendered prompt whenever a reward needs it"),
    "data.validation_shuffle": noop("tiller validates on every prompt in file order (the scores do not depend on "
                                    "the order)"),
    "data.filter_overlong_prompts_workers": noop("tiller filters prompts in the driver"),
    "data.trust_remote_code": noop("the tokenizer is loaded with actor_rollout_ref.model.trust_remote_code"),
    "data.video_key": refused(_VIDEO, use="sample frames into the data.image_key column as images",
                              allowed=("videos",)),
    "data.image_patch_size": noop("the patch size comes from the model's image processor config "
                                  "(preprocessor_config.json), as the processor reads it"),
    "data.return_multi_modal_inputs": noop("tiller always keeps each image prompt's pixel_values / image_grid_thw on "
                                           "its samples (the actor and reference forwards need them)"),
    "data.custom_cls": refused("custom Dataset classes are not built (tiller reads parquet, jsonl and datasets "
                               "dirs)", use="convert the data to parquet / jsonl with verl's columns",
                               allowed=({"path": None, "name": None},)),
    "data.sampler": refused("custom (curriculum) samplers are not built", use="data.shuffle",
                            allowed=({"class_path": None, "class_name": None},)),
    "data.datagen": refused("dynamic data generation is not built", use="generate the prompts to a file first",
                            allowed=({"path": None, "name": None},)),
    # trainer
    "trainer.esi_redundant_time": noop("tiller has no elastic-instance (ESI) shutdown hook"),
    "trainer.default_hdfs_dir": refused("tiller does not copy checkpoints to HDFS",
                                        use="trainer.default_local_dir (on a mounted file system)", allowed=(None,)),
    "trainer.del_local_ckpt_after_load": noop("tiller keeps the checkpoint it resumed from"),
    "trainer.max_critic_ckpt_to_keep": noop("a tiller checkpoint holds actor and critic together: "
                                            "trainer.max_actor_ckpt_to_keep bounds both"),
    "trainer.ray_wait_register_center_timeout": noop("tiller has no Ray register center"),
    # other top-level sections
    "transfer_queue.enable": refused(
        "verl's TransferQueue streams batches between separate worker pools through a distributed store; tiller's "
        "driver hands each batch to its workers directly", use="leave it False", allowed=(False,)),
    "global_profiler": noop(_PROFILER),
    # verl's fully-async recipe (verl/experimental/fully_async_policy/config/fully_async_ppo_trainer.yaml)
    "async_training.use_rollout_log_probs": refused(
        "tiller's asynchronous update always takes the rollout's logprobs as the behaviour policy", use="True",
        allowed=(True,)),
    "actor_rollout_ref.actor.use_rollout_log_probs": refused(
        "tiller's asynchronous update always takes the rollout's logprobs as the behaviour policy", use="null or True",
        allowed=(None, True)),
    "async_training.compute_prox_log_prob": refused(
        "the proximal-policy logprob forward of verl's fully-async trainer is not built", use="False",
        allowed=(False,)),
    "async_training.use_trainer_do_validate": noop("tiller validates in the trainer (trainer.test_freq)"),
    "async_training.checkpoint_engine": noop(
        "tiller hands published weights over in memory (one process) or, to a Ray rollout pool, through Ray's object "
        "store (rank 0 puts them once, every rollout worker fetches them); no NCCL broadcast between pools"),
    "actor_rollout_ref.checkpoint_engine": noop("verl fully-async's copy of async_training.checkpoint_engine"),
    "rollout": noop(
        "verl fully-async's separate rollout pool {nnodes, n_gpus_per_node}: with trainer.backend=local the producer "
        "runs in the trainer's process; the rollouter's own counters {n, total_rollout_steps, total_epochs, "
        "test_freq} are not read (tiller follows actor_rollout_ref.rollout.n and trainer.total_training_steps / "
        "total_epochs / test_freq)", _ray_async,
        "asynchronous RL with trainer.backend=ray: rollout.nnodes x rollout.n_gpus_per_node workers of their own "
        "generate (verl fully-async's rollouter; tiller.trainer.rl)"),
    "ray_kwargs": noop("tiller starts Ray itself with trainer.backend=ray (trainer.ray_address joins a cluster; Ray "
                       "takes the machine's CPUs)"),
})

# ----------------------------------------------------------------- verl 0.10.0.dev's tree (verl-project/verl 1dda039b)
_SERVER = ("an inference-server setting of verl's reward loop, which serves the reward model with vLLM / SGLang; "
           "tiller's reward model is one forward pass of a sequence classifier in the driver (reward_model.*)")
_V1_ASYNC = "only with trainer.v1.trainer_mode=colocate_async / separate_async, which is refused"
RULES.update({
    "actor_rollout_ref.actor.entropy_from_logits_chunk_size": noop(_MEMORY),
    "actor_rollout_ref.ref.entropy_from_logits_chunk_size": noop(_MEMORY),
    "actor_rollout_ref.actor.pad_to_length": noop(_PADDING),
    "actor_rollout_ref.ref.pad_to_length": noop(_PADDING),
    "actor_rollout_ref.rollout.nnodes": refused(
        "a standalone rollout pool (the engine on GPUs of its own) is not built: tiller's engine runs in the actor "
        "worker, verl's hybrid engine", use="0 (the rollout shares the trainer's GPUs)", allowed=(0, None)),
    "actor_rollout_ref.rollout.n_gpus_per_node": noop("only with rollout.nnodes > 0, which is refused"),
    "actor_rollout_ref.rollout.full_determinism": noop("deterministic GPU inference kernels; tiller's CPU runs are "
                                                       "deterministic per seed"),
    "actor_rollout_ref.rollout.seed": noop("tiller seeds sampling from trainer.seed (per step and sample)"),
    "actor_rollout_ref.rollout.qat": noop("verl's copy of the actor's QAT settings (actor qat.enable is refused)"),
    "actor_rollout_ref.rollout.disaggregation": refused(
        "prefill / decode disaggregation over engine replicas is not built (tiller's engine prefills and decodes in "
        "one loop)", use="leave rollout.disaggregation at its defaults (enabled=false)",
        allowed=(_default_value("actor_rollout_ref.rollout.disaggregation"),)),
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module": noop(
        "only with a checkpoint_engine.backend other than naive, which is refused"),
    "data.audio_key": refused("tiller's vision-language path takes images only (no audio inputs)",
                              use="leave it at its default", allowed=("audios",)),
    "data.mm_processor_kwargs": refused("tiller builds the processor from the model dir's own processor config "
                                        "(preprocessor_config.json); it passes no extra processor kwargs",
                                        use="set them in the model dir's preprocessor_config.json", allowed=({},)),
    "algorithm.filter_groups.max_inflight_gen_batches": noop(
        "tiller generates a DAPO step's batches one after another (verl's default 1); the batches kept are the same"),
    # critic
    "critic.model.hf_config_path": refused(
        "tiller reads the critic's config.json from critic.model.path", use="edit that config.json",
        allowed=(None,)),
    "critic.model.custom_chat_template": noop("the critic reads the actor's token ids; it renders no chat template"),
    "critic.model.use_liger": noop("tiller runs the Hugging Face modelling code (no Liger kernels); the math is the "
                                   "same"),
    "critic.model.use_fused_kernels": noop("no fused kernels in tiller"),
    "critic.model.fused_kernel_options": noop("no fused kernels in tiller (critic.model.use_fused_kernels)"),
    # reward (verl 0.10 layout)
    "reward.reward_model.rollout": noop(_SERVER),
    "reward.sandbox_fusion": Rule(HONOURED, "verl 0.10's place of reward_model.sandbox_fusion (resolved onto it at "
                                            "load time; setting both is an error). " + _SANDBOX_FUSION),
    "sandbox_fusion": Rule(HONOURED, "verl 0.10's legacy top-level section, which verl migrates onto "
                                     "reward.sandbox_fusion (null max_concurrent / memory_limit_mb: 64 / 1024). "
                                     + _SANDBOX_FUSION),
    # distillation (verl 0.10 layout)
    "distillation.n_gpus_per_node": noop("tiller's teacher is a frozen model inside each actor worker"),
    "distillation.nnodes": noop("tiller's teacher is a frozen model inside each actor worker"),
    "distillation.teacher_models": Rule(HONOURED, "verl 0.10's named teachers: one teacher's model_path resolves onto "
                                                  "algorithm.distill.teacher_path, several onto algorithm.distill."
                                                  "teachers ({key: model_path}, each sample routed by "
                                                  "distillation.teacher_key; num_replicas and the inference server "
                                                  "settings have no effect)"),
    # trainer: verl's v1 trainer
    "trainer.use_v1": noop("tiller has one trainer; its step is verl's v1 sync mode (rollout, then update, one "
                           "policy)"),
    "trainer.v1.trainer_mode": refused(
        "verl's v1 asynchronous modes (colocate_async, separate_async) are not built as such: tiller's asynchronous "
        "RL is a producer / consumer over one policy's versions", use="sync, or async_training.staleness_threshold "
        "(tiller's async RL)", allowed=("sync",)),
    "trainer.v1.sync": noop("verl's sync mode has no options"),
    "trainer.v1.colocate_async": noop(_V1_ASYNC),
    "trainer.v1.separate_async": noop(_V1_ASYNC),
    "trainer.v1.sampler.max_off_policy_threshold": noop(_V1_ASYNC + " (tiller's bound: async_training."
                                                                    "staleness_threshold)"),
    "trainer.v1.sampler.max_off_policy_strategy": noop(_V1_ASYNC),
    "trainer.v1.sampler.sync_refill_failed_groups": noop("tiller's rollouts do not fail per group (a step trains on "
                                                         "every group it generated)"),
    "trainer.v1.sampler.custom_sampler": refused("custom replay-buffer samplers are not built", use="leave path null",
                                                 allowed=({"path": None, "name": None},)),
    "trainer.v1.sampler.sampler_kwargs": noop("only with trainer.v1.sampler.custom_sampler, which is refused"),
    **{f"actor_rollout_ref.model.{_flag}": noop(
        "read only with LoRA", lambda cfg: cfg.actor_rollout_ref.model.lora_rank > 0
        or bool(cfg.actor_rollout_ref.model.lora_adapter_path), "actor_rollout_ref.model.lora_rank > 0")
       for _flag in ("use_rslora", "use_dora", "modules_to_save", "target_parameters")},
    **{f"critic.model.{_flag}": noop(
        "read only with LoRA", lambda cfg: cfg.critic.model.lora_rank > 0 or bool(cfg.critic.model.lora_adapter_path),
        "critic.model.lora_rank > 0") for _flag in ("use_rslora", "use_dora", "modules_to_save", "target_parameters")},
    "actor_rollout_ref.ref.ref_model_sync_steps": noop(
        "read only with a reference (a KL)", lambda cfg: cfg.actor_rollout_ref.actor.use_kl_loss
        or cfg.algorithm.use_kl_in_reward, "actor.use_kl_loss or algorithm.use_kl_in_reward"),
    "actor_rollout_ref.ref.ref_model_mixup_alpha": noop(
        "read only with ref.ref_model_sync_steps and a KL", lambda cfg: bool(
            cfg.actor_rollout_ref.ref.ref_model_sync_steps) and (cfg.actor_rollout_ref.actor.use_kl_loss
                                                                 or cfg.algorithm.use_kl_in_reward),
        "ref.ref_model_sync_steps with a KL"),
    "algorithm.gdpo_normalization": noop("read by the gdpo estimator only",
                                         lambda cfg: cfg.algorithm.adv_estimator == "gdpo", "algorithm.adv_estimator=gdpo"),
    **{f"actor_rollout_ref.actor.policy_loss.vespo_{_k}": noop(
        "read by the vespo policy loss only", lambda cfg: cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "vespo",
        "actor.policy_loss.loss_mode=vespo") for _k in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")},
    "actor_rollout_ref.actor.policy_loss.tau_pos": noop("verl's SAPO reads actor.tau_pos (its sapo example sets "
                                                        "this key with +, with no effect in verl either)"),
    "actor_rollout_ref.actor.policy_loss.tau_neg": noop("verl's SAPO reads actor.tau_neg (its sapo example sets "
                                                        "this key with +, with no effect in verl either)"),
    # verl 0.10's engine switch (a config group there: dp | megatron | veomni | torchtitan)
    "model_engine": refused("tiller's training engine is FSDP2 over data-parallel ranks (verl's dp)", use="dp",
                            allowed=("dp", "fsdp")),
    "actor_rollout_ref.actor.model_engine": refused(
        "tiller's training engine is FSDP2 over data-parallel ranks (verl's dp)", use="dp (or leave it null)",
        allowed=(None, "dp", "fsdp")),
})

# deprecated key -> (successor, divided by the number of workers); converted at load time
DEPRECATED: dict[str, tuple[str, bool]] = {
    "actor_rollout_ref.actor.ppo_micro_batch_size": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", True),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size":
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", True),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", True),
    "critic.ppo_micro_batch_size": ("critic.ppo_micro_batch_size_per_gpu", True),
    "critic.forward_micro_batch_size": ("critic.forward_micro_batch_size_per_gpu", True),
    "reward_model.micro_batch_size": ("reward_model.micro_batch_size_per_gpu", True),
    "actor_rollout_ref.actor.use_token_level_loss": ("actor_rollout_ref.actor.loss_agg_mode", False),
    "actor_rollout_ref.actor.policy_loss.sapo_tau_pos": ("actor_rollout_ref.actor.tau_pos", False),
    "actor_rollout_ref.actor.policy_loss.sapo_tau_neg": ("actor_rollout_ref.actor.tau_neg", False),
}
for _key, (_successor, _) in DEPRECATED.items():
    RULES[_key] = Rule(HONOURED, f"deprecated: converted to {_successor} at load time")


_OPTIM_RULES = {  # fields of every `optim` section
    **{k: noop(_MEGATRON) for k in ("lr_decay_steps", "lr_decay_style", "lr_warmup_init", "lr_wsd_decay_steps",
                                    "lr_wsd_decay_style", "min_lr", "use_checkpoint_opt_param_scheduler",
                                    "weight_decay_incr_style", *MEGATRON_OPTIM_OPTIONS)},
}
_LORA_MEGATRON = ("dropout_position", "lora_A_init_method", "lora_B_init_method", "a2a_experimental", "dtype",
                  "freeze_vision_model", "freeze_vision_projection")


def _section_rules() -> None:
    """Class-wide states: every key of every `fsdp_config`, `rollout.trace`, `model.mtp`, `transfer_queue` and
    distillation teacher `inference` section is a no-op (its field doc says why) unless declared above; `optim` and
    role sections share their rules."""
    sections, _, keys = schema_sections(RLConfig)
    for path, cls in sections.items():
        if cls in (FSDPConfig, TraceConfig, MtpConfig, TransferQueueConfig, DistillationInferenceConfig):
            docs = _field_docs(cls)
            for f in dataclasses.fields(cls):
                if f"{path}.{f.name}" in sections:  # a nested section (fsdp_config.qat) has rules of its own
                    continue
                RULES.setdefault(f"{path}.{f.name}", noop(docs.get(f.name) or "a verl knob with no counterpart in "
                                                                              "tiller"))
        if cls is QatConfig or (cls is SkipStageConfig and path != "skip.rollout"):  # `enable` refused, the rest
            # only acts with it (skip.rollout is honoured: tiller.trainer.rollout_skip)
            what = ("quantization-aware training is not built (tiller's engines run the actor's weights unquantized)"
                    if cls is QatConfig else "replaying the dumped rollouts of verl's TransferQueue / asynchronous "
                    "trainers is not built (skip.rollout, the synchronous step's, is)")
            RULES.setdefault(f"{path}.enable", refused(what, use="leave enable False" if cls is QatConfig else
                                                       "leave enable False; skip.rollout.enable", allowed=(False,)))
            for f in dataclasses.fields(cls):
                RULES.setdefault(f"{path}.{f.name}", noop(f"only with {path}.enable, which is refused"))
        if cls is OptimConfig:
            for name, rule in _OPTIM_RULES.items():
                RULES.setdefault(f"{path}.{name}", rule)
        if cls is LoraConfig:
            for name in _LORA_MEGATRON:
                RULES.setdefault(f"{path}.{name}", noop(_MEGATRON if name != "freeze_vision_model" and
                                                         name != "freeze_vision_projection" else _LORA_VISION))
    for key in keys:
        section, _, leaf = key.rpartition(".")
        if leaf in _ROLE_DICTS and section in ROLE_SECTIONS:
            RULES.setdefault(key, _ROLE_DICTS[leaf])


ROLE_SECTIONS = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model")


def _field_docs(cls: type) -> dict[str, str]:
    """The one-line doc under each field of a schema dataclass."""
    return _module_field_docs(cls.__module__).get(cls.__qualname__, {})


@functools.lru_cache(maxsize=None)
def _module_field_docs(module: str) -> dict[str, dict[str, str]]:
    """{class qualname: {field: one-line doc}} for every class of `module`, its source parsed once (parsing it
    per class, as `inspect.getsource(cls)` does, cost every tiller command ~0.5 s at import)."""
    import ast
    import inspect

    out: dict[str, dict[str, str]] = {}

    def visit(body: list, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                name = prefix + node.name
                out.setdefault(name, _docs_under_fields(node.body))
                visit(node.body, name + ".")

    visit(ast.parse(inspect.getsource(sys.modules[module])).body, "")
    return out


def _docs_under_fields(body: list) -> dict[str, str]:
    import ast

    out = {}
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.AnnAssign) and i + 1 < len(body) and isinstance(body[i + 1], ast.Expr):
            value = body[i + 1].value  # type: ignore[attr-defined]
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out[stmt.target.id] = " ".join(value.value.split())  # type: ignore[union-attr]
    return out


_section_rules()

# verl 0.8+ layout key -> the legacy key tiller resolves it onto (verl's own migration, in reverse)
LAYOUT_ALIASES: dict[str, str] = {
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.reward_kwargs": "reward_model.reward_kwargs",
    "reward.num_workers": "reward_model.num_workers",
    "reward.reward_model.enable_resource_pool": "reward_model.enable_resource_pool",
    "reward.reward_model.n_gpus_per_node": "reward_model.n_gpus_per_node",
    "reward.reward_model.nnodes": "reward_model.nnodes",
    "actor_rollout_ref.model.lora.rank": "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.model.lora.alpha": "actor_rollout_ref.model.lora_alpha",
    "actor_rollout_ref.model.lora.target_modules": "actor_rollout_ref.model.target_modules",
    "actor_rollout_ref.model.lora.adapter_path": "actor_rollout_ref.model.lora_adapter_path",
    "actor_rollout_ref.model.lora.exclude_modules": "actor_rollout_ref.model.exclude_modules",
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size":
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size":
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
    "critic.model.fsdp_config.ulysses_sequence_parallel_size": "critic.ulysses_sequence_parallel_size",
    "critic.fsdp.ulysses_sequence_parallel_size": "critic.ulysses_sequence_parallel_size",  # (verl 0.10's engine key)
    "reward_model.model.fsdp_config.ulysses_sequence_parallel_size": "reward_model.ulysses_sequence_parallel_size",
    "reward.sandbox_fusion": "reward_model.sandbox_fusion",
    "sandbox_fusion": "reward_model.sandbox_fusion",  # verl 0.10 migrates it onto reward.sandbox_fusion
}
LAYOUT_ALIASES.update({  # verl 0.6 / 0.7 renames
    "data.train_max_samples": "data.max_samples",
    "data.tool_config_path": "actor_rollout_ref.rollout.multi_turn.tool_config_path",
    "data.function_tool_path": "actor_rollout_ref.rollout.multi_turn.function_tool_path",
    "reward_manager.name": "reward_model.reward_manager",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "actor_rollout_ref.actor.optim.warmup_style",
    "critic.optim.lr_scheduler_type": "critic.optim.warmup_style",
    "actor_rollout_ref.actor.optim.clip_grad": "actor_rollout_ref.actor.grad_clip",
    "critic.optim.clip_grad": "critic.grad_clip",
})
for _f in ("path", "name", "reward_kwargs", "overlong_buffer.enable", "overlong_buffer.len",
           "overlong_buffer.penalty_factor", "overlong_buffer.log"):
    LAYOUT_ALIASES[f"reward.custom_reward_function.{_f}"] = f"custom_reward_function.{_f}"
# verl's on-policy distillation section -> tiller's algorithm.distill (resolved by `_resolve_distillation`)
DISTILLATION_ALIASES: dict[str, str] = {
    "distillation.teacher_model.model_path": "algorithm.distill.teacher_path",
    "distillation.teacher_key": "algorithm.distill.teacher_key",
    "distillation.distillation_loss.loss_mode": "algorithm.distill.loss_mode",
    "distillation.distillation_loss.use_task_rewards": "algorithm.distill.use_outcome_reward",
    "distillation.distillation_loss.distillation_loss_coef": "algorithm.distill.coef",
    "distillation.distillation_loss.task_loss_coef": "algorithm.distill.outcome_coef",
    "distillation.distillation_loss.loss_max_clamp": "algorithm.distill.loss_max_clamp",
    "distillation.distillation_loss.use_policy_gradient": "algorithm.distill.use_policy_gradient",
    "distillation.distillation_loss.clip_ratio_low": "algorithm.distill.clip_ratio_low",
    "distillation.distillation_loss.clip_ratio_high": "algorithm.distill.clip_ratio_high",
}
for _new, _old in DISTILLATION_ALIASES.items():
    RULES[_new] = Rule(HONOURED, f"verl's distillation layout: resolved onto {_old} when distillation.enabled "
                                 "(verl's default when unset)")
for _key in ("distillation.enabled", "distillation.enable"):
    RULES[_key] = Rule(HONOURED, "verl's on-policy distillation on: its section resolves onto algorithm.distill.*")
for _new, _old in LAYOUT_ALIASES.items():
    _rule = Rule(HONOURED, f"verl 0.8+ layout: the same setting as {_old} (resolved onto it at load time; setting "
                           "both is an error)")
    if _new.endswith(".ulysses_sequence_parallel_size"):  # the key verl's engines read: its target's state
        _target = RULES[_old]
        _why = _target.reason[:1].upper() + _target.reason[1:]
        RULES[_new] = replace(_target, reason=f"verl 0.8+ layout: the same setting as {_old} (resolved onto it at "
                                              f"load time; a value > 1 on both is an error). {_why}")
    else:
        RULES.setdefault(_new, _rule)


# values refused on a key that is otherwise honoured: key -> (values, reason, what to use)
_MEGATRON_REFUSAL = ("Megatron-Core (tensor / pipeline / expert / context parallelism, verl's ppo_megatron_trainer) "
                     "is not built in tiller: its workers shard with FSDP2 over data-parallel ranks",
                     "strategy=fsdp (or fsdp2) and drop the megatron.* keys")
REFUSED_VALUES: dict[str, tuple[tuple, str, str]] = {
    key: (("megatron",), *_MEGATRON_REFUSAL)
    for key in ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy", "critic.strategy",
                "reward_model.strategy")
}
REFUSED_VALUES["trainer.device"] = (("npu",), "tiller runs on CPU and CUDA (no Ascend NPU backend)", "cpu or cuda")
# verl 0.10 picks the training engine with the config group `model_engine` (dp = FSDP, its default)
_ENGINES = {"megatron": _MEGATRON_REFUSAL,
            "veomni": ("VeOmni (verl's model_engine=veomni: ByteDance's model-parallel training engine) is not built in "
                       "tiller: its workers shard with FSDP2 over data-parallel ranks", "model_engine=dp (FSDP, verl's "
                       "default) and drop the veomni.* keys"),
            "torchtitan": ("TorchTitan (verl's model_engine=torchtitan) is not built in tiller: its workers shard with "
                           "FSDP2 over data-parallel ranks", "model_engine=dp (FSDP, verl's default)")}
for _key in ("model_engine", "actor_rollout_ref.actor.model_engine"):
    REFUSED_VALUES[_key] = (tuple(_ENGINES), "; ".join(f"{k}: {v[0]}" for k, v in _ENGINES.items()),
                            _ENGINES["veomni"][1].split(" and ")[0])
#: keys whose refused value makes the rest of a launch script moot: a command line stops on them before any other
#: key is checked (a Megatron script's megatron.* keys would otherwise be reported as unknown first)
ENGINE_KEYS = ("model_engine", "actor_rollout_ref.actor.model_engine", "actor_rollout_ref.actor.strategy",
               "actor_rollout_ref.ref.strategy", "critic.strategy", "reward_model.strategy", "trainer.device")


def refuse_engines_first(items: list[tuple[str, Any]]) -> None:
    """(key, value) pairs of a command line: ConfigError for a refused engine / device, named by key and reason."""
    for key, value in items:
        if key in ENGINE_KEYS and value in REFUSED_VALUES[key][0]:
            values, reason, use = REFUSED_VALUES[key]
            if key.endswith("model_engine") and value in _ENGINES:
                reason, use = _ENGINES[value]
            raise ConfigError(f"{key}={value!r} is refused: {reason}. Instead: {use}")
REFUSED_VALUES["actor_rollout_ref.rollout.name"] = (
    ("sglang", "trtllm"), "tiller's rollout engines are native, hf and vllm (SGLang and TensorRT-LLM servers are not "
                          "built)", "rollout.name=vllm (the same sampling) or native")


# ------------------------------------------------------------------------------------------ access
def get(cfg: Any, path: str) -> Any:
    node = cfg
    for part in path.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def _set(cfg: Any, path: str, value: Any) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(get(cfg, parent) if parent else cfg, leaf, value)


def _default(path: str) -> Any:
    return get(RLConfig(), path)


def _given(cfg: RLConfig, path: str) -> bool:
    """Did the user set `path`? (for a config not from `load_config`: differs from the default)"""
    keys = given_keys(cfg)
    if keys is None:
        return get(cfg, path) != _default(path)
    return path in keys


def given_under(cfg: RLConfig, path: str) -> bool:
    """`path` or, for an open-ended mapping, a key inside it was set by the user."""
    keys = given_keys(cfg)
    if keys is None:
        return get(cfg, path) != _default(path)
    return any(k == path or k.startswith(path + ".") for k in keys)


# ------------------------------------------------------------------------------------ at load time
def apply_edge(cfg: RLConfig) -> None:
    """Resolve verl's two layouts, convert deprecated keys, resolve keys that follow another key, raise on refused
    values."""
    for path, (values, reason, use) in REFUSED_VALUES.items():
        if get(cfg, path) in values:
            raise ConfigError(f"{path}={get(cfg, path)!r} is refused: {reason}. Instead: {use}")
    _resolve_distillation(cfg)
    _check_sandbox_fusion(cfg)
    _resolve_layouts(cfg)
    _fill_sandbox_fusion(cfg)
    _resolve_engine_kwargs(cfg)
    _convert_deprecated(cfg)
    for key in NULL_IS_DEFAULT:  # verl's null = unset: tiller's default
        if get(cfg, key) is None:
            _set(cfg, key, _default(key))
    _resolve_followers(cfg)
    _resolve_dtypes(cfg)
    _scale_ulysses_budgets(cfg)
    for path, rule in RULES.items():
        if rule.state != REFUSED:
            continue
        value = get(cfg, path)
        if value != _default(path) and value not in rule.allowed:
            raise ConfigError(f"{path}={value!r} is refused: {rule.reason}. Instead: {rule.use}")
    _check_copies(cfg)


def _check_copies(cfg: RLConfig) -> None:
    """verl's copies of another key (`rollout_n`, `ref.strategy`, `critic.enable`): null or consistent."""
    arr = cfg.actor_rollout_ref
    n = arr.rollout.n
    for key, value in (("actor_rollout_ref.actor.rollout_n", arr.actor.rollout_n),
                       ("actor_rollout_ref.ref.rollout_n", arr.ref.rollout_n), ("critic.rollout_n", cfg.critic.rollout_n)):
        if value is not None and value != n:
            raise ConfigError(f"{key}={value} differs from actor_rollout_ref.rollout.n={n}: it is verl's copy of "
                              "rollout.n; drop it or give both the same value")
    if arr.ref.strategy is not None and arr.ref.strategy != arr.actor.strategy:
        raise ConfigError(f"actor_rollout_ref.ref.strategy={arr.ref.strategy!r} differs from actor_rollout_ref.actor."
                          f"strategy={arr.actor.strategy!r}: tiller's reference runs in the actor's worker, with the "
                          "actor's strategy; drop it")
    gae = cfg.algorithm.adv_estimator == "gae"
    if cfg.critic.enable is not None and cfg.critic.enable != gae:
        raise ConfigError(f"critic.enable={cfg.critic.enable} but algorithm.adv_estimator={cfg.algorithm.adv_estimator}"
                          f": tiller trains a critic exactly when the estimator is gae; drop critic.enable")


def _resolve_layouts(cfg: RLConfig) -> None:
    """verl 0.8+ keys (`reward.*`, `model.lora.*`, `fsdp_config.ulysses_sequence_parallel_size`) onto the legacy
    keys tiller reads; the new-layout key goes back to its default so `tiller config show` prints one config."""
    set_by: dict[str, str] = {}
    lora_on = bool(cfg.actor_rollout_ref.model.lora.rank or cfg.actor_rollout_ref.model.lora.adapter_path)
    for new, old in LAYOUT_ALIASES.items():
        if not given_under(cfg, new) or get(cfg, new) == _default(new):
            continue  # (at its default it says nothing: e.g. a config file written by `tiller config show`)
        if new.startswith("actor_rollout_ref.model.lora.") and not lora_on:
            continue  # verl 0.10's tree carries model.lora (Megatron's LoRA, alpha 32) at rank 0: LoRA off says nothing
        unset = (None,)
        if new.endswith(".ulysses_sequence_parallel_size"):  # verl: 1 on either key is "no split" (the section's
            unset = (None, 1)  # value > 1 is copied onto the engine's), so a verl tree's 1s say nothing
            if get(cfg, new) == 1:
                _set(cfg, new, _default(new))
                continue
        if (given_under(cfg, old) and get(cfg, old) not in (*unset, get(cfg, new))) or old in set_by:
            raise ConfigError(f"{new} and {set_by.get(old, old)} are the same setting (verl's newer and older "
                              "layouts): set one of them")
        _set(cfg, old, get(cfg, new))
        _set(cfg, new, _default(new))
        set_by[old] = new


SANDBOX_FUSION_KEYS = ("reward_model.sandbox_fusion", "reward.sandbox_fusion", "sandbox_fusion")
SANDBOX_FUSION_DEFAULTS = {"url": None, "max_concurrent": 64, "memory_limit_mb": 1024}


def _check_sandbox_fusion(cfg: RLConfig) -> None:
    """Each SandboxFusion section the user set, checked under its own key: known fields, an http(s) url, counts > 0."""
    from urllib.parse import urlsplit

    for key in SANDBOX_FUSION_KEYS:
        section = get(cfg, key)
        if section == _default(key):
            continue
        unknown = sorted(set(section) - set(SANDBOX_FUSION_DEFAULTS))
        if unknown:
            raise ConfigError(f"{key}: unknown keys {unknown}; valid: {', '.join(SANDBOX_FUSION_DEFAULTS)}")
        url = section.get("url")
        if url is not None:
            parts = urlsplit(url) if isinstance(url, str) else None
            if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(f"{key}.url must be a SandboxFusion endpoint http(s)://HOST:PORT/run_code (or null), "
                                  f"got {url!r}")
        for field in ("max_concurrent", "memory_limit_mb"):
            value = section.get(field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"{key}.{field} must be a whole number > 0 (or null: "
                                  f"{SANDBOX_FUSION_DEFAULTS[field]}), got {value!r}")


def _fill_sandbox_fusion(cfg: RLConfig) -> None:
    """The resolved reward_model.sandbox_fusion with verl's defaults where a field is null or absent."""
    section = cfg.reward_model.sandbox_fusion
    for field, value in SANDBOX_FUSION_DEFAULTS.items():
        if section.get(field) is None:
            section[field] = value


ENGINE_KWARGS_SECTIONS = ("vllm", "sglang", "trtllm")
# keys whose verl default is null ("not set"); null here means tiller's default (a verl YAML file loads as written)
NULL_IS_DEFAULT = ("actor_rollout_ref.actor.optim.warmup_style", "critic.optim.warmup_style",
                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                   "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                   "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                   "actor_rollout_ref.rollout.multi_turn.max_assistant_turns", "data.seed",
                   "reward_model.micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu",
                   "critic.forward_micro_batch_size_per_gpu",
                   # verl 0.10 keeps the legacy reward keys in its tree as null (unset: the reward.* layout decides)
                   "custom_reward_function.name", "reward_model.num_workers", "reward_model.reward_manager",
                   "reward_model.enable", "reward_model.enable_resource_pool", "reward_model.n_gpus_per_node",
                   "reward_model.nnodes", "reward_model.reward_loop_source", "reward_model.model.trust_remote_code",
                   "algorithm.filter_groups.metric")


def _resolve_engine_kwargs(cfg: RLConfig) -> None:
    """verl nests rollout.engine_kwargs by engine (`engine_kwargs.vllm.X`); tiller passes engine_kwargs flat to the
    engine it runs: the vllm part is merged in with rollout.name=vllm, the parts of other engines are dropped with one
    line saying so."""
    rollout = cfg.actor_rollout_ref.rollout
    kw = rollout.engine_kwargs
    nested = {k: kw.pop(k) for k in ENGINE_KWARGS_SECTIONS if isinstance(kw.get(k), dict)}
    mine = nested.pop("vllm", None) if rollout.name == "vllm" else None
    for key, value in (mine or {}).items():
        if key in kw:
            raise ConfigError(f"actor_rollout_ref.rollout.engine_kwargs.{key} and engine_kwargs.vllm.{key} are the same "
                              "setting: set one of them")
        kw[key] = value
    dropped = [f"engine_kwargs.{k}" for k, v in nested.items() if v]
    if dropped:
        print(f"tiller: actor_rollout_ref.rollout.{', '.join(dropped)} configure an engine this run does not use "
              f"(rollout.name={rollout.name}): no effect", file=sys.stderr)


def _resolve_distillation(cfg: RLConfig) -> None:
    """verl's `distillation.*` onto `algorithm.distill.*`: with distillation.enabled, every aliased key (given or at
    verl's default) is copied and goes back to its default, as does `enabled`. Decided by values, not by the keys
    given, so a second pass is a no-op."""
    section = cfg.distillation
    on = section.enabled or bool(section.enable)
    teachers = _fold_teacher_models(cfg, on)
    changed = [k for k in DISTILLATION_ALIASES if get(cfg, k) != _default(k)]
    if not on:
        if changed:
            raise ConfigError(f"{changed[0]} is set but distillation.enabled is false: set distillation.enabled=true "
                              "(verl's layout) or use algorithm.distill.* (tiller's)")
        return
    native = [f"algorithm.distill.{f.name}" for f in dataclasses.fields(cfg.algorithm.distill)]
    both = [k for k in native if get(cfg, k) != _default(k)]
    if both:
        raise ConfigError(f"distillation.enabled=true (verl's layout) and {both[0]} (tiller's) are both set: use one "
                          "layout (distillation.* resolves onto algorithm.distill.*)")
    if not section.teacher_model.model_path and not teachers:
        raise ConfigError("distillation.enabled=true needs distillation.teacher_model.model_path (the teacher's "
                          "Hugging Face model dir)")
    mode = section.distillation_loss.loss_mode
    if mode.endswith("_topk"):
        raise ConfigError(f"distillation.distillation_loss.loss_mode={mode} is refused: tiller's teacher returns "
                          "no top-k distributions. Instead: k1 with use_policy_gradient=true, or k3 / k2, or "
                          "tiller's full-vocabulary algorithm.distill.loss_mode=gjsd (beta=0: the forward KL over "
                          "the whole vocabulary)")
    if mode == "gjsd":
        raise ConfigError("distillation.distillation_loss.loss_mode=gjsd is tiller's loss, not verl's: set it in "
                          "tiller's layout (algorithm.distill.loss_mode=gjsd, algorithm.distill.beta, "
                          "algorithm.distill.teacher_path)")
    rule = RULES["distillation.distillation_loss.policy_loss_mode"]
    if section.distillation_loss.policy_loss_mode not in rule.allowed:
        raise ConfigError(f"distillation.distillation_loss.policy_loss_mode="
                          f"{section.distillation_loss.policy_loss_mode!r} is refused: {rule.reason}. "
                          f"Instead: {rule.use}")
    for new, old in DISTILLATION_ALIASES.items():
        _set(cfg, old, get(cfg, new))
        _set(cfg, new, _default(new))
    cfg.algorithm.distill.log_prob_min_clamp = None  # verl's estimators clamp no log-prob (see RULES)
    cfg.algorithm.distill.teachers = teachers
    section.enabled, section.enable = False, None  # the no-op keys keep their values (the start-up line names them)


def _fold_teacher_models(cfg: RLConfig, on: bool) -> dict[str, str]:
    """verl 0.10's `distillation.teacher_models` {name: {key, model_path, num_replicas, inference}}: one teacher's
    model_path becomes distillation.teacher_model.model_path (then the section goes back to its default); several
    teachers are returned as {key: model_path} (algorithm.distill.teachers, routed by teacher_key), each with its own
    key. verl drops the default `teacher_model` entry when others are named, whatever it holds: here a
    `teacher_model` with a model_path beside others is an error, not silently dropped."""
    section = cfg.distillation
    teachers = {name: t for name, t in section.teacher_models.items() if isinstance(t, dict) and t.get("model_path")}
    if not teachers:
        return {}
    if len(teachers) > 1:
        if not on:
            raise ConfigError(f"distillation.teacher_models has {len(teachers)} teachers but distillation.enabled is "
                              "false: set distillation.enabled=true")
        if "teacher_model" in teachers:
            raise ConfigError("distillation.teacher_models.teacher_model.model_path is set beside other teachers "
                              f"({', '.join(n for n in teachers if n != 'teacher_model')}): verl drops the "
                              "teacher_model entry when others are named (its documented pitfall); give that teacher "
                              "another name (+distillation.teacher_models.teacher_model1.key=... / .model_path=...)")
        routed: dict[str, str] = {}
        for name, teacher in teachers.items():
            key = teacher.get("key")
            if key in (None, ""):
                raise ConfigError(f"distillation.teacher_models.{name}.key is not set: with several teachers each "
                                  f"needs the value of distillation.teacher_key ({section.teacher_key}) it scores")
            if str(key) in routed:
                raise ConfigError(f"distillation.teacher_models.{name}.key={key!r}: another teacher has that key")
            routed[str(key)] = str(teacher["model_path"])
        if cfg.algorithm.distill.teachers:
            raise ConfigError("distillation.teacher_models and algorithm.distill.teachers are both set (verl's layout "
                              "and tiller's): use one")
        section.teacher_models = _default("distillation.teacher_models")
        return routed
    (name, teacher), = teachers.items()
    key = f"distillation.teacher_models.{name}.model_path"
    if not on:
        raise ConfigError(f"{key} is set but distillation.enabled is false: set distillation.enabled=true")
    if section.teacher_model.model_path not in (None, teacher["model_path"]):
        raise ConfigError(f"{key} and distillation.teacher_model.model_path are both set (verl 0.10's layout and the "
                          "one before): use one")
    section.teacher_model.model_path = teacher["model_path"]
    section.teacher_models = _default("distillation.teacher_models")
    return {}


def _convert_deprecated(cfg: RLConfig) -> None:
    workers = num_workers(cfg)
    for old, (new, divide) in DEPRECATED.items():
        value = get(cfg, old)
        if value is None:
            continue
        if _given(cfg, new) and get(cfg, new) is not None:
            raise ConfigError(f"{old} and {new} are both set: remove {old} (deprecated in verl; {new} is the one "
                              "tiller reads)")
        if old.endswith("use_token_level_loss"):
            converted: Any = "token-mean" if value else "seq-mean-token-mean"
            how = f"{new}={converted}"
        elif not divide:  # a renamed key: the same value under verl's current name
            converted, how = value, f"the older name of {new}"
        else:
            if value % workers or value < workers:
                raise ConfigError(f"{old}={value} is a global size (deprecated in verl): it must be a multiple of "
                                  f"the {workers} workers; or set {new} (per worker)")
            converted = value // workers
            how = f"a global size over {workers} worker{'s' * (workers > 1)}: {new}={converted}"
        _set(cfg, new, converted)
        if old == "critic.ppo_micro_batch_size" and cfg.critic.forward_micro_batch_size is None \
                and not _given(cfg, "critic.forward_micro_batch_size_per_gpu"):
            cfg.critic.forward_micro_batch_size_per_gpu = converted  # verl: forward follows ppo's
        print(f"tiller: {old}={value} is deprecated (verl): {how}", file=sys.stderr)


def _resolve_followers(cfg: RLConfig) -> None:
    """Keys whose None means "the value of another key", as verl's `${...}` defaults."""
    arr, critic, rm = cfg.actor_rollout_ref, cfg.critic, cfg.reward_model
    actor = arr.actor
    for section in (arr.ref, arr.rollout):
        if section.log_prob_use_dynamic_bsz is None:
            section.log_prob_use_dynamic_bsz = actor.use_dynamic_bsz
        if section.log_prob_max_token_len_per_gpu is None:
            section.log_prob_max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    if critic.use_dynamic_bsz is None:
        critic.use_dynamic_bsz = actor.use_dynamic_bsz
    if critic.loss_agg_mode is None:  # verl: ${oc.select:actor_rollout_ref.actor.loss_agg_mode,token-mean}
        critic.loss_agg_mode = actor.loss_agg_mode
    if critic.loss_scale_factor is None:  # verl: ${oc.select:actor_rollout_ref.actor.loss_scale_factor,null}
        critic.loss_scale_factor = actor.loss_scale_factor
    if critic.forward_max_token_len_per_gpu is None:
        critic.forward_max_token_len_per_gpu = critic.ppo_max_token_len_per_gpu
    if rm.use_dynamic_bsz is None:
        rm.use_dynamic_bsz = critic.use_dynamic_bsz
    if rm.forward_max_token_len_per_gpu is None:
        rm.forward_max_token_len_per_gpu = critic.forward_max_token_len_per_gpu
    at = cfg.async_training
    if cfg.data.train_batch_size == 0 and at.require_batches:  # verl fully-async's layout: the trainer streams
        n = at.require_batches * actor.ppo_mini_batch_size
        print(f"tiller: data.train_batch_size=0 with async_training.require_batches={at.require_batches} is verl "
              f"fully-async's layout: a step takes require_batches x ppo_mini_batch_size = {n} prompts, which tiller "
              f"generates as one batch: data.train_batch_size={n}"
              + (", data.gen_batch_size follows it" if cfg.data.gen_batch_size not in (None, n) else ""),
              file=sys.stderr)
        cfg.data.train_batch_size = n
        cfg.data.gen_batch_size = None  # verl's rollouter streams prompts one by one; tiller's producer by step batch
    if cfg.data.gen_batch_size is None:
        cfg.data.gen_batch_size = cfg.data.train_batch_size


_MP_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
_MP_KEYS = ("param_dtype", "reduce_dtype", "buffer_dtype")


def _resolve_dtypes(cfg: RLConfig) -> None:
    """The actor's and the critic's compute dtype where the user left it unset, as verl's FSDP workers choose it:
    their `fsdp_config.mixed_precision.param_dtype` when given, else bf16 on a GPU (verl's default mixed precision:
    bf16 compute, fp32 master weights and gradient reduction) and fp32 on a CPU (bf16 there is slow or emulated on
    many hosts). A param_dtype that contradicts a given dtype, fp16, or a key verl does not have is refused by name;
    reduce / buffer dtypes other than fp32 are said to have no effect."""
    roles = (("actor_rollout_ref.actor.dtype", ("actor_rollout_ref.actor.fsdp_config.mixed_precision",)),
             ("critic.dtype", ("critic.model.fsdp_config.mixed_precision", "critic.fsdp.mixed_precision")))
    for dtype_key, mp_keys in roles:
        from_mp = None
        for mp_key in mp_keys:
            mp = dict(get(cfg, mp_key) or {})
            unknown = sorted(set(mp) - set(_MP_KEYS))
            if unknown:
                raise ConfigError(f"{mp_key}.{unknown[0]}: not a mixed-precision key (verl's: {', '.join(_MP_KEYS)})")
            for name in ("reduce_dtype", "buffer_dtype"):  # (verl's Qwen3-Next example reduces in bf16: loads)
                if name in mp and _MP_DTYPES.get(str(mp[name]).lower()) != "float32":
                    print(f"tiller: accepted with no effect here: {mp_key}.{name}={mp[name]!r} (tiller reduces "
                          "gradients and keeps buffers in fp32)", file=sys.stderr)
            if mp.get("param_dtype") is not None:
                value = _MP_DTYPES.get(str(mp["param_dtype"]).lower())
                if value is None:
                    raise ConfigError(f"{mp_key}.param_dtype={mp['param_dtype']!r}: tiller computes in bf16 or fp32 "
                                      "(fp16 has no loss scaling here); give bf16 or fp32")
                if from_mp is not None and value != from_mp:
                    raise ConfigError(f"{mp_key}.param_dtype={mp['param_dtype']!r} differs from the other "
                                      f"mixed_precision section of {dtype_key.rpartition('.')[0]}; give one")
                from_mp = value
        if _given(cfg, dtype_key):
            given = _MP_DTYPES.get(str(get(cfg, dtype_key)).lower(), get(cfg, dtype_key))
            if from_mp is not None and given != from_mp:
                raise ConfigError(f"{dtype_key}={get(cfg, dtype_key)!r} contradicts its fsdp_config.mixed_precision."
                                  f"param_dtype ({from_mp}); give one of the two")
            continue
        _set(cfg, dtype_key, from_mp or ("bfloat16" if cfg.trainer.device == "cuda" else "float32"))


# token budget -> the Ulysses size of the worker that spends it (verl: max_token_len = budget x sp size)
ULYSSES_BUDGETS = {
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu":
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
    "critic.ppo_max_token_len_per_gpu": "critic.ulysses_sequence_parallel_size",
    "critic.forward_max_token_len_per_gpu": "critic.ulysses_sequence_parallel_size",
    "reward_model.forward_max_token_len_per_gpu": "reward_model.ulysses_sequence_parallel_size",
}


FOLDED_ATTR = "_tiller_folded_ulysses"
# the Ulysses sizes whose workers split sequences (tiller.workers.ulysses) with trainer.backend=ray and several workers
LIVE_ULYSSES = ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size")


def _scale_ulysses_budgets(cfg: RLConfig) -> None:
    """verl splits each sequence over `ulysses_sequence_parallel_size` GPUs and packs dynamic micro-batches of budget x
    sp tokens; where tiller runs whole sequences on one worker (one process; the reference's, the critic's and the
    reward model's sizes), its budget is that product (one line says so). The actor's and the critic's sizes with
    trainer.backend=ray and several workers split sequences for real (`tiller.workers.ulysses`): they stay, and the
    workers multiply their budgets by them, as verl's do. Folded sizes are 1 in the resolved config (folded into the
    budgets: `tiller config show`'s output loads back unchanged); the start-up no-op line still names the values
    given."""
    folded = {}
    live = LIVE_ULYSSES if _several_workers(cfg) else ()  # split for real: the worker multiplies its budgets
    for budget, sp_key in ULYSSES_BUDGETS.items():
        sp = get(cfg, sp_key) or 1
        if sp > 1 and sp_key not in live:
            value = get(cfg, budget)
            _set(cfg, budget, value * sp)
            folded[sp_key] = sp
            print(f"tiller: {budget}={value} is verl's per-GPU share with {sp_key}={sp}; tiller runs whole sequences "
                  f"per worker, so a micro-batch holds {value} x {sp} = {value * sp} tokens (memory is not split)",
                  file=sys.stderr)
    for sp_key in folded:
        _set(cfg, sp_key, 1)
    if folded:
        object.__setattr__(cfg, FOLDED_ATTR, folded)


# ------------------------------------------------------------------------------------- at start-up
def noop_keys(cfg: RLConfig) -> list[str]:
    """The no-op keys the user set (and whose condition, if any, does not hold), as `key=value`."""
    out = []
    for path, rule in RULES.items():
        if rule.state != NOOP or not given_under(cfg, path):
            continue
        if rule.honoured_if is not None and rule.honoured_if(cfg):
            continue
        shown = LAYOUT_ALIASES.get(path, path)  # a newer-layout key shows the value it resolved onto
        out.append(f"{path}={getattr(cfg, FOLDED_ATTR, {}).get(shown, get(cfg, shown))!r}")
    return out


def noop_line(cfg: RLConfig) -> str | None:
    """One start-up line naming the no-op keys the user set, or None."""
    keys = noop_keys(cfg)
    if not keys:
        return None
    return (f"tiller: accepted with no effect here (`tiller config keys` says why): {', '.join(keys)}")


def report_noop_keys(cfg: RLConfig, stream=None) -> None:
    line = noop_line(cfg)
    if line:
        print(line, file=stream or sys.stderr)


# ------------------------------------------------------------------------------------------- table
@dataclass(frozen=True)
class KeyState:
    key: str
    state: str
    note: str  # honoured: what the key does; otherwise the reason (and the condition / what to use)
    readers: tuple[str, ...] = ()  # package files that read it


def key_states() -> list[KeyState]:
    """Every key of the RL schema with its state; raises if a key has no reader and no declared state, or
    a declared unconditional no-op / refusal has a reader (the two would disagree)."""
    sections, _, keys = schema_sections(RLConfig)
    reads = config_reads(RLConfig)
    docs = _key_docs()
    out, problems = [], []
    for key in sorted(k for k in keys if k not in sections):
        rule, readers = RULES.get(key), tuple(sorted({r.split(":")[0] for r in reads.get(key, ())}))
        if rule is None:
            if not readers:
                problems.append(f"{key}: no reader in the package and no declared state (tiller.config.edge.RULES)")
            out.append(KeyState(key, HONOURED, docs.get(key, ""), readers))
        elif rule.state == HONOURED:
            out.append(KeyState(key, HONOURED, rule.reason, readers))
        elif rule.honoured_if is not None:
            if not readers and key not in LAYOUT_ALIASES:  # (an alias is read as its target)
                problems.append(f"{key}: declared honoured when {rule.condition}, but nothing reads it")
            out.append(KeyState(key, NOOP, f"honoured when {rule.condition}; otherwise a no-op: {rule.reason}",
                                readers))
        else:
            if readers:
                problems.append(f"{key}: declared {rule.state} but read in {', '.join(readers)}")
            note = rule.reason + (f"; accepted: {', '.join(repr(v) for v in rule.allowed)}; instead: {rule.use}"
                                  if rule.state == REFUSED else "")
            out.append(KeyState(key, rule.state, note))
    if problems:
        raise AssertionError("the verl edge is out of date:\n  " + "\n  ".join(problems))
    for i, k in enumerate(out):
        if k.key in REFUSED_VALUES:
            values, reason, use = REFUSED_VALUES[k.key]
            out[i] = dataclasses.replace(k, note=f"{k.note} Refused: {', '.join(map(repr, values))} ({reason}; "
                                                 f"instead: {use}).")
    return out


#: the verl trees whose every key path has a state here (stored under tests/data/verl_examples/)
VERL_TREES = ("volcengine/verl b178a3cd (2026-01-29, 0.8.0.dev) and verl-project/verl 1dda039b (2026-08-22, "
              "0.10.0.dev)")


def markdown() -> str:
    """`docs/verl-keys.md`: the state of every key."""
    states = key_states()
    counts = {s: sum(k.state == s for k in states) for s in (HONOURED, NOOP, REFUSED)}
    lines = [
        "# verl's keys in tiller",
        "",
        "Generated by `tiller config keys --markdown` from `tiller/config/edge.py`, the schema's field docs and "
        "a scan of the package for the code that reads each key (`tiller config keys` names the files); "
        "`tests/test_verl_edge.py` fails when this file is out of date.",
        "",
        "Every key of the RL config is in one of three states: **honoured** (tiller does what verl does with "
        "it), **no-op** (accepted; it tunes machinery tiller does differently, and one line at start-up "
        "lists the no-op keys you set) or **refused** (an error at load time, unless it has an accepted "
        "value). Deprecated verl keys are converted at load time with one deprecation line.",
        "",
        f"Checked against verl's generated config trees at {VERL_TREES}: every key path of their "
        "`_generated_ppo_trainer.yaml` and `_generated_ppo_megatron_trainer.yaml` is a key of this table or inside a "
        "section it declares whole (`tests/test_verl_examples.py`).",
        "",
        f"{counts[HONOURED]} honoured, {counts[NOOP]} no-op (some honoured under a condition), "
        f"{counts[REFUSED]} refused.",
        "",
        "| key | state | why / where |",
        "|---|---|---|",
    ]
    for k in states:  # (the readers are left out: `tiller config keys` names them)
        lines.append(f"| `{k.key}` | {k.state} | {k.note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _key_docs() -> dict[str, str]:
    """Every key's one-line schema doc."""
    sections, _, _ = schema_sections(RLConfig)
    out = {}
    for path, cls in sections.items():
        for name, doc in _field_docs(cls).items():
            out[f"{path}.{name}" if path else name] = doc
    return out


__all__ = ["RULES", "DEPRECATED", "REFUSED_VALUES", "LAYOUT_ALIASES", "Rule", "KeyState", "apply_edge", "async_enabled", "noop_keys", "noop_line",
           "report_noop_keys", "key_states", "markdown", "num_workers", "HONOURED", "NOOP", "REFUSED"]
