"""The RL configuration tree, typed, with verl's key names (`verl/trainer/config/ppo_trainer.yaml`).

Every field is defined once here with a one-line doc (the string literal under it). Defaults follow verl
where they make sense on any machine; where verl assumes 8 GPUs (batch sizes, learning rates for 7B
models, vLLM as the rollout engine) tiller picks CPU-friendly values and says so.

Sections a user can extend with verl's `+key=value` syntax are typed `dict[str, Any]` (e.g.
`custom_reward_function.reward_kwargs`, `actor_rollout_ref.model.override_config`); every other key
is closed: a typo is an error that suggests the closest valid keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tiller.config import schema_verl010 as v010
from tiller.config.schema_verl010 import MegatronOptimOptions, QatConfig, SkipConfig, V1TrainerConfig

REWARD_MANAGERS = ("naive", "batch", "parallel", "dapo", "openrlhf", "gdpo", "prime")
"""`reward_model.reward_manager` values (tiller.rewards.managers; openrlhf: tiller.rewards.openrlhf_api; gdpo: verl
0.10's GDPO manager, which is its naive one, a dict's entries kept as the components algorithm.gdpo_reward_keys reads;
prime: parallel with verl's 300 s per sample)."""

# ------------------------------------------------------------- verl sections tiller accepts as a whole


def _profiler() -> dict[str, Any]:
    """verl's per-role `profiler` section (verl/trainer/config/profiler/profiler.yaml)."""
    return {"tool": None, "enable": False, "all_ranks": False, "ranks": [], "save_path": None,
            # verl 0.10's additions
            "relocate_results": False, "finish_hook_cmd": None, "finish_hook_all_ranks": False,
            "finish_hook_ranks": [],
            "tool_config": {"nsys": {"discrete": False},
                            "npu": {"contents": [], "level": "level0", "analysis": True, "discrete": False},
                            "torch": {"contents": [], "discrete": False, "schedule": {
                                "skip_first": 0, "wait": 0, "warmup": 0, "active": 0, "repeat": 0}},
                            "torch_memory": {"trace_alloc_max_entries": 100000, "stack_depth": 32},
                            "precision_debugger": {"config_path": None, "steps": None, "stages": None,
                                                   "strict": False}}}


def _rollout_profiler() -> dict[str, Any]:
    """verl 0.10's rollout `profiler`: the role section plus the engine's token window per tool."""
    out = _profiler()
    for tool in ("npu", "torch"):
        out["tool_config"][tool].update({"profile_token_start": None, "profile_token_end": None})
    return out


def _global_profiler() -> dict[str, Any]:
    nsys = {"trace": "cuda,nvtx,cublas,ucx", "cuda-memory-usage": "true", "cuda-graph-trace": "graph"}
    return {"tool": None, "steps": None, "profile_continuous_steps": False, "save_path": "outputs/profile",
            "relocate_results": False, "finish_hook_cmd": None, "finish_hook_all_ranks": False,
            "finish_hook_ranks": [],  # (verl 0.10)
            "global_tool_config": {
                "nsys": {"discrete": False, "controller_nsight_options": dict(nsys),
                         "worker_nsight_options": {**nsys, "capture-range": "cudaProfilerApi",
                                                   "capture-range-end": None, "kill": "none"}},
                "torch_memory": {"trace_alloc_max_entries": 100000, "stack_depth": 32, "context": "all",
                                 "stacks": "all", "kw_args": {}},
                "precision_debugger": {"config_path": None, "steps": None, "stages": None, "strict": False}}}


def _checkpoint() -> dict[str, Any]:
    return {"save_contents": ["model", "optimizer", "extra"], "load_contents": ["model", "optimizer", "extra"],
            "async_save": False}


def _megatron() -> dict[str, Any]:
    """verl's `megatron` section of actor / ref / critic / reward model (ppo_megatron_trainer.yaml)."""
    return {"param_offload": False, "grad_offload": False, "optimizer_offload": False,
            "tensor_model_parallel_size": 1, "expert_model_parallel_size": 1, "expert_tensor_parallel_size": None,
            "pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
            "context_parallel_size": 1, "sequence_parallel": True, "use_distributed_optimizer": True,
            "use_dist_checkpointing": False, "dist_checkpointing_path": None, "dist_checkpointing_prefix": "",
            "seed": 42, "override_ddp_config": {},
            "override_transformer_config": {"recompute_granularity": None, "recompute_modules": ["core_attn"],
                                            "recompute_method": None, "recompute_num_layers": None,
                                            "attention_backend": "flash"},
            "override_mcore_model_config": {}, "use_mbridge": True, "vanilla_mbridge": True,
            "use_remove_padding": True, "forward_only": False, "dtype": "bfloat16"}


def _megatron_lora() -> dict[str, Any]:
    """The Megatron-only keys of verl's `model.lora` section (the critic's whole section)."""
    return {"type": "lora", "dropout": 0.0, "exclude_modules": [], "dropout_position": "pre",
            "lora_A_init_method": "xavier", "lora_B_init_method": "zero", "a2a_experimental": False, "dtype": None,
            "freeze_vision_model": True, "freeze_vision_projection": True, "freeze_language_model": True}


# ----------------------------------------------------------------------------------------------- data


@dataclass
class DataConfig:
    tokenizer: Optional[str] = None
    """Tokenizer path; defaults to actor_rollout_ref.model.path."""
    train_files: list[str] = field(default_factory=list)
    """Training prompt files: parquet (verl schema) or jsonl; a path or a list of paths."""
    val_files: list[str] = field(default_factory=list)
    """Validation prompt files: parquet (verl schema) or jsonl; a path or a list of paths."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a list of chat messages, or a plain string."""
    reward_fn_key: str = "data_source"
    """Column used to route each sample to its reward scorer."""
    max_prompt_length: int = 256
    """Longest prompt in tokens (after the chat template)."""
    max_response_length: int = 128
    """Longest response in tokens."""
    train_batch_size: int = 32
    """Prompts per RL step (verl: 1024; CPU-friendly here)."""
    gen_batch_size: Optional[int] = None
    """Prompts per generation round (DAPO recipe); None = train_batch_size. With
    algorithm.filter_groups.enable, rounds repeat until train_batch_size groups survive the filter."""
    val_batch_size: Optional[int] = None
    """Prompts per validation generation call; None = the whole validation set at once."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (seeded by data.seed)."""
    seed: Optional[int] = 1
    """Seed of the training-data shuffle."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than max_prompt_length instead of applying data.truncation."""
    truncation: str = "error"
    """What to do with a prompt over max_prompt_length: error | left | right."""
    return_raw_chat: bool = False
    """Keep the raw chat messages on each sample (needed by a reward model with its own template)."""
    apply_chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template (add_generation_prompt)."""
    max_samples: int = -1
    """Use at most this many training prompts (-1 = all)."""
    val_max_samples: int = -1
    """Use at most this many validation prompts (-1 = all)."""
    dataloader_num_workers: int = 0
    """Accepted for verl compatibility; tiller tokenizes in the main process."""
    train_probs: Optional[list[float]] = None
    """Interleave the train_files sources with these sampling probabilities (OpenRLHF's --prompt_data_probs);
    None = concatenate them."""
    train_split: str = "train"
    """Split read from a train source that is a dataset name or dir (datasets.load_dataset)."""
    val_split: str = "train"
    """Split read from a val source that is a dataset name or dir."""
    label_key: Optional[str] = None
    """Column holding the ground truth (OpenRLHF's --label_key); None = reward_model.ground_truth / ground_truth."""
    default_data_source: Optional[str] = None
    """data_source of rows without the data.reward_fn_key column; None = the column is required."""
    input_template: Optional[str] = None
    """Format string with {} applied to a string prompt when no chat template renders it (OpenRLHF's
    --input_template, e.g. "User: {}\\nAssistant: ")."""
    train_max_samples: Optional[int] = None
    """verl 0.7+'s name of data.max_samples (resolved onto it at load time; setting both is an error)."""
    use_shm: bool = False
    """verl: copy the data files to /dev/shm; tiller reads them where they are."""
    tool_config_path: Optional[str] = None
    """verl's copy of actor_rollout_ref.rollout.multi_turn.tool_config_path (resolved onto it; both set = error)."""
    return_raw_input_ids: bool = False
    """verl: keep the un-templated prompt ids on each sample; tiller's reward path works on text."""
    return_full_prompt: bool = False
    """verl: keep the rendered prompt string on each sample; tiller keeps it whenever a reward needs it."""
    validation_shuffle: bool = False
    """verl: shuffle the validation set; tiller validates on every prompt, in file order (the scores are the same)."""
    filter_overlong_prompts_workers: int = 1
    """verl: processes for filter_overlong_prompts; tiller filters in the driver."""
    trust_remote_code: bool = False
    """verl: trust_remote_code for the data tokenizer; tiller's tokenizer follows actor_rollout_ref.model.trust_remote_code."""
    image_key: str = "images"
    """Column of a row's images (a list of {"bytes"} / {"path"}; `<image>` placeholders in the prompt), read for
    vision-language models (Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE / Qwen3.5)."""
    video_key: str = "videos"
    """verl: column of the videos; refused unless "videos" (tiller takes images only; rows with videos are refused)."""
    image_patch_size: int = 14
    """verl: vision patch size; tiller reads it from the model's image processor config."""
    return_multi_modal_inputs: bool = True
    """verl: keep the processed images on each sample; tiller always does (the forwards need them)."""
    custom_cls: dict[str, Any] = field(default_factory=lambda: {"path": None, "name": None})
    """verl: a custom Dataset class {path, name}; refused unless both are null (tiller reads parquet / jsonl / datasets)."""
    sampler: dict[str, Any] = field(default_factory=lambda: {"class_path": None, "class_name": None})
    """verl: a custom (curriculum) sampler {class_path, class_name}; refused unless both are null."""
    datagen: dict[str, Any] = field(default_factory=lambda: {"path": None, "name": None})
    """verl: a dynamic data generator {path, name}; refused unless both are null."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables of the chat template (verl: keyword arguments of apply_chat_template), e.g.
    +data.apply_chat_template_kwargs.enable_thinking=False for Qwen3: every prompt the policy sees is rendered with
    them (prompt set and its length filter, validation, agent endpoint, tool loop, tiller eval / generate)."""
    function_tool_path: Optional[str] = None
    """verl's copy of actor_rollout_ref.rollout.multi_turn.function_tool_path (resolved onto it; both set = error)."""
    audio_key: str = "audios"
    """verl 0.10: the column of audio inputs; tiller trains text-only models."""
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    """verl 0.10: keyword arguments of the multimodal processor; tiller trains text-only models."""


# ------------------------------------------------------------------------------------ actor / rollout


@dataclass
class FSDPConfig:
    """verl's `fsdp_config`: how a worker shards and offloads. tiller's FSDP2 always shards over every rank
    of the group and keeps parameters and optimizer state on the worker's device, so these knobs are
    accepted and have no effect (`tiller config keys` lists them)."""

    param_offload: bool = False
    """Offload parameters to CPU between uses (verl); tiller keeps them on the worker's device."""
    optimizer_offload: bool = False
    """Offload optimizer state to CPU between steps (verl); tiller keeps it on the worker's device."""
    offload_policy: bool = False
    """FSDP2 CPUOffloadPolicy (verl); tiller does not offload."""
    reshard_after_forward: bool = True
    """FSDP2 reshard_after_forward (verl); tiller reshards after every forward."""
    fsdp_size: int = -1
    """Ranks per FSDP shard group (-1 = all, verl); tiller shards over every rank of the group."""
    forward_prefetch: bool = False
    """FSDP forward prefetch (verl); a GPU overlap tuning."""
    model_dtype: str = "fp32"
    """Dtype of the sharded parameters (verl); tiller keeps fp32 master weights (compute dtype: actor.dtype)."""
    wrap_policy: dict[str, Any] = field(default_factory=lambda: {"min_num_params": 0})
    """FSDP wrap policy (verl); tiller wraps each decoder layer (open-ended: use +key=value)."""
    ulysses_sequence_parallel_size: Optional[int] = None
    """verl 0.8+'s place of <section>.ulysses_sequence_parallel_size (the key its engines read): the same setting."""
    strategy: str = "fsdp"
    """verl's engine strategy (fsdp | fsdp2); tiller's workers use FSDP2 under <role>.strategy."""
    dtype: str = "bfloat16"
    """verl's engine compute dtype; tiller's compute dtype is <role>.dtype."""
    use_orig_params: bool = False
    """FSDP1 use_orig_params (verl); tiller's FSDP2 has no flat parameters."""
    seed: int = 42
    """verl's engine seed; tiller seeds everything from trainer.seed."""
    full_determinism: bool = False
    """verl: deterministic CUDA kernels; a GPU setting (tiller's CPU runs are deterministic per seed)."""
    entropy_from_logits_with_chunking: bool = False
    """verl: entropy in chunks to save memory; a memory tuning (tiller computes it from each micro-batch's logits)."""
    entropy_checkpointing: bool = False
    """verl: recompute the entropy in backward; a memory tuning."""
    use_torch_compile: bool = True
    """verl's engine torch.compile switch; tiller's is <role>.use_torch_compile."""
    forward_only: bool = False
    """verl: an engine without optimizer (set by verl for the reference); tiller builds the reference without one."""
    entropy_from_logits_chunk_size: int = 2048
    """verl 0.10: chunk size of entropy_from_logits_with_chunking; a memory tuning."""
    pad_to_length: bool = False
    """verl 0.10: pad every micro-batch to a fixed bucketed length (static shapes); tiller pads each micro-batch to
    its longest row (the update is the same)."""
    pad_to_length_bucket: int = 1024
    """verl 0.10: the bucket of pad_to_length (no effect in tiller)."""
    qat: QatConfig = field(default_factory=QatConfig)
    """verl 0.10: quantization-aware training of this engine (enable refused)."""
    grad_offload: bool = False
    """verl (before 0.3): offload gradients to CPU; verl dropped the key long ago, tiller keeps gradients on the
    worker's device."""
    mixed_precision: dict[str, Any] = field(default_factory=dict)
    """verl: FSDP mixed-precision dtypes {param_dtype, reduce_dtype, buffer_dtype} (+key=value); tiller's compute
    dtype is <role>.dtype, gradients reduce in fp32."""
    turbo_config: dict[str, Any] = field(default_factory=v010.turbo_config)
    """verl 0.10: the parallel plan of its FSDP "turbo" engine (expert / tensor / Ulysses sizes); tiller's FSDP2
    shards over data-parallel ranks."""


@dataclass
class LoraConfig:
    """verl 0.8+'s `actor_rollout_ref.model.lora` section: resolved at load time onto the older flat keys
    (model.lora_rank, lora_alpha, target_modules); setting a key in both places is an error."""

    rank: Optional[int] = None
    """= model.lora_rank (LoRA rank; 0 = full fine-tuning)."""
    alpha: Optional[int] = None
    """= model.lora_alpha."""
    target_modules: Any = None
    """= model.target_modules (a list of module names or 'all-linear')."""
    merge: bool = False
    """verl: merge the adapters into the base weights for the rollout sync; tiller always syncs merged weights."""
    adapter_path: Optional[str] = None
    """= model.lora_adapter_path (continue training from a saved LoRA adapter dir)."""
    type: str = "lora"
    """verl (Megatron): lora | dora ...; tiller trains plain LoRA."""
    dropout: float = 0.0
    """verl (Megatron): LoRA dropout; tiller's adapters have none."""
    exclude_modules: list[str] = field(default_factory=list)
    """= model.exclude_modules (module names left out of target_modules)."""
    dropout_position: str = "pre"
    """verl (Megatron) LoRA dropout position."""
    lora_A_init_method: str = "xavier"
    """verl (Megatron) init of A; tiller: Kaiming-uniform A, as PEFT."""
    lora_B_init_method: str = "zero"
    """verl (Megatron) init of B; tiller: zero B, as PEFT."""
    a2a_experimental: bool = False
    """verl (Megatron) expert-parallel LoRA all-to-all."""
    dtype: Optional[str] = None
    """verl (Megatron) adapter dtype; tiller's adapters train in the actor's master dtype."""
    freeze_vision_model: bool = True
    """verl (Megatron, vision-language models); tiller trains text-only models."""
    freeze_vision_projection: bool = True
    """verl (Megatron, vision-language models); tiller trains text-only models."""
    freeze_language_model: bool = True
    """verl (Megatron): freeze the base weights under the adapters (tiller always does)."""


@dataclass
class MtpConfig:
    """verl's `model.mtp`: multi-token-prediction heads (MiMo / DeepSeek-V3 style). tiller has none."""

    enable: bool = False
    """Refused: tiller's models have no MTP heads to train or to draft with."""
    enable_train: bool = False
    """verl: train the MTP heads (only with mtp.enable, refused)."""
    enable_rollout: bool = False
    """verl: speculative decoding with the MTP heads (only with mtp.enable, refused)."""
    detach_encoder: bool = False
    """verl MTP option (only with mtp.enable, refused)."""
    mtp_loss_scaling_factor: float = 0.1
    """verl MTP option (only with mtp.enable, refused)."""
    speculative_algorithm: str = "EAGLE"
    """verl MTP option (only with mtp.enable, refused)."""
    speculative_num_steps: int = 2
    """verl MTP option (only with mtp.enable, refused)."""
    speculative_eagle_topk: int = 2
    """verl MTP option (only with mtp.enable, refused)."""
    speculative_num_draft_tokens: int = 4
    """verl MTP option (only with mtp.enable, refused)."""
    method: str = "mtp"
    """verl MTP option (only with mtp.enable, refused)."""
    num_speculative_tokens: int = 1
    """verl MTP option (only with mtp.enable, refused)."""


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face model dir or hub id; empty = tiller's built-in demo model."""
    tokenizer_path: Optional[str] = None
    """Tokenizer dir; defaults to model.path."""
    external_lib: Optional[str] = None
    """Python module imported before loading (registers custom architectures)."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Keys set on the model's HF config before the model is built (open-ended: use +key=value), as verl;
    `attn_implementation` picks the attention implementation (sdpa, eager, ...); vLLM gets the others."""
    lm_head_fp32: bool = False
    """tiller (TRL's cast_lm_head_to_fp32, the ScaleRL recipe): the policy's and the reference's LM head computed in
    float32 under actor.dtype=bfloat16, so the logits and log-probs are not rounded to bf16 (the head's parameters
    are float32 masters already). Not with the head LoRA-adapted or in modules_to_save."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    use_remove_padding: bool = False
    """Actor, reference and old-logprob forwards: each micro-batch's rows packed into one sequence without padding
    (position ids restart per row; transformers masks attention block-diagonally), the LM head on response
    positions only (tiller.workers.packed). False: padded rows, trimmed per micro-batch. The critic has its own
    (critic.model.use_remove_padding)."""
    use_shm: bool = False
    """verl: copy the model to /dev/shm before loading; tiller loads from model.path."""
    use_fused_kernels: bool = False
    """The LM head run with the log-probs and entropy, chunk by chunk, so the [tokens, vocabulary] logits and their
    gradient never exist whole (verl's fused kernels; tiller.algos.entropy.head_logprobs_and_entropy): actor,
    reference and old-logprob forwards, in the packed forward (model.use_remove_padding=True) without sequence
    parallelism, for causal LMs whose head is a plain Linear applied as is (not under FSDP2 sharding); elsewhere the
    logits are computed whole, said once. Costs the head's matmul once more in the backward."""
    trust_remote_code: bool = False
    """Pass trust_remote_code to from_pretrained."""
    lora_rank: int = 0
    """LoRA rank for the actor (0 = full fine-tuning)."""
    load_in_4bit: bool = False
    """tiller (TRL's / transformers' load_in_4bit, OpenRLHF's --load_in_4bit): QLoRA, the actor's body linear layers
    loaded as bitsandbytes 4-bit weights, frozen, LoRA adapters training on them; needs LoRA and the bitsandbytes
    package. The reference is the 4-bit base (adapters off); the rollout and the export get the dequantized base with
    the adapters merged (the function trained)."""
    bnb_4bit_quant_type: str = "nf4"
    """tiller: with load_in_4bit, nf4 (QLoRA's NormalFloat4) | fp4."""
    bnb_4bit_use_double_quant: bool = False
    """tiller (TRL's use_bnb_nested_quant): with load_in_4bit, the block scales quantized too."""
    lora_alpha: int = 16
    """LoRA alpha."""
    lora_dropout: float = 0.0
    """tiller (peft's lora_dropout; TRL's peft_config.lora_dropout, OpenRLHF's --lora_dropout): dropout on the
    adapters' input in the update's forward only (the module trains in train mode); the logprob forwards (old,
    reference) run in eval mode and the rollout on merged weights, both without it. Needs LoRA; in [0, 1)."""
    use_rslora: bool = False
    """tiller (peft's / TRL's use_rslora): rank-stabilised LoRA, the adapter scaled by lora_alpha / sqrt(rank)
    instead of lora_alpha / rank."""
    use_dora: bool = False
    """tiller (peft's / TRL's use_dora): DoRA adapters (a learned magnitude per output feature besides the low-rank
    direction update), merged as peft merges them for the rollout and the export."""
    target_modules: Any = "all-linear"
    """LoRA target modules: a list of module names or 'all-linear'."""
    target_parameters: Any = None
    """tiller (peft's target_parameters, TRL's lora_target_parameters): with LoRA, parameters adapted by name besides
    target_modules: a mixture-of-experts model's experts (transformers stores each layer's experts as 3-D parameters,
    which 'all-linear' does not reach), e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj]; a list of parameter
    names (suffixes of full names)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """verl 0.8+'s LoRA section (the same settings as lora_rank / lora_alpha / target_modules)."""
    lora_adapter_path: Optional[str] = None
    """Continue training from a saved LoRA adapter (a peft adapter dir: adapter_config.json + weights, e.g. a tiller
    LoRA checkpoint's model/): loaded trainable onto model.path; its rank, alpha and targets come from its
    adapter_config.json (lora_rank / lora_alpha / target_modules left at their defaults, or set to the same values).
    LoRA is on with it even at lora_rank=0; the reference policy is the base with adapters disabled."""
    exclude_modules: Any = None
    """LoRA: modules left out of target_modules (peft's exclude_modules): a list of module names, or a regex string
    matched against full module names."""
    modules_to_save: Any = None
    """tiller (peft's modules_to_save, TRL's lora_modules_to_save): with LoRA, modules trained in full beside the
    adapters, synced to the rollout engine with the merged weights and saved with the adapter (e.g. [lm_head,
    embed_tokens] after adding tokens); a list of module names. The reference policy keeps the original modules."""
    hf_config_path: Optional[str] = None
    """verl: read the HF config from another dir; refused (tiller reads model.path's config.json)."""
    custom_chat_template: Optional[str] = None
    """A Jinja chat template replacing the tokenizer's (and a VLM processor's) after loading: prompts render with
    it and the checkpoints (and their export) save the tokenizer with it; null = the tokenizer's own."""
    enable_activation_offload: bool = False
    """verl: offload activations to CPU in backward; a GPU memory tuning tiller does not have."""
    use_liger: bool = False
    """verl: Liger fused kernels; tiller runs the Hugging Face modelling code."""
    fused_kernel_options: dict[str, Any] = field(default_factory=lambda: {"impl_backend": "torch"})
    """verl: backend of use_fused_kernels (tiller has one: torch chunks, compiled by Inductor on CUDA)."""
    tiled_mlp: dict[str, Any] = field(default_factory=lambda: {"enabled": False, "num_shards": 4})
    """verl: tiled MLP to save activation memory; a memory tuning tiller does not have."""
    mtp: MtpConfig = field(default_factory=MtpConfig)
    """verl: multi-token prediction (MTP) heads in training and speculative decoding in rollout."""


@dataclass
class OptimConfig(MegatronOptimOptions):
    lr: float = 1e-6
    """Peak learning rate."""
    lr_warmup_steps: int = -1
    """Warmup steps (lr x step / warmup from 0, verl's schedule); <= 0 = int(lr_warmup_steps_ratio x total steps)."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup as a fraction of total training steps."""
    min_lr_ratio: float = 0.0
    """Cosine schedule floor as a fraction of lr."""
    warmup_style: Optional[str] = "constant"
    """Schedule after warmup: constant | cosine | linear (to 0 at the last step: transformers' linear schedule); tiller
    also: transformers' cosine_with_restarts | polynomial | inverse_sqrt | warmup_stable_decay (their formulas and
    warmup exactly; keywords in lr_scheduler_kwargs)."""
    lr_scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    """tiller: keywords of transformers' schedules (get_scheduler's scheduler_specific_kwargs): cosine_with_restarts:
    num_cycles; polynomial: lr_end, power; inverse_sqrt: timescale; warmup_stable_decay: num_decay_steps (required),
    num_stable_steps, warmup_type, decay_type, min_lr_ratio, num_cycles. Refused with verl's schedules."""
    total_training_steps: int = -1
    """Set by the trainer from the data and trainer.total_epochs / total_training_steps."""
    weight_decay: float = 0.01
    """Weight decay (passed to every optimizer class, as verl does)."""
    weight_decay_exempt: Optional[str] = None
    """tiller: the parameters weight decay spares. null: none, every trainable parameter decays (verl);
    transformers: biases, norm weights and LayerNorm parameters, as transformers' Trainer (TRL) groups them; openrlhf:
    the names containing bias / layer_norm.weight / layernorm.weight / norm.weight / ln_f.weight (OpenRLHF). The
    TRL and OpenRLHF front ends set theirs when weight decay is on."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas: passed when the optimizer's name contains adam / ademamix (verl's rule); another value with
    another class is an error."""
    eps: float = 1e-8
    """Adam epsilon (tiller's key; verl passes none): passed with betas; another value with another class is an
    error (use override_optimizer_config.eps)."""
    lr_scheduler_type: Optional[str] = None
    """verl 0.6+'s name of warmup_style (constant | cosine; resolved onto it at load time; both set = error)."""
    clip_grad: Optional[float] = None
    """verl's engine-layout place of <role>.grad_clip (resolved onto it at load time; both set = error)."""
    optimizer: str = "AdamW"
    """Optimizer class name in optimizer_impl (AdamW, SGD, Adam, ...; Megatron's `adam` / `adamw` with torch.optim
    is AdamW, the same decoupled AdamW); built with lr, weight_decay (+ betas, eps for Adam-family names) and
    override_optimizer_config (`tiller.models.optimizer`). A resume refuses a checkpoint of another class."""
    optimizer_impl: str = "torch.optim"
    """Module the optimizer class is imported from (torch.optim, torchao.optim, bitsandbytes.optim, ...)."""
    num_cycles: float = 0.5
    """Cosine cycles of warmup_style=cosine (verl's formula): 0.5 decays once to min_lr_ratio; 1.0 goes down and
    back up."""
    override_optimizer_config: Optional[dict[str, Any]] = field(default_factory=dict)
    """Extra keyword arguments of the optimizer class (e.g. {amsgrad: true}, SGD's {momentum: 0.9}), applied last
    (they may replace lr / weight_decay / betas); one the class refuses is an error naming this key."""
    lr_decay_steps: Optional[int] = None
    """verl Megatron optimizer schedule (strategy=megatron only)."""
    lr_decay_style: str = "constant"
    """verl Megatron optimizer schedule (strategy=megatron only; tiller's is warmup_style)."""
    lr_warmup_init: float = 0.0
    """verl Megatron optimizer schedule (strategy=megatron only)."""
    lr_wsd_decay_steps: Optional[int] = None
    """verl Megatron optimizer schedule (strategy=megatron only)."""
    lr_wsd_decay_style: str = "exponential"
    """verl Megatron optimizer schedule (strategy=megatron only)."""
    min_lr: float = 0.0
    """verl Megatron optimizer schedule (strategy=megatron only; tiller's floor is min_lr_ratio)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """verl Megatron optimizer schedule (strategy=megatron only)."""
    weight_decay_incr_style: str = "constant"
    """verl Megatron optimizer schedule (strategy=megatron only)."""
    zero_indexed_step: bool = True
    """verl 0.10: warmup_style=cosine counts steps from 0 (True, verl's default: the first step's warmup lr is 0) or
    from 1 (False, torchtitan's: the schedule one step ahead)."""


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    """Policy loss: vanilla | gspo | gpg | cispo | sapo | geo_mean | clip_cov | kl_cov | dppo_tv | dppo_kl | dro | vespo
    (bypass_mode is chosen by algorithm.rollout_correction.bypass_mode)."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of tokens clipped by covariance."""
    clip_cov_lb: float = 1.0
    """clip_cov: covariance lower bound."""
    clip_cov_ub: float = 5.0
    """clip_cov: covariance upper bound."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of tokens given the KL penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of the KL penalty."""
    tau_pos: Optional[float] = None
    """verl's sapo example sets +policy_loss.tau_pos; verl's SAPO reads actor.tau_pos, so this key has no effect there
    either (set actor_rollout_ref.actor.tau_pos)."""
    tau_neg: Optional[float] = None
    """As policy_loss.tau_pos: verl's SAPO reads actor.tau_neg."""
    sapo_tau_pos: Optional[float] = None
    """Older name of actor.tau_pos (converted at load time; setting both is an error)."""
    sapo_tau_neg: Optional[float] = None
    """Older name of actor.tau_neg (converted at load time; setting both is an error)."""
    dro_beta: Optional[float] = None
    """dro: weight of the quadratic log-ratio penalty beta/2 (logp - old_logp)^2 (> 0); required with loss_mode=dro
    (verl 0.10's default is null, and verl stops on a null beta too)."""
    vespo_k_pos: float = 2.0
    """tiller (TRL's loss_type=vespo, VESPO arXiv 2602.10693): vespo's power k of the sequence ratio's Gamma weight
    phi(w) = exp(lam + k log w - lam w) for responses with advantage >= 0 (how hard w < 1 is down-weighted)."""
    vespo_lambda_pos: float = 3.0
    """tiller (TRL's): vespo's decay lam for advantage >= 0 (how hard w > 1 is down-weighted)."""
    vespo_k_neg: float = 3.0
    """tiller (TRL's): vespo's k for advantage < 0."""
    vespo_lambda_neg: float = 2.0
    """tiller (TRL's): vespo's lam for advantage < 0."""


@dataclass
class AdaptiveEntropyConfig:
    enable: bool = False
    """Skywork-OR1 adaptive entropy: raise/lower entropy_coeff to hold entropy near target_entropy."""
    target_entropy: float = 0.2
    """Target entropy (nats per token); the bonus applies only while entropy is below it."""
    delta: float = 0.005
    """Step by which the coefficient moves each update."""
    max_coeff: float = 0.05
    """Upper clip of the coefficient."""
    init_coeff: float = 0.0
    """Starting coefficient."""
    min_coeff: float = 0.0
    """tiller: lower clip of the coefficient (TRL's entropy_coef_min; Skywork-OR1's is 0)."""
    inclusive: bool = False
    """tiller: compare with <= (TRL's controller, the Skywork paper's text): at entropy <= target the bonus applies
    and the coefficient rises, above it falls. False: the bonus applies below target only, the coefficient rises
    below it, falls above it and holds at it exactly."""


@dataclass
class RouterReplayConfig:
    mode: str = "disabled"
    """verl: MoE routing replay (`tiller.models.routing`): disabled; R2 (the actor's old-logprob pass records each
    token's experts, the update replays them); R3 (the rollout engine records them, rollout.enable_rollout_routing_replay,
    and the old-logprob pass and the update replay them; the reference too with ref.router_replay.mode=R3)."""
    record_file: Optional[str] = None
    """verl: declared, read by none of verl's code; the routing travels in the batch (`routed_experts`)."""
    replay_file: Optional[str] = None
    """verl: declared, read by none of verl's code; the routing travels in the batch (`routed_experts`)."""


@dataclass
class ActorConfig:
    strategy: str = "fsdp"
    """Parallel strategy inside a worker group when trainer.backend=ray: fsdp (FSDP2) | ddp | none."""
    ppo_mini_batch_size: int = 16
    """Prompts per optimizer step (multiplied by rollout.n inside the trainer, as in verl)."""
    ppo_micro_batch_size_per_gpu: Optional[int] = 8
    """Samples per forward/backward on each worker (gradient accumulation splits a mini-batch into these)."""
    ppo_micro_batch_size: Optional[int] = None
    """Deprecated (verl): a global micro-batch size, converted to ppo_micro_batch_size_per_gpu = this /
    number of workers, with a deprecation line; setting both is an error."""
    use_dynamic_bsz: bool = False
    """Token-budget micro-batches: pack samples into micro-batches of at most ppo_max_token_len_per_gpu
    padded tokens instead of ppo_micro_batch_size_per_gpu rows (the update is the same, global counts)."""
    ppo_max_token_len_per_gpu: int = 16384
    """With use_dynamic_bsz: padded tokens (rows x (prompt + response) width) per actor micro-batch."""
    ulysses_sequence_parallel_size: int = 1
    """verl's Ulysses sequence parallelism: with trainer.backend=ray and several workers, groups of this many
    workers split each packed micro-batch (its tokens, and its attention heads around attention), so a worker holds
    1/size of the activations and logits (`tiller.workers.ulysses`; needs model.use_remove_padding=True; the token
    budgets are per worker's share, as verl's). One process (trainer.backend=local) runs whole sequences: the update
    is the same."""
    use_token_level_loss: Optional[bool] = None
    """Deprecated (early verl): True = loss_agg_mode token-mean, False = seq-mean-token-mean."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """verl's sharding / offload knobs of the actor (no effect in tiller)."""
    ppo_epochs: int = 1
    """Passes over each RL batch."""
    shuffle: bool = False
    """Shuffle samples before splitting into mini-batches."""
    mask_truncated_responses: bool = False
    """tiller: leave truncated responses (finish_reason length: no EOS within the budget) out of the policy loss;
    they still count in their group's advantages and as sequences of the seq-mean modes (TRL's
    mask_truncated_completions)."""
    top_entropy_quantile: float = 1.0
    """tiller (TRL's top_entropy_quantile; Wang et al. 2025, "Beyond the 80/20 Rule"): the policy gradient (and the
    entropy bonus) only on the micro-batch's top share of response tokens by entropy, e.g. 0.2 for the "forking"
    tokens; the loss keeps its denominator. 1.0: every token."""
    router_aux_loss_coef: float = 0.0
    """tiller (TRL's router_aux_loss_coef, OpenRLHF's --actor.aux_loss_coef): a mixture-of-experts policy (its config
    has output_router_logits: Mixtral, Qwen2-MoE, Qwen3-MoE, ...) adds this x transformers' router load-balancing
    loss of each micro-batch's forward (prompt and response tokens), by its share of the mini-batch's sequences.
    0: off (verl's FSDP workers add none: "it hurts perf in RL"). Actor only (not the critic)."""
    off_policy_mask_threshold: Optional[float] = None
    """tiller (TRL's off_policy_mask_threshold; DeepSeek-V3.2's off-policy sequence mask): a response with a negative
    advantage whose mean log pi_rollout - log pi over its tokens exceeds this leaves the policy gradient (the
    rollout's logprobs; without them the old ones). null: off."""
    grad_clip: float = 1.0
    """Max global grad norm."""
    clip_ratio: float = 0.2
    """PPO clip epsilon (used for low/high when those are not set)."""
    clip_ratio_low: Optional[float] = None
    """Lower clip epsilon (DAPO clip-higher); None = clip_ratio."""
    clip_ratio_high: Optional[float] = None
    """Upper clip epsilon (DAPO clip-higher); None = clip_ratio."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for negative advantages (> 1); dppo_tv / dppo_kl: the cap of the IS ratio."""
    tau_pos: float = 1.0
    """sapo: temperature of the soft gate for positive advantages."""
    tau_neg: float = 1.05
    """sapo: temperature of the soft gate for negative advantages."""
    loss_agg_mode: str = "token-mean"
    """token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (the seq-mean
    modes divide by the mini-batch's rows, a row rejected whole included, as verl 0.10's trainer)."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient."""
    entropy_agg_mode: Optional[str] = None
    """tiller: how the entropy bonus is aggregated (the loss_agg_mode values); null = loss_agg_mode (verl's). TRL's
    bonus is a token mean whatever its loss type (token-mean)."""
    adaptive_entropy: AdaptiveEntropyConfig = field(default_factory=AdaptiveEntropyConfig)
    """Skywork-OR1 adaptive entropy control."""
    use_kl_loss: bool = False
    """Add KL(actor || ref) to the loss (GRPO style) instead of to the reward."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """kl | abs | mse | low_var_kl | k3+ (straight-through)."""
    kl_loss_importance_weight: bool = False
    """tiller: multiply the KL loss term by the importance ratio pi / pi_old, differentiable (DeepSeek-V3.2's
    unbiased KL estimate, arXiv 2512.02556; TRL's use_bias_correction_kl): per token, or per sequence with
    policy_loss.loss_mode=gspo. Changes the KL gradient even on-policy. Needs use_kl_loss."""
    use_torch_compile: bool = False
    """Compile each decoder layer of the actor with torch.compile (regional compilation, one compiled graph shared
    by every layer; tiller.models.compile): Inductor fuses the norms, rotary embedding, SiLU x up and residual adds
    of the update's and log-prob forwards and backward. verl's default is true, where it compiles the entropy
    function (tiller compiles its log-prob / entropy chunks on CUDA anyway). A compile that fails warns and runs
    eagerly."""
    calculate_sum_pi_squared: bool = False
    """verl: return sum_v pi(v)^2 from the old-logprob forward (optimal token baseline); tiller computes it whenever
    algorithm.adv_estimator needs it."""
    share_prompt_forward: bool = True
    """Run each distinct prompt of a micro-batch once and reuse its KV cache for all its samples, in the
    actor, old-logprob and reference forwards (exact; the n samples of a group cost one prompt). Off: one
    full forward per sample, as verl. Needs an HF causal LM (past_key_values); off under gradient checkpointing."""
    dtype: str = "float32"
    """Training compute dtype: float32 | bfloat16 (autocast over fp32 master weights; fp16 is not offered). Unset, as
    verl's FSDP workers choose: fsdp_config.mixed_precision.param_dtype where given, else bfloat16 where
    trainer.device=cuda (verl's default mixed precision) and float32 on a CPU."""
    update_lanes: int = 1
    """tiller (CPU, one process): run this many of a mini-batch's micro-batches at a time, each in its own
    thread on trainer.num_threads / update_lanes torch threads (at least 1); the micro-batch count is rounded
    up to a multiple of the lanes, rows shared evenly (use_dynamic_bsz: its token-budget micro-batches). Small models' ops scale poorly over threads, whole
    micro-batches do: on 2 cores two lanes of 1 thread update ~1.2x faster than one lane of 2 threads.
    Gradients add up under autograd's lock: with 2 lanes exactly the sequential sums over the same
    micro-batches; with more the order of the additions (so the last bits) depends on timing. 1 = one
    micro-batch after another. Asynchronous RL with async_training.share_idle_threads and one thread per side
    adds one lane on the producer's thread. Not with trainer.backend=ray, torchrun or a GPU."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy loss choice and its hyper-parameters."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Actor optimizer (verl: lr 1e-6 for 7B models; tiny models need more)."""
    rollout_n: Optional[int] = None
    """verl's copy of rollout.n (null = rollout.n; another value is an error)."""
    use_rollout_log_probs: Optional[bool] = None
    """verl fully-async's copy of async_training.use_rollout_log_probs (False is refused)."""
    freeze_vision_tower: bool = False
    """Freeze a vision-language model's vision tower (no gradient, no optimizer state; the merger too, as verl's
    `model.visual`); an error for a text-only model."""
    loss_scale_factor: Optional[float] = None
    """The constant seq-mean-token-sum-norm divides the sequences' token sums by (null = the padded response length,
    verl's default); the policy, entropy, KL and distillation losses (verl's agg_loss)."""
    calculate_entropy: bool = False
    """verl: compute the entropy even when entropy_coeff is 0; tiller logs actor/entropy every update."""
    use_prefix_grouper: bool = False
    """verl: run a group's shared prompt once (prefix grouper); tiller's share_prompt_forward (on by default) does it."""
    data_loader_seed: int = 42
    """verl: seed of the mini-batch shuffle; tiller seeds it from trainer.seed."""
    checkpoint: dict[str, Any] = field(default_factory=_checkpoint)
    """verl: {save_contents, load_contents, async_save}; tiller saves and loads model, optimizer and trainer state
    together, synchronously."""
    use_fused_kernels: bool = False
    """verl's copy of model.use_fused_kernels (tiller reads model.use_fused_kernels)."""
    use_remove_padding: bool = False
    """verl's copy of model.use_remove_padding (tiller pads, trimmed per micro-batch)."""
    profiler: dict[str, Any] = field(default_factory=_profiler)
    """verl's nsys / npu / torch profiler hooks of this role; tiller has no profiler integration."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """verl: MoE routing replay of the actor's forwards (R2 / R3, `tiller.models.routing`)."""
    entropy_from_logits_with_chunking: bool = False
    """verl: entropy in chunks to save memory; a memory tuning."""
    entropy_checkpointing: bool = False
    """verl: recompute the entropy in backward; a memory tuning."""
    sum_pi_squared_checkpointing: bool = False
    """verl: recompute sum pi^2 in backward; a memory tuning."""
    load_weight: bool = True
    """verl (Megatron): load the HF weights at start-up (strategy=megatron only)."""
    megatron: dict[str, Any] = field(default_factory=_megatron)
    """verl's Megatron-Core parallelism of this role (strategy=megatron only, which tiller refuses)."""
    qat: QatConfig = field(default_factory=QatConfig)
    """verl 0.10: quantization-aware training of the actor (enable refused)."""
    entropy_from_logits_chunk_size: int = 2048
    """verl 0.10: chunk size of entropy_from_logits_with_chunking; a memory tuning."""
    pad_to_length: bool = False
    """verl 0.10: pad micro-batches to a fixed bucketed length (static shapes); tiller pads each micro-batch to its
    longest row (the update is the same)."""
    model_engine: Optional[str] = None
    """verl 0.10: the actor's engine (= model_engine); only dp, megatron / veomni / torchtitan are refused."""


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: Optional[int] = 16
    """Samples per reference forward on each worker."""
    log_prob_micro_batch_size: Optional[int] = None
    """Deprecated (verl): a global size, converted to log_prob_micro_batch_size_per_gpu = this / workers."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """Token-budget micro-batches for the reference forward; None = actor.use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Padded tokens per reference micro-batch with dynamic batches; None = actor.ppo_max_token_len_per_gpu."""
    ref_model_sync_steps: Optional[int] = None
    """tiller (TRL's sync_ref_model / ref_model_sync_steps, TR-DPO): every N actor optimizer steps the reference
    becomes ref_model_mixup_alpha x policy + (1 - alpha) x reference; null = verl's frozen reference. Read with a KL
    (actor.use_kl_loss or algorithm.use_kl_in_reward); refused with LoRA (the reference is the adapter-free
    policy); checkpoints carry the moving reference."""
    ref_model_mixup_alpha: float = 0.6
    """tiller (TRL's): the mixing weight alpha of ref_model_sync_steps."""
    ulysses_sequence_parallel_size: int = 1
    """verl's Ulysses size for the reference: its forward runs in the actor's workers, split by the actor's size;
    this one scales the reference's token budget (verl's per-GPU share)."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """verl's sharding / offload knobs of the reference (no effect in tiller)."""
    rollout_n: Optional[int] = None
    """verl's copy of rollout.n (null = rollout.n; another value is an error)."""
    strategy: Optional[str] = None
    """verl's copy of actor.strategy (null = the actor's; the reference runs in the actor's worker)."""
    use_torch_compile: Optional[bool] = None
    """Compile the reference model's decoder layers (as actor.use_torch_compile does the actor's); null: the
    actor's setting."""
    profiler: dict[str, Any] = field(default_factory=_profiler)
    """verl's profiler hooks of the reference; tiller has no profiler integration."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """verl: MoE routing replay of the reference forward: disabled or R3 (the rollout's routing)."""
    entropy_from_logits_with_chunking: bool = False
    """verl: entropy in chunks to save memory; a memory tuning."""
    entropy_checkpointing: bool = False
    """verl: recompute the entropy in backward; a memory tuning."""
    load_weight: bool = True
    """verl (Megatron): load the HF weights at start-up (strategy=megatron only)."""
    megatron: dict[str, Any] = field(default_factory=_megatron)
    """verl's Megatron-Core parallelism of the reference (strategy=megatron only, which tiller refuses)."""
    entropy_from_logits_chunk_size: int = 2048
    """verl 0.10: chunk size of entropy_from_logits_with_chunking; a memory tuning."""
    pad_to_length: Optional[bool] = None
    """verl 0.10: pad micro-batches to a fixed length (null = the actor's); tiller pads each micro-batch to its
    longest row."""


@dataclass
class ValKwargsConfig:
    n: int = 1
    """Samples per validation prompt (mean@n, best@n, maj@n)."""
    do_sample: bool = False
    """Sample during validation (False = greedy)."""
    temperature: float = 0.0
    """Validation temperature."""
    top_p: float = 1.0
    """Validation top-p."""
    top_k: int = -1
    """Validation top-k (-1 = off)."""


@dataclass
class MultiTurnConfig:
    enable: bool = False
    """Multi-turn tool-using rollouts (verl's tool agent loop; tools from tool_config_path / function_tool_path), in
    tiller eval and tiller rl: rl trains each sample's assistant tokens, the tool responses masked out of the loss,
    scored on the full response with extra_info["tool_rewards"]; with async_training the producer runs the
    conversations (each token's policy version recorded; partial_rollout: new weights between decode steps)."""
    max_assistant_turns: Optional[int] = 4
    """Most assistant turns per conversation."""
    tool_config_path: Optional[str] = None
    """YAML listing the tools available to the model (with function_tool_path: both files' tools; neither: the
    built-in calculator)."""
    format: str = "hermes"
    """Tool-call format, verl's parsers: hermes (`<tool_call>{json}</tool_call>`, Qwen2.5 / Qwen3), qwen3_coder
    (Qwen3-Coder / Qwen3.5 XML), glm (GLM-4.5), seed (Seed-OSS), minimax (MiniMax-M2), gpt-oss (harmony)."""
    max_user_turns: Optional[int] = None
    """Most tool turns: after this many, the next assistant turn ends the conversation (null or 0: no limit)."""
    max_parallel_calls: int = 1
    """Tool calls run per assistant turn: the turn's first N (verl's; tiller runs them one after another)."""
    max_tool_response_length: int = 256
    """Tool responses longer than this many characters are cut (tool_response_truncate_side), as verl does."""
    tool_response_truncate_side: str = "middle"
    """Where max_tool_response_length cuts: left (keep the end) / right (keep the start) / middle (both halves),
    marked "(truncated)" as verl's."""
    interaction_config_path: Optional[str] = None
    """verl: a simulated-user interaction YAML; refused (tiller's multi-turn loop calls tools only)."""
    use_inference_chat_template: bool = False
    """verl: render the history with the inference template; tiller renders it with the tokenizer's chat template."""
    tokenization_sanity_check_mode: str = "strict"
    """verl: check incremental tokenization against a full re-render; tiller tokenizes each turn once."""
    num_repeat_rollouts: Optional[int] = None
    """verl (SGLang multi-turn): repeat rollouts; tiller's samples per prompt are rollout.n."""
    function_tool_path: Optional[str] = None
    """A Python file of verl `@function_tool` functions, the multi-turn loop's tools next to tool_config_path's (a name
    in both is an error; tiller eval and tiller rl, with multi_turn.enable); `from verl.tools.function_tool import
    function_tool` works without verl installed."""


@dataclass
class AgentConfig:
    path: Optional[str] = None
    """Agent rollout: module (pkg.mod) or .py file holding `async def run(base_url_or_client, sample) -> reward`;
    each sample runs it against tiller's OpenAI-compatible endpoint (None = off)."""
    name: str = "run"
    """The agent function's name in `path`."""
    client: str = "base_url"
    """What the agent function gets first: base_url (the episode's OpenAI base URL, a str) | openai (an
    `openai.AsyncOpenAI` client on it)."""
    max_concurrency: int = 0
    """Episodes run at once (0 = all of the step's samples)."""
    env_path: Optional[str] = None
    """Environment rollout: module or .py file holding a Gym-style env class (reset / step) or OpenRLHF's
    `AgentInstance`, driven by the built-in loop (None = off)."""
    env_name: str = "AgentInstance"
    """The environment class's name in `env_path`."""
    max_turns: int = 8
    """Environment rollout: most model turns per episode."""
    max_context: Optional[int] = None
    """Environment rollout: an episode ends when its context (prompt, actions, observations) reaches this many
    tokens (OpenRLHF's --max_len budget); null: the model's max_position_embeddings."""
    num_workers: int = 8
    """verl: agent-loop worker processes; tiller's episodes run in one event loop (bounded by max_concurrency)."""
    default_agent_loop: str = "single_turn_agent"
    """verl: the agent loop of rows without an `agent_name` column: single_turn_agent, tool_agent (multi_turn.enable)
    or a custom loop of agent_loop_config_path."""
    agent_loop_config_path: Optional[str] = None
    """verl: a YAML list of custom agent loops (`- name: ...` / `_target_: pkg.module.Class` or `file.py:Class`, plus
    constructor keywords): `AgentLoopBase` subclasses run per sample on tiller's engine (tiller.rollout.verl_agent_loop)."""
    custom_async_server: dict[str, Any] = field(default_factory=lambda: {"path": None, "name": None})
    """verl: a custom async rollout server class {path, name}; refused unless both are null."""


@dataclass
class TraceConfig:
    backend: Optional[str] = None
    """verl's rollout tracing backend (weave | mlflow); tiller records no rollout traces."""
    token2text: bool = False
    """verl: decode token ids in rollout traces."""
    max_samples_per_step_per_worker: Optional[int] = None
    """verl: cap of traced samples; tiller records no rollout traces."""
    project_name: Optional[str] = None
    """verl 0.10: the trace backend's project (null = trainer.project_name)."""
    experiment_name: Optional[str] = None
    """verl 0.10: the trace backend's experiment (null = trainer.experiment_name)."""


@dataclass
class CheckpointEngineConfig:
    """verl's `rollout.checkpoint_engine`: how new weights travel from the trainer to the rollout servers."""

    backend: str = "naive"
    """verl: naive (in-process, colocated) | nccl | hccl | nixl ...; tiller's engines live in the actor's process and
    take the weights in memory (naive), so the network backends are refused."""
    update_weights_bucket_megabytes: int = 2048
    """verl: bucket size of the weight transfer; tiller's vllm sync uses its own bucket size."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """verl: keyword arguments of the checkpoint-engine backend (no backend to pass them to)."""
    custom_backend_module: Optional[str] = None
    """verl 0.10: a module providing a custom checkpoint-engine backend (only with a backend other than naive, which
    is refused)."""


@dataclass
class RolloutConfig:
    name: str = "native"
    """Rollout engine: native (tiller's batched sampler) | hf (model.generate) | vllm."""
    n: int = 1
    """Samples per prompt (GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_k: int = -1
    """Top-k (-1 = off)."""
    top_p: float = 1.0
    """Top-p."""
    min_p: float = 0.0
    """Min-p (0 = off)."""
    repetition_penalty: float = 1.0
    """verl (vLLM's): a logit of a token already in the prompt or the response is divided by this when positive,
    multiplied when negative (> 0; 1 = off). Applies to validation too (verl's server applies it to every request);
    the rollout logprobs are then those of the penalised distribution, which the actor's forward does not reproduce."""
    presence_penalty: float = 0.0
    """tiller (vLLM's / OpenAI's): subtracted from the logit of every token already in the response ([-2, 2]; 0 = off);
    training and validation, as repetition_penalty."""
    frequency_penalty: float = 0.0
    """tiller (vLLM's / OpenAI's): this times a token's count in the response so far is subtracted from its logit
    ([-2, 2]; 0 = off); training and validation, as repetition_penalty."""
    structured_outputs_regex: Optional[str] = None
    """tiller (TRL's vllm_structured_outputs_regex, vLLM's structured_outputs regex): every response must match this
    regular expression in full (llguidance's dialect: Rust regex); tokens that cannot continue a match are masked,
    eos is allowed once the text matches. Training and validation; native and vllm engines. The rollout logprobs are
    those of the masked distribution, which the actor's forward does not reproduce (as with vLLM in TRL / verl)."""
    do_sample: bool = True
    """Sample (False = greedy)."""
    prompt_length: Optional[int] = None
    """Defaults to data.max_prompt_length."""
    response_length: Optional[int] = None
    """Defaults to data.max_response_length."""
    response_length_schedule: list[list[int]] = field(default_factory=list)
    """Skywork-OR1 multi-stage length: [[from_step, max_response_length], ...]."""
    stop: list[str] = field(default_factory=list)
    """Extra stop strings."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    dtype: str = "bfloat16"
    """Rollout compute dtype: bfloat16 | float32."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = 16
    """Samples per old-logprob forward on each worker."""
    log_prob_micro_batch_size: Optional[int] = None
    """Deprecated (verl): a global size, converted to log_prob_micro_batch_size_per_gpu = this / workers."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """Token-budget micro-batches for the old-logprob forward; None = actor.use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Padded tokens per old-logprob micro-batch with dynamic batches; None = actor.ppo_max_token_len_per_gpu."""
    mode: str = "sync"
    """verl: sync (SPMD engine) | async (server + agent loop); tiller's engines run in the worker either way."""
    load_format: str = "dummy_dtensor"
    """verl: how vLLM initialises weights before the first sync; tiller's vllm loads model.path."""
    layered_summon: bool = False
    """verl: gather LoRA FSDP weights layer by layer for the sync; tiller merges the adapters at once."""
    enable_chunked_prefill: bool = True
    """vLLM chunked prefill (rollout.name=vllm)."""
    gpu_memory_utilization: float = 0.5
    """vLLM: fraction of GPU memory for weights + KV cache."""
    tensor_model_parallel_size: int = 1
    """vLLM tensor parallel size."""
    enforce_eager: Optional[bool] = None
    """vLLM: False enables CUDA graphs (and torch.compile); null = True (eager, tiller's vllm default). native on CUDA: null
    (the default) or False decodes with the static-shape step captured in CUDA graphs per batch-size bucket, each
    layer compiled by Inductor where Triton is installed (tiller.rollout.graphed_decode, vLLM's default), True decodes
    eagerly. native on CPU: False compiles the fused decode step with
    torch.compile (tiller.rollout.compiled_decode: needs a C++ compiler; ~10-30 s to compile once per process,
    then a few % faster per step), null or True decodes eagerly. hf: no effect."""
    free_cache_engine: bool = True
    """vLLM: release the KV cache between rollouts (sleep/wake)."""
    max_num_batched_tokens: int = 8192
    """vLLM scheduler budget."""
    calculate_log_probs: bool = True
    """Return the sampler's per-token logprobs."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """Sampling for validation (greedy by default)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn tool-using rollouts."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Agent rollouts through the OpenAI-compatible endpoint, or environments driven by the built-in loop."""
    trace: TraceConfig = field(default_factory=TraceConfig)
    """verl's rollout tracing (no effect in tiller)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the engine (open-ended: use +key=value)."""
    cudagraph_capture_sizes: Optional[list[int]] = None
    """The batch sizes the native engine captures CUDA graphs for (null: vLLM's 1, 2, 4, then multiples of 8 up to
    max_num_seqs); a batch runs at the smallest size holding it. rollout.name=vllm: vLLM's
    compilation_config.cudagraph_capture_sizes, as verl passes it."""
    data_parallel_size: int = 1
    """verl: data-parallel rollout replicas inside one engine; refused unless 1 (one engine per worker)."""
    expert_parallel_size: int = 1
    """verl: expert parallelism of the engine (MoE); refused unless 1."""
    pipeline_model_parallel_size: int = 1
    """verl: pipeline parallelism of the engine; refused unless 1."""
    max_model_len: Optional[int] = None
    """verl: the engine's context limit; tiller's is prompt + response length."""
    max_num_seqs: int = 256
    """verl: the sequences an engine decodes together: the native engine decodes its rows in waves of this many (and
    captures CUDA graphs up to it); vLLM's max_num_seqs when set (unset: vLLM's default for its device, e.g. 256 on a
    CPU, 1024 on an H100). engine_kwargs.max_num_seqs wins where both are set."""
    enable_prefix_caching: bool = True
    """verl: vLLM prefix caching (rollout.name=vllm; passed when set, else vLLM's default for the model)."""
    logprobs_mode: str = "processed_logprobs"
    """verl: which logprobs the engine returns; tiller's engines return those of the distribution sampled from
    (after temperature / top-k / top-p): processed_logprobs, the only value accepted."""
    scheduling_policy: str = "fcfs"
    """verl: vLLM's scheduling policy, fcfs or priority (rollout.name=vllm, when set; tiller's requests carry no
    priority)."""
    disable_log_stats: bool = True
    """verl: turn vLLM's periodic stats logging off (rollout.name=vllm, when set)."""
    over_sample_rate: float = 0.0
    """verl: abort the slowest fraction of a batch's generations; refused unless 0 (tiller waits for every sample)."""
    multi_stage_wake_up: bool = False
    """verl: wake the vLLM engine's weights and KV cache in two stages; a GPU memory tuning."""
    skip_tokenizer_init: bool = True
    """verl: start the engine without a tokenizer; tiller's engines decode with the actor's tokenizer."""
    skip_rollout: bool = False
    """verl: replay rollouts dumped to skip_dump_dir instead of generating (debugging); refused."""
    skip_dump_dir: str = "/tmp/rollout_dump"
    """verl: the dump dir of skip_rollout (refused)."""
    enable_rollout_routing_replay: bool = False
    """verl: the rollout engine records each token's experts (MoE models) for R3 routing replay
    (actor.router_replay.mode=R3); the native engine, whose calls then decode with the fused or compiled step."""
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)
    """verl: the weight-transfer backend between trainer and rollout servers."""
    profiler: dict[str, Any] = field(default_factory=_rollout_profiler)
    """verl's profiler hooks of the rollout; tiller has no profiler integration."""
    prometheus: dict[str, Any] = field(default_factory=lambda: {
        "enable": False, "port": 9090, "file": "/tmp/ray/session_latest/metrics/prometheus/prometheus.yml",
        "served_model_name": None})
    """verl: a Prometheus exporter of the rollout servers; tiller's metrics go to trainer.logger."""
    quantization: Optional[str] = None
    """verl: quantized rollout (e.g. fp8); refused (tiller's engines run the actor's weights unquantized)."""
    quantization_config_file: Optional[str] = None
    """verl: the quantization config of rollout.quantization (refused)."""
    mtp: Any = None
    """verl's copy of model.mtp for the engine (MTP is refused)."""
    layer_name_map: dict[str, Any] = field(default_factory=lambda: {"qkv_layer_name": "qkv",
                                                                    "gate_proj_layer_name": "gate_up"})
    """verl (Megatron): layer names for the weight sync of fused layers (strategy=megatron only)."""
    nnodes: int = 0
    """verl 0.10: nodes of a standalone rollout pool (0 = the rollout shares the trainer's GPUs, verl's hybrid
    engine, which is tiller's layout)."""
    n_gpus_per_node: Optional[int] = None
    """verl 0.10: GPUs per node of a standalone rollout pool (null = trainer.n_gpus_per_node)."""
    full_determinism: bool = False
    """verl 0.10: deterministic inference kernels in the engine; a GPU setting (tiller's engines are deterministic
    per seed on CPU)."""
    seed: int = 42
    """verl 0.10: the engine's seed; tiller seeds sampling from trainer.seed (per step and sample)."""
    moe_load_balance_metrics_interval: int = 0
    """verl 0.10: every N steps (0 = off), log `rollout/moe/{max,min,avg}_vio/...`: each MoE layer's expert load
    over the response tokens of the steps since the last log, against a uniform load (verl's formula). Counts the
    routing the native engine records (enable_rollout_routing_replay=True, with or without R3), or R2's."""
    qat: Any = None
    """verl 0.10: the engine's copy of the actor's QAT settings (actor qat.enable is refused)."""
    disaggregation: dict[str, Any] = field(default_factory=v010.disaggregation)
    """verl 0.10: prefill / decode on separate engine replicas (SGLang / vLLM with nixl); refused unless at its
    defaults (tiller's engine prefills and decodes in one loop)."""


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    """Actor, rollout and reference share one worker (verl's hybrid engine). False, verl fully-async's split layout:
    asynchronous RL with trainer.backend=ray, whose rollout pool (rollout.nnodes x rollout.n_gpus_per_node) generates
    apart from the trainer's workers; refused otherwise (there is no other split layout)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy training."""
    ref: RefConfig = field(default_factory=RefConfig)
    """Reference policy (used for KL)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    nccl_timeout: int = 600
    """verl: NCCL timeout (s) of the actor's process group; tiller's groups use torch's default."""
    checkpoint_engine: Any = None
    """verl fully-async's copy of async_training.checkpoint_engine."""


# --------------------------------------------------------------------------------------------- critic


@dataclass
class CriticModelConfig:
    path: Optional[str] = None
    """Critic model dir; defaults to actor_rollout_ref.model.path (a value head is added)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer dir; defaults to the critic's model path."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Keys set on the critic's HF config before it is built (open-ended), `attn_implementation` included."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in backward."""
    trust_remote_code: bool = False
    """Pass trust_remote_code to from_pretrained."""
    use_remove_padding: bool = False
    """The critic's forwards with each micro-batch's rows packed into one sequence without padding, as the actor's
    (tiller.workers.packed); False: padded rows, trimmed per micro-batch. Needed by ulysses_sequence_parallel_size."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """verl's sharding / offload knobs of the critic (no effect in tiller)."""
    external_lib: Optional[str] = None
    """verl: module imported before loading the critic; tiller imports actor_rollout_ref.model.external_lib once for
    every model of the run."""
    use_shm: bool = False
    """verl: copy the model to /dev/shm before loading; tiller loads from the path."""
    enable_activation_offload: bool = False
    """verl: offload activations to CPU in backward; a GPU memory tuning tiller does not have."""
    lora_rank: int = 0
    """LoRA rank of the critic's body (0 = the critic trains in full); with LoRA the value head trains in full, as in
    verl's FSDP critic, and the optimizer holds the adapters and the head only."""
    load_in_4bit: bool = False
    """tiller (OpenRLHF's --load_in_4bit quantizes the critic too): QLoRA on the critic, its body's linear layers
    loaded as bitsandbytes 4-bit weights, frozen, LoRA adapters and the value head (full precision) training; needs
    critic LoRA and the bitsandbytes package; one process (trainer.backend=local)."""
    bnb_4bit_quant_type: str = "nf4"
    """tiller: with load_in_4bit, nf4 (QLoRA's NormalFloat4) | fp4."""
    bnb_4bit_use_double_quant: bool = False
    """tiller: with load_in_4bit, the block scales quantized too."""
    lora_alpha: int = 16
    """LoRA alpha of the critic (scale = alpha / rank)."""
    lora_dropout: float = 0.0
    """tiller (OpenRLHF's --lora_dropout): dropout on the critic's adapters in its update's forward only; the values
    the advantages use are computed in eval mode, without it. Needs critic LoRA; in [0, 1)."""
    use_rslora: bool = False
    """tiller (peft's use_rslora): the critic's adapters scaled by lora_alpha / sqrt(rank)."""
    use_dora: bool = False
    """tiller (peft's use_dora): DoRA adapters on the critic's body."""
    target_modules: Any = "all-linear"
    """LoRA targets of the critic: a list of module names or 'all-linear' (every linear layer of the body; the value
    head is never adapted, it trains in full)."""
    target_parameters: Any = None
    """tiller (peft's target_parameters, TRL's lora_target_parameters): with the critic's LoRA, parameters adapted by name besides
    target_modules: a mixture-of-experts model's experts (transformers stores each layer's experts as 3-D parameters,
    which 'all-linear' does not reach), e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj]; a list of parameter
    names (suffixes of full names)."""
    lora: dict[str, Any] = field(default_factory=lambda: {"rank": 0, "alpha": 32, "merge": False,
                                                           "adapter_path": None,
                                                           "target_modules": ["linear_qkv", "linear_proj",
                                                                              "linear_fc1", "linear_fc2"],
                                                           **_megatron_lora()})
    """verl (Megatron): the critic's LoRA section (strategy=megatron only, which tiller refuses)."""
    tiled_mlp: dict[str, Any] = field(default_factory=lambda: {"enabled": False, "num_shards": 4})
    """verl: tiled MLP to save activation memory; a memory tuning tiller does not have."""
    hf_config_path: Optional[str] = None
    """verl: read the critic's HF config from another dir; refused (tiller reads critic.model.path's config.json)."""
    custom_chat_template: Optional[str] = None
    """verl: a chat template for the critic's tokenizer; the critic reads the actor's token ids (no template)."""
    exclude_modules: Any = None
    """Critic LoRA: modules left out of target_modules (peft's exclude_modules): a list of module names, or a regex
    string matched against full module names."""
    modules_to_save: Any = None
    """tiller (peft's modules_to_save): with the critic's LoRA, body modules trained in full beside the adapters and
    the value head (a list of module names)."""
    lora_adapter_path: Optional[str] = None
    """Continue the critic from a saved LoRA adapter of a value model (task_type TOKEN_CLS: a tiller critic
    checkpoint's model/, checkpoints/critic/global_step_N/model), loaded trainable onto critic.model.path with its
    value head; rank, alpha and targets come from its adapter_config.json (the LoRA keys left at their defaults, or
    set to the same values). LoRA is on with it even at lora_rank=0."""
    use_liger: bool = False
    """verl: Liger fused kernels; tiller runs the Hugging Face modelling code."""
    use_fused_kernels: bool = False
    """verl: fused kernels for the critic; none in tiller."""
    fused_kernel_options: dict[str, Any] = field(default_factory=lambda: {"impl_backend": "torch"})
    """verl: backend of use_fused_kernels (no fused kernels in tiller's critic)."""
    mtp: MtpConfig = field(default_factory=MtpConfig)
    """verl: multi-token prediction settings copied into the critic's model config; a value model has no MTP."""


@dataclass
class CriticConfig:
    strategy: str = "fsdp"
    """Parallel strategy when trainer.backend=ray: fsdp | ddp | none."""
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """The value model."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    """Critic optimizer (verl: lr 1e-5)."""
    ppo_mini_batch_size: Optional[int] = None
    """Prompts per critic optimizer step; defaults to the actor's."""
    ppo_micro_batch_size_per_gpu: Optional[int] = 8
    """Samples per critic forward/backward on each worker."""
    ppo_micro_batch_size: Optional[int] = None
    """Deprecated (verl): a global size, converted to ppo_micro_batch_size_per_gpu = this / workers (and
    forward_micro_batch_size_per_gpu too, unless forward_micro_batch_size is given)."""
    forward_micro_batch_size_per_gpu: Optional[int] = 16
    """Samples per value forward on each worker."""
    forward_micro_batch_size: Optional[int] = None
    """Deprecated (verl): a global size, converted to forward_micro_batch_size_per_gpu = this / workers."""
    use_dynamic_bsz: Optional[bool] = None
    """Token-budget micro-batches for the critic; None = actor_rollout_ref.actor.use_dynamic_bsz."""
    ppo_max_token_len_per_gpu: int = 32768
    """With use_dynamic_bsz: padded tokens per critic update micro-batch."""
    forward_max_token_len_per_gpu: Optional[int] = None
    """With use_dynamic_bsz: padded tokens per value-forward micro-batch; None = ppo_max_token_len_per_gpu."""
    ulysses_sequence_parallel_size: int = 1
    """verl's Ulysses sequence parallelism for the critic, as actor.ulysses_sequence_parallel_size: with
    trainer.backend=ray and several workers, groups of this many workers split each packed micro-batch (needs
    critic.model.use_remove_padding=True); one process runs whole sequences and this only scales the token budgets."""
    ppo_epochs: Optional[int] = None
    """Critic passes per batch; defaults to the actor's."""
    shuffle: bool = False
    """Shuffle samples before splitting into mini-batches (seeded, as actor.shuffle)."""
    grad_clip: float = 1.0
    """Max global grad norm."""
    cliprange_value: float = 0.5
    """Value clipping range."""
    loss_agg_mode: Optional[str] = None
    """Aggregation of the value loss; null = actor_rollout_ref.actor.loss_agg_mode (verl's default,
    ${oc.select:actor_rollout_ref.actor.loss_agg_mode,token-mean})."""
    dtype: str = "float32"
    """Training compute dtype: float32 | bfloat16. Unset, as the actor's: model.fsdp_config.mixed_precision.param_dtype
    where given, else bfloat16 where trainer.device=cuda and float32 on a CPU."""
    update_lanes: int = 1
    """tiller (CPU, one process): the critic update's micro-batches run this many at a time, each in its own
    thread (as actor_rollout_ref.actor.update_lanes, async_training.share_idle_threads included)."""
    share_prompt_forward: bool = True
    """Run each distinct prompt of a micro-batch once and reuse its KV cache for all its samples (exact;
    as actor.share_prompt_forward). Off under gradient checkpointing."""
    enable: Optional[bool] = None
    """verl: train a critic (null = when algorithm.adv_estimator needs one); tiller trains one exactly for gae, so a
    value that disagrees with the estimator is an error."""
    rollout_n: Optional[int] = None
    """verl's copy of rollout.n (null = rollout.n; another value is an error)."""
    data_loader_seed: int = 42
    """verl: seed of the critic's mini-batch shuffle; tiller seeds it from trainer.seed."""
    checkpoint: dict[str, Any] = field(default_factory=_checkpoint)
    """verl: {save_contents, load_contents, async_save}; tiller saves and loads model, optimizer and trainer state
    together, synchronously."""
    profiler: dict[str, Any] = field(default_factory=_profiler)
    """verl's profiler hooks of the critic; tiller has no profiler integration."""
    nccl_timeout: int = 600
    """verl: NCCL timeout (s) of the critic's process group; tiller's groups use torch's default."""
    load_weight: bool = True
    """verl (Megatron): load the HF weights at start-up (strategy=megatron only)."""
    megatron: dict[str, Any] = field(default_factory=_megatron)
    """verl's Megatron-Core parallelism of the critic (strategy=megatron only, which tiller refuses)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """verl 0.10's place of the critic's sharding / offload knobs (critic.model.fsdp_config before); no effect."""
    loss_scale_factor: Optional[float] = None
    """The value loss's constant of seq-mean-token-sum-norm (null = actor.loss_scale_factor, verl's default; both
    null = the padded response length)."""


# --------------------------------------------------------------------------------------------- reward


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None
    """Reward model dir (AutoModelForSequenceClassification, or a causal LM with value head)."""
    input_tokenizer: Optional[str] = None
    """verl: the policy's tokenizer, to re-render responses when the RM's differs; tiller always hands the
    RM decoded text rendered with the RM's own chat template, which is what this key switches on in verl."""
    trust_remote_code: Optional[bool] = False
    """Pass trust_remote_code to from_pretrained."""
    use_remove_padding: bool = False
    """verl: pack sequences without padding; tiller pads."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """verl's sharding / offload knobs of the reward model (no effect in tiller)."""
    external_lib: Optional[str] = None
    """verl: module imported before loading the RM; tiller imports actor_rollout_ref.model.external_lib once."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """verl: keys overriding the RM's HF config; refused unless empty (tiller loads the RM's config as saved)."""
    use_shm: bool = False
    """verl: copy the model to /dev/shm before loading; tiller loads from the path."""
    use_fused_kernels: bool = False
    """verl's copy of actor_rollout_ref.model.use_fused_kernels (no fused kernels in tiller's reward model)."""


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    """DAPO overlong shaping: penalise responses in the last `len` tokens before the limit."""
    len: int = 16
    """Buffer length L_buf (tokens)."""
    penalty_factor: float = 1.0
    """Penalty at the limit."""
    log: bool = False
    """Log the penalty as a reward component."""


@dataclass
class DiversityConfig:
    enable: bool = False
    """DARLING diversity-aware reward."""
    partitioner: str = "ngram"
    """How responses are grouped into equivalence classes: exact | ngram | embedding | llm | classifier (a
    trained pair classifier from `tiller train-partitioner`, at classifier_path)."""
    fusion: str = "multiplicative"
    """multiplicative (paper) | additive."""
    weight: float = 1.0
    """Weight of the diversity term for additive fusion."""
    ngram_n: int = 2
    """n of the n-gram Jaccard partitioner."""
    threshold: float = 0.5
    """Similarity at or above which two responses are the same class (jaccard / cosine / the classifier's
    P(same), in [0, 1]: DARLING uses 0.5)."""
    embedding_model: Optional[str] = None
    """Sentence-embedding model dir for the embedding partitioner."""
    llm_url: Optional[str] = None
    """OpenAI-compatible endpoint for the LLM judge partitioner."""
    llm_model: Optional[str] = None
    """Model name sent to the LLM judge endpoint."""
    classifier_path: Optional[str] = None
    """Pair classifier for partitioner=classifier: a model dir (`tiller train-partitioner --out DIR`) or the
    http(s) URL of one served by vLLM (`/classify`, DARLING's setup)."""
    classifier_tokenizer: Optional[str] = None
    """With a served classifier_path: its tokenizer (dir or hub id), whose cls / sep tokens join the pair."""
    classifier_model: Optional[str] = None
    """With a served classifier_path: the model name sent to /classify (default "default")."""
    short_answer_tokens: int = 5
    """Answers of at most this many tokens are compared by unigram overlap."""


@dataclass
class RewardModelConfig:
    enable: Optional[bool] = False
    """Score with a reward model."""
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    """The reward model."""
    micro_batch_size_per_gpu: Optional[int] = 16
    """Samples per reward-model forward."""
    micro_batch_size: Optional[int] = None
    """Deprecated (verl): a global size, converted to micro_batch_size_per_gpu = this / workers."""
    use_dynamic_bsz: Optional[bool] = None
    """Token-budget micro-batches for the reward model; None = critic.use_dynamic_bsz."""
    forward_max_token_len_per_gpu: Optional[int] = None
    """Tokens (rows x longest sequence) per reward-model micro-batch with dynamic batches; None =
    critic.forward_max_token_len_per_gpu."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the reward manager (verl): dapo takes overlong_buffer_cfg {enable, len,
    penalty_factor, log} and max_resp_len (open-ended: use +key=value)."""
    max_length: Optional[int] = None
    """Longest prompt + response the RM sees."""
    reward_manager: Optional[str] = "naive"
    """naive | batch | parallel | prime (verl's: parallel with 300 s a sample) | dapo | openrlhf (a batched OpenRLHF
    reward_func(queries, prompts, labels) in custom_reward_function.path) | gdpo (verl 0.10's name for naive with dict
    scores, for adv_estimator=gdpo)."""
    num_workers: Optional[int] = 2
    """Processes of the parallel reward manager."""
    bad_ground_truth: str = "error"
    """tiller: a row whose ground truth has the wrong type for its data_source's rule scorer (a dict where the
    scorer compares a string): error (refused at load, naming file, row and field) | count (the row's samples
    score 0, counted in reward/bad_ground_truth each step and reported at the end of the run)."""
    timeout: float = 30.0
    """tiller: seconds per reward-function call (naive / dapo: per sample, batch: per batch, parallel: per sample
    in its worker) or per remote request; a call past it scores 0 and is counted in reward/num_timeouts."""
    remote_url: Optional[str] = None
    """HTTP endpoint of a remote reward server."""
    remote_format: str = "tiller"
    """Wire format of remote_url: tiller ({prompts, responses, labels} -> {scores}) | openrlhf ({query, prompts,
    labels} -> {rewards, scores, extra_logs}, OpenRLHF's serve_rm / remote reward functions)."""
    clip_range: Optional[list[float]] = None
    """Clip the base scores to [low, high] (OpenRLHF's --reward_clip_range); None = no clipping."""
    normalize: bool = False
    """Reward model: (score - mean) / std with the mean / std stored in its config.json (OpenRLHF's
    --normalize_reward; tiller rm writes them)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO overlong reward shaping."""
    stop_properly_penalty_coef: Optional[float] = None
    """tiller (OpenRLHF's --reward.stop_properly_penalty_coef, ProRL): the reward of a truncated response (finish
    reason length) is scaled by the coefficient in [0, 1], or replaced by it when negative (e.g. -0.5); applied to
    the reward the advantages see (after the score filter_groups reads); null = off."""
    diversity: DiversityConfig = field(default_factory=DiversityConfig)
    """DARLING diversity-aware reward."""
    strategy: str = "fsdp"
    """verl: the RM worker's strategy; tiller runs the RM forward in its own process (megatron is refused)."""
    enable_resource_pool: Optional[bool] = False
    """verl: a separate GPU pool for the reward model; tiller runs the RM next to the trainer."""
    n_gpus_per_node: Optional[int] = 8
    """verl: GPUs per node of the RM's own pool (enable_resource_pool)."""
    nnodes: Optional[int] = 0
    """verl: nodes of the RM's own pool (enable_resource_pool)."""
    reward_loop_source: Optional[str] = "register"
    """verl 0.9: where the reward manager class comes from (register | importlib: reward_loop_module_path's file,
    reward_loop_class_name; as reward.reward_manager.source)."""
    reward_loop_module_path: Optional[str] = None
    """verl 0.9: the custom reward manager's .py file (with reward_loop_source=importlib)."""
    reward_loop_class_name: Optional[str] = None
    """verl 0.9: the custom reward manager's class name."""
    launch_reward_fn_async: bool = False
    """verl: score rewards in a Ray task overlapping the old-logprob forward; tiller scores them in the driver (the
    parallel reward manager runs them in processes)."""
    use_reward_loop: bool = True
    """verl: its reward-loop implementation (vs the legacy reward worker); tiller has one reward path."""
    sandbox_fusion: dict[str, Any] = field(default_factory=lambda: {"url": None, "max_concurrent": 64,
                                                                     "memory_limit_mb": 1024})
    """verl: a SandboxFusion code-execution service {url, max_concurrent, memory_limit_mb}: with url set, the code data
    sources codecontests / apps / codeforces / taco are scored on it, as verl (tiller.rewards.sandbox_fusion)."""
    profiler: dict[str, Any] = field(default_factory=_profiler)
    """verl's profiler hooks of the reward model; tiller has no profiler integration."""
    ulysses_sequence_parallel_size: int = 1
    """verl's Ulysses sequence parallelism for the reward model (tiller runs whole sequences)."""
    rollout: dict[str, Any] = field(default_factory=lambda: {
        "name": None, "dtype": "bfloat16", "gpu_memory_utilization": 0.5, "enforce_eager": True,
        "cudagraph_capture_sizes": None, "free_cache_engine": True, "data_parallel_size": 1,
        "expert_parallel_size": 1, "tensor_model_parallel_size": 2, "max_num_batched_tokens": 8192,
        "max_model_len": None, "max_num_seqs": 1024, "load_format": "auto", "engine_kwargs": {},
        "limit_images": None, "enable_chunked_prefill": True, "enable_prefix_caching": True,
        "disable_log_stats": True, "skip_tokenizer_init": False, "prompt_length": 2048, "response_length": 2048})
    """verl: the engine serving a generative reward model in its reward loop; tiller's reward model is a sequence
    classifier (reward_model.model.path) or reward_model.remote_url, so this section has no effect."""
    nccl_timeout: int = 600
    """verl: NCCL timeout (s) of the RM's process group."""
    load_weight: bool = True
    """verl (Megatron): load the HF weights at start-up (strategy=megatron only)."""
    megatron: dict[str, Any] = field(default_factory=_megatron)
    """verl's Megatron-Core parallelism of the reward model (strategy=megatron only, which tiller refuses)."""


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    """Python file defining the reward function."""
    name: Optional[str] = "compute_score"
    """Function name: compute_score(data_source, solution_str, ground_truth, extra_info)."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the function (open-ended: use +key=value)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO overlong shaping where the first DAPO recipe put it (the same as reward_model.overlong_buffer)."""


# ------------------------------------------------------------------------------------------ algorithm


@dataclass
class KLControlConfig:
    type: str = "fixed"
    """fixed | adaptive."""
    kl_coef: float = 0.001
    """Initial / fixed KL coefficient."""
    horizon: int = 10000
    """Adaptive controller horizon."""
    target_kl: float = 0.1
    """Adaptive controller target KL."""


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling / Skywork online filtering: drop groups whose metric is constant."""
    metric: Optional[str] = "acc"
    """acc | score | seq_reward | seq_final_reward."""
    max_num_gen_batches: int = 0
    """Most generation rounds per step while collecting train_batch_size groups that pass the filter
    (0 = no cap, as DAPO); at the cap the step trains on the groups collected so far."""
    max_inflight_gen_batches: int = 1
    """verl 0.10 (v1 trainer): generation batches in flight at once while filling a DAPO step; tiller generates
    them one after another (verl's default 1)."""


@dataclass
class RolloutCorrectionConfig:
    """verl's `algorithm.rollout_correction` (decoupled mode): weights and masks from p_old / p_rollout, computed
    by the driver after KL in reward (`tiller.algos.rollout_correction`); turning either on makes the actor
    compute old logprobs even when the update is on-policy."""

    rollout_is: Optional[str] = None
    """Importance sampling of the policy gradient by p_old / p_rollout: null (off) | token | sequence."""
    rollout_is_threshold: str = "2.0"
    """verl's string-or-float form: a float C caps the weights at C (truncated IS); "lo_hi" (e.g. 0.5_2.0) is
    IcePop: weights outside [lo, hi] are set to 0 (the tokens stay in the loss mask)."""
    rollout_is_batch_normalize: bool = False
    """Divide the importance weights by their batch mean (tokens, or sequences for rollout_is=sequence)."""
    rollout_rs: Optional[str] = None
    """Rejection (masking) of tokens / sequences, comma-separated: token_k1 | seq_sum_k1 | seq_mean_k1 (verl's k1 =
    log(p_rollout / p_old), per token / summed / averaged, in [log lo, log hi]) | token_k2 | token_k3 |
    seq_{sum,mean,max}_k{2,3} (divergence <= threshold); null = off."""
    rollout_rs_threshold: Optional[str] = None
    """Bounds of rollout_rs: k1 options "lo_hi" (e.g. 0.5_2.0; as verl, they bound p_rollout / p_old, so bounds
    [a, b] on p_old / p_rollout are written 1/b_1/a) or hi (lo = 1/hi); k2/k3 options an upper bound; one value for
    all options or one per option, comma-separated."""
    bypass_mode: bool = False
    """Bypass mode: the rollout engine's logprobs are the old logprobs (no recompute forward); the IS weights and
    rejection above are computed inside the loss from the current policy (policy loss `bypass_mode`)."""
    loss_type: str = "ppo_clip"
    """Bypass mode's loss: ppo_clip (PPO clip against the rollout policy, no IS weight) | reinforce (-A w logp)."""


@dataclass
class DistillConfig:
    """On-policy distillation / GKD (`tiller.algos.distill`): the student samples as usual, a frozen teacher scores
    the student's sampled tokens, and the loss adds the per-token reverse KL (student log p - teacher log p) as a
    per-token advantage (Thinking Machines' on-policy distillation; verl's `distillation.*`, which resolves onto
    these keys); or, with loss_mode=gjsd, the generalized JSD to the teacher's whole next-token distribution at each
    response position (TRL's DistillationTrainer). On when teacher_path (or teachers) is set."""

    teacher_path: Optional[str] = None
    """A Hugging Face model dir (or hub id) with the student's tokenizer (same vocabulary): the teacher, frozen."""
    teachers: dict[str, str] = field(default_factory=dict)
    """Several teachers (verl 0.10's multi-teacher on-policy distillation): {routing value: model dir}; each sample is
    scored by the teacher its prompt row's `teacher_key` column names (a training row whose value has no teacher is
    an error at start). Each has the student's vocabulary; the loss settings are shared. Exclusive with
    teacher_path."""
    teacher_key: str = "data_source"
    """With `teachers`: the prompt column whose value picks a sample's teacher (verl's distillation.teacher_key)."""
    coef: float = 1.0
    """Weight of the distillation loss next to the outcome-reward loss (verl: distillation_loss_coef; as verl, it
    applies only with use_outcome_reward, the distillation loss alone has weight 1)."""
    use_outcome_reward: bool = True
    """Also train on the outcome reward (the advantage estimator's policy loss), verl's use_task_rewards; false:
    pure distillation (the reward is still computed and logged)."""
    outcome_coef: float = 1.0
    """Weight of the outcome-reward policy loss when use_outcome_reward (verl: task_loss_coef)."""
    loss_mode: str = "k1"
    """Per-token estimator of KL(student || teacher) on the sampled tokens: k1 (= kl) | abs | k2 (= mse) | k3
    (= low_var_kl); or gjsd (tiller's; TRL's DistillationTrainer loss): the generalized Jensen-Shannon divergence
    over the full vocabulary at each response position (algorithm.distill.beta), supervised
    (use_policy_gradient=false), no clamps."""
    beta: float = 1.0
    """gjsd only: 0 = forward KL(teacher || student), 1 = reverse KL(student || teacher) (TRL's default), in between
    the JSD of the mixture (1 - beta) p_student + beta p_teacher. At the rollout temperature, as the student's
    log-probs."""
    use_policy_gradient: bool = True
    """true: -estimator as a per-token advantage in the PPO clipped surrogate (Thinking Machines); false: the
    estimator backpropagated as a supervised loss (not with k1: its gradient ignores the teacher)."""
    loss_max_clamp: Optional[float] = 10.0
    """Clamp the per-token estimator to [-c, c] (null: no clamp)."""
    log_prob_min_clamp: Optional[float] = -10.0
    """Clamp student and teacher log-probs below at this value before the estimator (null: no clamp)."""
    clip_ratio_low: Optional[float] = None
    """The distillation surrogate's lower clip epsilon; null = actor.clip_ratio_low (or clip_ratio)."""
    clip_ratio_high: Optional[float] = None
    """The distillation surrogate's upper clip epsilon; null = actor.clip_ratio_high (or clip_ratio). Its dual-clip
    constant is 3.0, as verl's (whose distillation loss config has no clip_ratio_c), not actor.clip_ratio_c."""


@dataclass
class PrimeConfig:
    """PRIME (Cui et al. 2025, arXiv 2502.01456; `tiller.algos.prime`), read with algorithm.adv_estimator=prime: an
    implicit process reward model (a causal LM, trained online each step on the step's samples with the outcome
    labels) gives dense token rewards beta * log(pi_prm / pi_ref). Defaults: verl's recipe/prime."""

    model_path: Optional[str] = None
    """The PRM's initial weights (also its frozen reference); null = actor_rollout_ref.model.path (verl:
    reward_model.model.path)."""
    beta_train: float = 0.05
    """beta of the implicit reward beta * sum_t log(pi_prm / pi_ref), in its loss and its token rewards."""
    lr: float = 1e-6
    """The PRM's AdamW learning rate (constant; the actor's betas / eps, weight decay 0)."""
    grad_clip: float = 1.0
    """The PRM's gradient-norm clip."""
    mini_batch_size: Optional[int] = None
    """Prompts per PRM optimizer step; null = actor.ppo_mini_batch_size (verl's default)."""
    granularity: str = "token"
    """token: the dense reward on every response token | whole: its sum on the last token (verl: prime_granularity)."""
    norm: str = "batch_norm"
    """batch_norm: divide the dense rewards by the batch's largest |return| | none (verl: prime_norm)."""
    reward_dpo_coef: float = 5.0
    """Weight of the (leave-one-out) dense implicit rewards (verl: algorithm.reward_dpo_coef)."""
    reward_gt_coef: float = 5.0
    """Weight of the (leave-one-out) outcome reward (verl: algorithm.reward_gt_coef)."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    """gae | grpo | grpo_vectorized | grpo_passk | rloo | rloo_vectorized | remax | reinforce_plus_plus |
    reinforce_plus_plus_baseline | opo | gpg | gdpo | optimal_token_baseline | tir_optimal_token_baseline |
    prime (algorithm.prime.*)."""
    gdpo_reward_keys: list[str] = field(default_factory=list)
    """gdpo: the named scores of the reward function's dict return, each normalised per group separately."""
    gdpo_reward_weights: Optional[list[float]] = None
    """gdpo: one weight per gdpo_reward_keys entry; None = all 1."""
    gdpo_normalization: str = "token"
    """tiller: gdpo's batch normalisation of the weighted sum: token (verl: whitened over the batch's valid tokens; a
    sample missing a named score is an error) | sequence (TRL's multi_objective_aggregation=normalize_then_sum: (S -
    mean S) / (std S + norm_adv_epsilon) over the samples, and a NaN score - TRL's None - contributes 0)."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group std (False = Dr.GRPO)."""
    norm_adv_epsilon: float = 1e-6
    """tiller: the epsilon of GRPO's (r - mean) / (std + epsilon) (grpo, grpo_passk, gdpo; verl's 1e-6, TRL's 1e-4)."""
    norm_adv_std_scope: str = "group"
    """tiller, grpo: the std dividing the advantages: group (GRPO) | batch (the whole batch's: TRL's
    scale_rewards="batch")."""
    use_kl_in_reward: bool = False
    """Subtract beta * KL(actor || ref) from the token rewards."""
    kl_penalty: str = "kl"
    """KL estimator for KL-in-reward: kl | abs | mse | low_var_kl."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """KL-in-reward coefficient controller."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """Online filtering of groups with no learning signal."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Correct for the rollout engine sampling from a slightly different policy than the actor (TIS / masking)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher model (off unless distill.teacher_path is set)."""
    prime: PrimeConfig = field(default_factory=PrimeConfig)
    """PRIME's implicit process reward model (read with adv_estimator=prime)."""
    use_pf_ppo: bool = False
    """Preference-feedback PPO (PF-PPO, as verl: with adv_estimator=gae): after the advantages, the step's batch is
    redrawn with replacement, each sample with probability proportional to a weight of its score (pf_ppo)."""
    pf_ppo: dict[str, Any] = field(default_factory=lambda: {"reweight_method": "pow", "weight_pow": 2.0})
    """PF-PPO's weights: reweight_method pow (|score| ** weight_pow) / max_min (1 at the batch's max and min score,
    else 0) / max_random (0.4 at the max, else 0.1)."""


@dataclass
class AsyncTrainingConfig:
    """verl's `async_training` (`verl/experimental/fully_async_policy`): generation overlaps the update. A rollout
    producer (a thread of the driver process, `tiller.trainer.async_rollout`) keeps generating and scoring
    step batches with the newest weights the trainer has published, into a bounded queue the trainer
    consumes. Policy version = number of weight syncs from trainer to producer. Every sample carries the
    version(s) that sampled it; the behaviour logprobs are the rollout's own.

    Deviations from verl: tiller's unit of production is one step's prompt batch (verl streams single
    samples), so the producer's budget below is counted in step batches; `staleness_threshold` additionally
    bounds the age of every sample used (verl only bounds the production rate); the rollout runs in the same
    process (trainer.backend=local) rather than on separate GPUs.
    Other front ends: OpenRLHF's `--async_train` is `staleness_threshold=1` (one step off-policy; its
    `--async_queue_size` N is `staleness_threshold=N`); TRL's `max_staleness` k is `staleness_threshold=k`
    (both bound the policy versions between generation and use)."""

    staleness_threshold: float = 0.0
    """0 = the synchronous loop, bit for bit. s > 0: after each weight sync the producer may generate at most
    floor((1 + s) x trigger_parameter_sync_step) step batches (counting those queued or in flight), verl's
    rule; a sample older than floor((floor((1 + s) x trigger) - 1) / trigger) versions (= floor(s) with
    trigger 1) is never used: dropped and counted (async/dropped_stale)."""
    trigger_parameter_sync_step: int = 1
    """Trainer steps (local updates) between two weight syncs to the producer (verl's default is 4; tiller's 1
    keeps staleness_threshold=0 synchronous). > 1 runs the producer even with staleness_threshold=0."""
    require_batches: Optional[int] = None
    """ppo_mini_batch_size prompt groups the trainer takes per step; null = data.train_batch_size /
    ppo_mini_batch_size. tiller's step batch stays data.train_batch_size, so a value must equal that."""
    use_rollout_log_probs: bool = True
    """verl: the rollout's logprobs are the behaviour policy of the update (tiller's asynchronous update always does
    this; False is refused)."""
    compute_prox_log_prob: bool = False
    """verl: a proximal-policy logprob forward with the current weights (decoupled PPO); refused (not built)."""
    use_trainer_do_validate: bool = False
    """verl: validate in the trainer instead of the rollouter; tiller validates in the trainer (trainer.test_freq)."""
    checkpoint_engine: dict[str, Any] = field(default_factory=lambda: {
        "enable": True, "device_buffer_size_M": 4096, "overlap_broadcast_and_consume": False})
    """verl: the weight broadcast from trainer to rollouter GPUs; tiller's producer shares the trainer's process."""
    share_idle_threads: bool = True
    """tiller (one process, CPU): the trainer also computes on the producer's torch threads. With one thread per
    side (trainer.num_threads=1, or 0 on 2 cores) the actor's (and critic's) update runs one more lane of
    micro-batches (update_lanes + 1) on the producer's thread: while the producer generates, the operating
    system shares the cores among the three; while it waits (for weights, or a free queue slot) the lanes have
    them. Otherwise, and for the other trainer forwards (old / reference logprobs), the trainer thread runs
    on its threads plus the producer's while the producer waits. Which forwards ran on more threads depends
    on timing and can change the last bits of their rounding: false keeps every step on trainer.num_threads
    and update_lanes."""
    partial_rollout: bool = False
    """Weights published mid-generation are loaded between decode steps: unfinished samples continue under the
    new weights (their KV cache, computed with the older weights, is kept, not recomputed); every token
    records the version that sampled it (agent rollouts: in the continuous batcher running their turns and
    requests; an episode is as old as its oldest token). Only with staleness_threshold > 0 (verl: the same) and
    the native engine; with trainer.backend=ray the rollout pool's workers find the newer weights on a board
    between decode steps (tiller.distributed.ray_group.WeightBoard)."""


# -------------------------------------------------------------------------------------------- trainer


@dataclass
class TrainerConfig:
    project_name: str = "tiller"
    """Project name (tracking)."""
    experiment_name: str = "run"
    """Experiment name (tracking, run dir)."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """console | jsonl | tensorboard | wandb | mlflow | file (verl's file logger: $VERL_FILE_LOGGER_PATH, else
    ${VERL_FILE_LOGGER_ROOT:-.}/<project_name>/<experiment_name>.jsonl)."""
    total_epochs: int = 1
    """Passes over the training prompts."""
    total_training_steps: Optional[int] = None
    """Stop after this many steps (overrides total_epochs)."""
    nnodes: int = 1
    """Ray: nodes."""
    n_gpus_per_node: int = 1
    """Ray: GPUs per node (on CPU: workers per node)."""
    backend: str = "local"
    """local (one process) | ray."""
    cpus_per_worker: int = 1
    """Ray on CPU: CPUs (and torch threads) per worker."""
    ray_address: Optional[str] = None
    """Join an existing Ray cluster (ray.init(address=...)); None starts a local one."""
    save_freq: int = -1
    """Checkpoint every N steps (-1 = only at the end)."""
    test_freq: int = -1
    """Validate every N steps (-1 = only at the end)."""
    val_before_train: bool = True
    """Validate before the first step."""
    val_only: bool = False
    """Only validate, then exit."""
    critic_warmup: int = 0
    """Steps of critic-only training before the actor updates."""
    resume_mode: str = "auto"
    """auto (latest checkpoint if any) | disable | resume_path."""
    resume_from_path: Optional[str] = None
    """Checkpoint dir for resume_mode=resume_path."""
    overwrite: bool = False
    """tiller: a run dir that holds an earlier run (checkpoints/, metrics.jsonl) which this run would not resume
    (resume_mode=disable, or auto with no checkpoint to resume) is refused unless this is true; true deletes the
    earlier run's records first, so two runs never mix in one dir."""
    default_local_dir: str = "runs/${trainer.project_name}/${trainer.experiment_name}"
    """Run directory: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, plots/."""
    max_actor_ckpt_to_keep: Optional[int] = None
    """Keep only the newest N checkpoints."""
    balance_batch: bool = False
    """Reorder each step's batch so every data-parallel worker gets an equal token count (verl's
    seqlen-balanced partition; whole GRPO groups where the group count allows)."""
    log_val_generations: int = 0
    """Validation generations to log as text each validation."""
    device: str = "cpu"
    """cpu | cuda."""
    seed: int = 1
    """Seed of sampling and initialisation."""
    num_threads: int = 0
    """torch threads in the driver process (0 = leave torch's default). Asynchronous RL: the threads of each side
    (trainer thread, rollout producer thread); 0 there splits torch's default between the two."""
    tune_cpu_malloc: bool = True
    """CPU runs on Linux/glibc: keep freed memory in the process (mallopt) so each step's activations reuse
    pages instead of faulting in fresh ones (~10-20% faster CPU steps); off: glibc's defaults."""
    progress: bool = True
    """Show a live progress bar (tqdm) on a terminal; off when the output is not a TTY."""
    use_legacy_worker_impl: str = "auto"
    """verl: which of its worker implementations to run; tiller has one."""
    rollout_data_dir: Optional[str] = None
    """Write every training step's samples to <dir>/<step>.jsonl (verl's keys: input, output, gts, score, step, then
    uid and the reward's extra outputs); null: no dump."""
    validation_data_dir: Optional[str] = None
    """Write every validation's samples to <dir>/<step>.jsonl (as trainer.rollout_data_dir); null: no dump."""
    esi_redundant_time: float = 0
    """verl: extra seconds before an elastic-instance shutdown to save a checkpoint; tiller has no ESI hook."""
    default_hdfs_dir: Optional[str] = None
    """verl: copy checkpoints to HDFS; refused (tiller writes to trainer.default_local_dir)."""
    del_local_ckpt_after_load: bool = False
    """verl: delete the local checkpoint after resuming from it; tiller keeps it."""
    max_critic_ckpt_to_keep: Optional[int] = None
    """verl: critic checkpoints to keep; a tiller checkpoint holds actor and critic together, so
    max_actor_ckpt_to_keep bounds both."""
    ray_wait_register_center_timeout: int = 300
    """verl: seconds to wait for its Ray register center; tiller has none."""
    use_v1: bool = True
    """verl 0.10: its v1 trainer (verl's default) or the legacy one; tiller has one trainer, whose step is v1's sync
    mode."""
    v1: V1TrainerConfig = field(default_factory=V1TrainerConfig)
    """verl 0.10: the v1 trainer's modes (trainer_mode=sync only)."""


@dataclass
class NewRewardManagerConfig:
    name: Optional[str] = None
    """= reward_model.reward_manager (naive | batch | parallel | prime | dapo | openrlhf)."""
    source: str = "register"
    """verl: register (a built-in manager by name) | importlib (a class of the user's: module.path names its file,
    reward.reward_manager.name the class; tiller.rewards.verl_manager runs it)."""
    module: dict[str, Any] = field(default_factory=lambda: {"path": None, "name": "custom_reward_manager"})
    """verl: {path: the custom reward manager's .py file, name: unused (verl loads the class by
    reward_manager.name)}."""


@dataclass
class NewRewardModelConfig:
    enable: Optional[bool] = None
    """= reward_model.enable."""
    model_path: Optional[str] = None
    """= reward_model.model.path."""
    enable_resource_pool: Optional[bool] = None
    """= reward_model.enable_resource_pool."""
    n_gpus_per_node: Optional[int] = None
    """= reward_model.n_gpus_per_node."""
    nnodes: Optional[int] = None
    """= reward_model.nnodes."""
    rollout: dict[str, Any] = field(default_factory=v010.reward_model_rollout)
    """verl 0.10: the inference server (vLLM / SGLang) its reward loop runs the reward model on; tiller's reward
    model is one forward pass in the driver (a sequence classifier), so these engine settings have no effect."""


@dataclass
class RewardConfig:
    """verl 0.8+'s `reward` section, resolved at load time onto the legacy top-level `reward_model.*` /
    `custom_reward_function.*` keys (verl's `migrate_legacy_reward_impl` in reverse); a setting given in both
    layouts is an error naming both keys. `tiller config show` prints the legacy keys."""

    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    """= custom_reward_function.*"""
    reward_manager: NewRewardManagerConfig = field(default_factory=NewRewardManagerConfig)
    """= reward_model.reward_manager (by name)."""
    reward_model: NewRewardModelConfig = field(default_factory=NewRewardModelConfig)
    """= reward_model.{enable, model.path}."""
    reward_kwargs: dict[str, Any] = field(default_factory=lambda: {
        "overlong_buffer_cfg": {"enable": False, "len": 0, "penalty_factor": 1.0, "log": False}, "max_resp_len": None})
    """= reward_model.reward_kwargs: DAPO's overlong_buffer_cfg {enable, len, penalty_factor, log} and max_resp_len
    (null = data.max_response_length), present by default as in verl 0.9's reward.yaml (set them without +)."""
    num_workers: Optional[int] = None
    """= reward_model.num_workers."""
    sandbox_fusion: dict[str, Any] = field(default_factory=lambda: {"url": None, "max_concurrent": 64,
                                                                     "memory_limit_mb": 1024})
    """= reward_model.sandbox_fusion (verl 0.10's place of it)."""


@dataclass
class DistillationInferenceConfig:
    """verl's `distillation.teacher_model.inference` (a rollout config for the teacher's server): accepted, no-ops."""

    name: str = "vllm"
    """verl: the teacher's inference engine; tiller's teacher is one forward pass in the actor worker."""
    dtype: str = "bfloat16"
    """verl: the teacher server's dtype; tiller's teacher runs in the actor's dtype."""
    temperature: float = 1.0
    """verl: the teacher server's temperature; tiller scores at the rollout temperature, as the student."""
    tensor_model_parallel_size: int = 1
    """verl: the teacher server's tensor parallelism; tiller's teacher is one forward pass in the actor worker."""
    gpu_memory_utilization: float = 0.5
    """verl: the teacher server's memory share; tiller's teacher is one forward pass in the actor worker."""
    enforce_eager: bool = True
    """verl: the teacher server's CUDA graphs; tiller's teacher is one forward pass in the actor worker."""
    free_cache_engine: bool = True
    """verl: the teacher server's sleep mode; tiller's teacher is one forward pass in the actor worker."""
    max_model_len: Optional[int] = None
    """verl: the teacher server's context; tiller's teacher reads the student's prompt + response."""
    max_num_batched_tokens: int = 8192
    """verl: the teacher server's token budget; tiller uses actor_rollout_ref.ref's micro-batching."""
    max_num_seqs: int = 1024
    """verl: the teacher server's batch; tiller uses actor_rollout_ref.ref's micro-batching."""
    prompt_length: int = 512
    """verl: the teacher server's prompt length; tiller's teacher reads the student's prompt + response."""
    response_length: int = 512
    """verl: the teacher server's response length; tiller's teacher reads the student's prompt + response."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """verl: the teacher server's engine arguments; tiller's teacher is one forward pass in the actor worker."""


@dataclass
class DistillationTeacherModelConfig:
    model_path: Optional[str] = None
    """= algorithm.distill.teacher_path."""
    enable_resource_pool: bool = False
    """verl: a separate GPU pool for the teacher; tiller's teacher sits in the actor worker."""
    n_gpus_per_node: int = 0
    """verl: the teacher pool's GPUs per node; tiller's teacher sits in the actor worker."""
    nnodes: int = 0
    """verl: the teacher pool's nodes; tiller's teacher sits in the actor worker."""
    inference: DistillationInferenceConfig = field(default_factory=DistillationInferenceConfig)
    """verl: the teacher's inference server (its keys are accepted as no-ops)."""


@dataclass
class DistillationLossConfig:
    """verl's `distillation.distillation_loss` (defaults: verl 0.10's, verl-project/verl 1dda039b)."""

    loss_mode: str = "k3"
    """= algorithm.distill.loss_mode (verl's default k3; the top-k modes are refused)."""
    topk: Optional[int] = 32
    """verl: top-k for the *_topk loss modes, which tiller refuses."""
    use_task_rewards: bool = True
    """= algorithm.distill.use_outcome_reward."""
    distillation_loss_coef: float = 1.0
    """= algorithm.distill.coef."""
    task_loss_coef: float = 1.0
    """= algorithm.distill.outcome_coef."""
    loss_max_clamp: Optional[float] = None
    """= algorithm.distill.loss_max_clamp."""
    log_prob_min_clamp: Optional[float] = None
    """= algorithm.distill.log_prob_min_clamp."""
    use_policy_gradient: bool = False
    """= algorithm.distill.use_policy_gradient."""
    policy_loss_mode: str = "vanilla"
    """verl: the distillation surrogate's policy loss; only vanilla (verl: the same)."""
    clip_ratio: float = 0.2
    """verl: its vanilla loss reads clip_ratio_low / clip_ratio_high, which always have a value here."""
    clip_ratio_low: float = 0.2
    """= algorithm.distill.clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """= algorithm.distill.clip_ratio_high."""


@dataclass
class TransferQueueConfig:
    """verl's `transfer_queue` (verl/experimental/transfer_queue): a distributed store that streams batches between
    separate worker pools. tiller's driver hands batches to its workers directly."""

    enable: bool = False
    """Refused: TransferQueue is not built in tiller (the trainer passes each batch in process / over Ray)."""
    num_global_batch: int = 1
    """verl TransferQueue option (only with transfer_queue.enable, refused)."""
    storage_backend: str = "AsyncSimpleStorageManager"
    """verl TransferQueue option (only with transfer_queue.enable, refused)."""
    num_data_storage_units: int = 8
    """verl TransferQueue option (only with transfer_queue.enable, refused)."""
    metrics: dict[str, Any] = field(default_factory=lambda: {"enabled": False, "port": 0})
    """verl 0.10 TransferQueue option (only with transfer_queue.enable, refused)."""
    backend: dict[str, Any] = field(default_factory=lambda: {
        "storage_backend": "SimpleStorage", "SimpleStorage": {"total_storage_size": 100000, "num_data_storage_units": 8},
        "MooncakeStore": {"auto_init": False, "metadata_server": "localhost:50123",
                          "master_server_address": "localhost:50124", "local_hostname": "localhost", "protocol": "tcp",
                          "global_segment_size": 4294967296, "local_buffer_size": 1073741824, "device_name": ""}})
    """verl 0.10 TransferQueue storage backend (only with transfer_queue.enable, refused)."""


@dataclass
class RewardManagerSectionConfig:
    """verl 0.7's top-level `reward_manager` section (`reward_manager.yaml`)."""

    name: Optional[str] = None
    """= reward_model.reward_manager (resolved onto it at load time; both set = error)."""
    source: str = "register"
    """verl 0.7: register (a built-in manager by name) | importlib (a class of the user's, as reward.reward_manager's
    source)."""
    module: dict[str, Any] = field(default_factory=lambda: {"path": None, "name": "custom_reward_manager"})
    """verl 0.7: {path: the custom reward manager's .py file, name: unused (the class is reward_manager.name)}."""


@dataclass
class DistillationConfig:
    """verl's on-policy distillation section, resolved at load time onto `algorithm.distill.*` (verl's defaults
    apply to the keys left unset); setting both layouts is an error naming both."""

    enabled: bool = False
    """Turn on verl's on-policy distillation (needs teacher_model.model_path)."""
    enable: Optional[bool] = None
    """= distillation.enabled (an older spelling)."""
    num_workers: int = 8
    """verl: teacher replicas; tiller's teacher sits in each actor worker."""
    teacher_model: DistillationTeacherModelConfig = field(default_factory=DistillationTeacherModelConfig)
    """The teacher (model_path = algorithm.distill.teacher_path)."""
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    """The loss (onto algorithm.distill.*)."""
    n_gpus_per_node: int = 8
    """verl 0.10: GPUs per node of the teacher pool; tiller's teacher sits in the actor worker."""
    nnodes: int = 0
    """verl 0.10: nodes of the teacher pool; tiller's teacher sits in the actor worker."""
    teacher_models: dict[str, Any] = field(default_factory=v010.teacher_models)
    """verl 0.10: named teachers {key, model_path, num_replicas, inference}; one teacher's model_path resolves onto
    algorithm.distill.teacher_path, several onto algorithm.distill.teachers ({key: model_path}, routed by
    teacher_key)."""
    teacher_key: str = "data_source"
    """verl 0.10: the sample field that routes a sample to one of several teachers (= algorithm.distill.teacher_key)."""


@dataclass
class RLConfig:
    """The whole RL job, verl's tree."""

    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    reward_manager: RewardManagerSectionConfig = field(default_factory=RewardManagerSectionConfig)
    transfer_queue: TransferQueueConfig = field(default_factory=TransferQueueConfig)
    global_profiler: dict[str, Any] = field(default_factory=_global_profiler)
    rollout: dict[str, Any] = field(default_factory=lambda: {
        "nnodes": 1, "n_gpus_per_node": 8, "n": 4, "total_rollout_steps": None, "total_epochs": 10, "test_freq": 1})
    ray_kwargs: dict[str, Any] = field(default_factory=lambda: {"ray_init": {"num_cpus": None, "runtime_env": {
        "py_executable": None}}, "timeline_json_file": None})
    sandbox_fusion: dict[str, Any] = field(default_factory=lambda: {"url": None, "max_concurrent": None,
                                                                     "memory_limit_mb": None})
    """verl 0.10's legacy top-level SandboxFusion section: = reward.sandbox_fusion (nulls: 64 / 1024)."""
    model_engine: str = "dp"
    """verl 0.10's training engine (a config group there): dp (FSDP, tiller's) | megatron | veomni | torchtitan
    (refused, before any other key of the command line)."""
    skip: SkipConfig = field(default_factory=SkipConfig)
    """verl 0.10: dump a stage's output and replay it on later runs (enable refused)."""
