"""The sections verl 0.10 added to its config tree (verl-project/verl 1dda039b, 2026-08-22, 0.10.0.dev).

Typed like the rest of `tiller.config.schema` (which imports these), with verl's defaults, so a verl 0.10 script or
its whole `_generated_ppo_trainer.yaml` loads; `tiller.config.edge` gives each key its state (honoured, refused with
a reason, or a declared no-op). Kept apart from `schema.py` only for size: nothing here imports tiller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class QatConfig:
    """verl's quantization-aware training (`<role>.qat`, `<role>.fsdp_config.qat`): fake-quantized linears in the
    update so the rollout can run quantized weights. Not built in tiller (its engines run unquantized weights)."""

    enable: bool = False
    """Refused: quantization-aware training is not built in tiller."""
    mode: str = "w4a16"
    """verl: the QAT scheme (only with qat.enable, which is refused)."""
    group_size: int = 16
    """verl: the quantization group size (only with qat.enable, which is refused)."""
    ignore_patterns: list[str] = field(default_factory=lambda: ["lm_head", "embed_tokens", "re:.*mlp.gate$"])
    """verl: modules left unquantized (only with qat.enable, which is refused)."""
    activation_observer: str = "static_minmax"
    """verl: the activation observer (only with qat.enable, which is refused)."""
    quantization_config_path: Optional[str] = None
    """verl: a quantization config file (only with qat.enable, which is refused)."""


@dataclass
class SkipStageConfig:
    """verl's `skip.<stage>`: dump a stage's output on the first run and replay it on later runs (a debugging aid).
    `skip.rollout` is honoured (tiller.trainer.rollout_skip); rollout_tq / async_rollout are refused."""

    enable: bool = False
    """Dump the listed steps' rollouts, and load them instead of generating on later runs."""
    dump_dir: str = "~/.verl/rollout_dump"
    """Where the dumps go: <dump_dir>/<experiment>_<project>/GBS<g>_N<n>_in<p>_out<r>/<step>/."""
    steps: list[int] = field(default_factory=list)
    """The training steps dumped / loaded (verl's default [] touches none)."""
    action: str = "cache"
    """cache: a step loads its own dump; repeat: its own, else the latest before it, else the first after it."""


@dataclass
class SkipConfig:
    """verl 0.10's top-level `skip` section (the successor of rollout.skip_rollout / skip_dump_dir)."""

    rollout: SkipStageConfig = field(default_factory=SkipStageConfig)
    """verl: replay the synchronous rollout."""
    rollout_tq: SkipStageConfig = field(default_factory=SkipStageConfig)
    """verl: replay the TransferQueue rollout."""
    async_rollout: SkipStageConfig = field(default_factory=SkipStageConfig)
    """verl: replay the asynchronous rollout."""


@dataclass
class V1SamplerConfig:
    """verl's `trainer.v1.sampler`: how its v1 trainer draws trajectories from its replay buffer."""

    max_off_policy_threshold: int = 8
    """verl: most policy versions one trajectory may span (its async modes); tiller's bound is
    async_training.staleness_threshold."""
    max_off_policy_strategy: str = "drop"
    """verl: drop | wait for trajectories past that bound (its async modes)."""
    sync_refill_failed_groups: bool = False
    """verl: replace groups whose rollouts all failed; tiller's rollouts do not fail per group."""
    custom_sampler: dict[str, Any] = field(default_factory=lambda: {"path": None, "name": None})
    """verl: a custom replay-buffer sampler class {path, name}; refused unless path is null."""
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)
    """verl: keyword arguments of the custom sampler (only with custom_sampler.path, which is refused)."""


@dataclass
class V1TrainerConfig:
    """verl 0.10's `trainer.v1`: the modes of its v1 trainer (`trainer.use_v1`, verl's default)."""

    trainer_mode: str = "sync"
    """sync is tiller's step (rollout, then update, on one policy); verl's colocate_async / separate_async are refused
    (tiller's asynchronous RL is async_training.*)."""
    sync: dict[str, Any] = field(default_factory=dict)
    """verl: options of the sync mode (none)."""
    colocate_async: dict[str, Any] = field(default_factory=lambda: {"num_warmup_batches": 1})
    """verl: options of colocate_async (only with trainer_mode=colocate_async, which is refused)."""
    separate_async: dict[str, Any] = field(default_factory=lambda: {
        "num_warmup_batches": 1, "parameter_sync_step": 4, "hybrid_rollout": {
            "enable_switch": False, "switch_threshold_ratio": 0.4, "adaptive_switch_threshold": True,
            "switch_threshold_step_up": 0.05, "switch_threshold_step_down": 0.03,
            "switch_threshold_release_steps": 2, "switch_cost_window_size": 3}})
    """verl: options of separate_async (only with trainer_mode=separate_async, which is refused)."""
    sampler: V1SamplerConfig = field(default_factory=V1SamplerConfig)
    """verl: the replay-buffer sampler."""


@dataclass
class MegatronOptimOptions:
    """Megatron-Core optimizer options verl 0.10 added to every `optim` section (mixed into tiller's OptimConfig);
    read only by verl's Megatron workers."""

    use_precision_aware_optimizer: bool = False
    main_grads_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    use_layer_wise_distributed_optimizer: bool = False
    muon_momentum: float = 0.95
    muon_nesterov: bool = False
    muon_split_qkv: bool = True
    muon_scale_mode: str = "spectral"
    muon_coefficient_type: str = "quintic"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"
    muon_fp32_matmul_prec: str = "medium"
    muon_extra_scale_factor: float = 1.0
    muon_scalar_optimizer: str = "adam"
    muon_match_adamw_update_rms: bool = False


MEGATRON_OPTIM_OPTIONS = tuple(MegatronOptimOptions.__dataclass_fields__)


def turbo_config() -> dict[str, Any]:
    """verl's `fsdp_config.turbo_config` (its FSDP "turbo" engine's parallel plan), verl's defaults."""
    return {"distributed": {
        "fully_shard_parallel_size": 16, "tensor_parallel_size": 1, "expert_parallel_size": 1,
        "expert_fully_shard_parallel_size": 1, "ulysses_parallel_size": 1,
        "fsdp_plan": {"param_dtype": "bf16", "reduce_dtype": "fp32", "output_dtype": "bf16",
                      "fsdp_implementation": "native", "num_to_forward_prefetch": 1, "num_to_backward_prefetch": 1}}}


def disaggregation() -> dict[str, Any]:
    """verl's `rollout.disaggregation` (prefill / decode on separate replicas), verl's defaults."""
    return {"enabled": False, "prefill_replicas": 1, "decode_replicas": 1, "decode_tensor_model_parallel_size": None,
            "transfer_backend": "nixl", "bootstrap_port": None, "ib_device": None}


def reward_model_rollout() -> dict[str, Any]:
    """verl 0.10's `reward.reward_model.rollout`: the inference server its reward loop runs the reward model on
    (verl's defaults; `name` is mandatory there, null here)."""
    return {"name": None, "dtype": "bfloat16", "gpu_memory_utilization": 0.5, "enforce_eager": True,
            "cudagraph_capture_sizes": None, "free_cache_engine": True, "data_parallel_size": 1,
            "expert_parallel_size": 1, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
            "max_num_batched_tokens": 8192, "max_model_len": None, "max_num_seqs": 1024, "load_format": "auto",
            "layered_summon": False, "scheduling_policy": "fcfs", "full_determinism": False, "seed": 42,
            "multi_stage_wake_up": False, "engine_kwargs": {}, "limit_images": None, "enable_chunked_prefill": True,
            "enable_prefix_caching": True, "disable_log_stats": True, "skip_tokenizer_init": False,
            "ignore_eos": False, "temperature": 1.0, "top_k": -1, "top_p": 1, "do_sample": True, "n": 1,
            "prompt_length": 2048, "response_length": 2048, "quantization": None, "quantization_config_file": None,
            "mtp": None, "disaggregation": disaggregation()}


def teacher_models() -> dict[str, Any]:
    """verl 0.10's `distillation.teacher_models`: named teachers {key, model_path, num_replicas, inference}."""
    inference = {"name": None, "dtype": None, "gpu_memory_utilization": 0.5, "enforce_eager": True,
                 "cudagraph_capture_sizes": None, "free_cache_engine": True, "data_parallel_size": 1,
                 "expert_parallel_size": 1, "tensor_model_parallel_size": 2, "max_num_batched_tokens": 8192,
                 "max_model_len": None, "max_num_seqs": 1024, "load_format": "auto", "engine_kwargs": {},
                 "limit_images": None, "enable_chunked_prefill": True, "enable_prefix_caching": True,
                 "disable_log_stats": True, "skip_tokenizer_init": True, "prompt_length": None,
                 "response_length": None, "temperature": None}
    return {"teacher_model": {"key": None, "model_path": None, "num_replicas": 0, "inference": inference}}
