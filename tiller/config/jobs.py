"""Typed configs of the offline jobs: `tiller sft`, `tiller rm`, `tiller dpo`, `tiller kto`.

Key names follow verl's `sft_trainer.yaml` where it has them (`data.train_files`, `data.prompt_key`,
`data.response_key`, `data.max_length`, `data.truncation`, `data.micro_batch_size_per_gpu`,
`data.train_batch_size`, `model.partial_pretrain`, `model.lora_rank`, `optim.lr`,
`optim.warmup_steps_ratio`, `optim.clip_grad`, `trainer.total_epochs`, `trainer.default_local_dir`,
...), plus OpenRLHF's `input_key` / `output_key` and TRL's preference column names (`prompt`,
`chosen`, `rejected`; KTO: `completion`, `label`). Load one with
`tiller.config.load_config(overrides, config_file, schema=SFTConfig, validate=validate_job)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tiller.algos.preference import (
    ALPHAPO_LOSSES,
    DPO_LOSS_TYPES,
    F_DIVERGENCE_LOSSES,
    F_DIVERGENCES,
    REFERENCE_FREE_LOSSES,
)
from tiller.config.checks import check_choice as _choice
from tiller.config.checks import check_positive as _positive
from tiller.config.checks import check_ref_sync
from tiller.config.given import given_keys
from tiller.errors import ConfigError
from tiller.models.chat_template import check_chat_template_settings
from tiller.models.optimizer import HF_SCHEDULES, check_optimizer, check_schedule_kwargs
from tiller.models.quant import check_quantization
from tiller.tracking.tracker import LOGGERS

# ----------------------------------------------------------------------------------------------- data


@dataclass
class SFTDataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training files: parquet or jsonl."""
    val_files: list[str] = field(default_factory=list)
    """Validation files (eval loss and perplexity); empty = no validation."""
    format: str = "auto"
    """auto (messages if data.messages_key is a column, else text if only data.text_key is, else prompt_response) |
    prompt_response | messages | text (plain text, loss on every token: TRL's language-modeling rows)."""
    prompt_key: str = "prompt"
    """Prompt column: a string or a list of chat messages."""
    response_key: str = "response"
    """Response column: a string."""
    input_key: Optional[str] = None
    """OpenRLHF's name for the prompt column; overrides data.prompt_key when set."""
    output_key: Optional[str] = None
    """OpenRLHF's name for the response column; overrides data.response_key when set."""
    messages_key: str = "messages"
    """Chat-conversation column (list of {role, content}); loss on every assistant turn."""
    assistant_only_loss: bool = True
    """messages format: loss on the assistant turns only (True) or on every token of the rendered conversation
    (False: TRL's default for a `messages` dataset)."""
    text_key: str = "text"
    """text format: the column of plain text; loss on every token, eos appended unless the text ends with it."""
    image_key: str = "images"
    """Image column of image + text conversations (verl's multimodal schema; a vision-language model: the
    messages' `<image>` placeholders take these images in order)."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (as the RL trainer does)."""
    add_special_tokens: bool = False
    """Tokenize text that no chat template renders (text rows, string prompts with apply_chat_template off, whole-string
    reward sequences) with the tokenizer's special tokens, e.g. Llama's BOS, as TRL's trainers tokenize standard rows;
    false: without them, as the RL trainer tokenizes prompts."""
    max_length: int = 512
    """Longest prompt + response in tokens."""
    truncation: str = "error"
    """Over max_length: error | left (drop the start) | right (drop the end)."""
    train_batch_size: int = 16
    """Sequences per optimizer step (global batch)."""
    micro_batch_size_per_gpu: int = 4
    """Rows per forward/backward (gradient accumulation = train_batch_size / this)."""
    packing: bool = False
    """Pack several sequences per row (positions restart, attention stays inside each sequence)."""
    pack_length: Optional[int] = None
    """Tokens per packed row; None = min(data.max_length, max(longest sequence, 4 x mean length))."""
    shuffle: bool = True
    """Shuffle each epoch (seeded by trainer.seed)."""
    max_samples: int = -1
    """Use at most this many training rows (-1 = all)."""
    val_max_samples: int = -1
    """Use at most this many validation rows (-1 = all)."""
    train_probs: Optional[list[float]] = None
    """Interleave the train_files sources with these sampling probabilities (OpenRLHF's --dataset_probs);
    None = concatenate them."""
    train_split: str = "train"
    """Split read from a train source that is a dataset name or dir (datasets.load_dataset)."""
    val_split: str = "train"
    """Split read from a val source that is a dataset name or dir."""
    input_template: Optional[str] = None
    """Format string with {} applied to a string prompt when no chat template renders it (OpenRLHF's
    --input_template, e.g. "User: {}\\nAssistant: ")."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables of the chat template (verl's SFT key: keyword arguments of apply_chat_template), e.g.
    +data.apply_chat_template_kwargs.enable_thinking=False; every prompt and conversation renders with them."""


@dataclass
class PreferenceDataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training files: parquet or jsonl."""
    val_files: list[str] = field(default_factory=list)
    """Validation files; empty = no validation."""
    prompt_key: Optional[str] = "prompt"
    """Prompt column: a string or a list of chat messages; None = no prompt column: chosen / rejected are whole
    conversations (OpenRLHF's layout; DPO / KTO prompt = the conversation without its last turn, RM = all of it)."""
    chosen_key: str = "chosen"
    """Preferred response column: a string or a list of assistant messages."""
    rejected_key: str = "rejected"
    """Dispreferred response column: a string or a list of assistant messages."""
    margin_key: Optional[str] = None
    """RM only: column with a per-pair margin (Llama-2); None = no margin."""
    ref_chosen_logps_key: Optional[str] = None
    """DPO: column of precomputed reference log-prob sums of chosen (then no reference model is run)."""
    ref_rejected_logps_key: Optional[str] = None
    """DPO: column of precomputed reference log-prob sums of rejected."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    add_special_tokens: bool = False
    """Tokenize text that no chat template renders (text rows, string prompts with apply_chat_template off, whole-string
    reward sequences) with the tokenizer's special tokens, e.g. Llama's BOS, as TRL's trainers tokenize standard rows;
    false: without them, as the RL trainer tokenizes prompts."""
    max_length: int = 512
    """Longest prompt + response in tokens."""
    truncation: str = "error"
    """Over max_length: error | left (drop the prompt start) | right (drop the response end)."""
    train_batch_size: int = 16
    """Pairs (KTO: examples) per optimizer step."""
    micro_batch_size_per_gpu: int = 4
    """Pairs (KTO: examples) per forward/backward."""
    shuffle: bool = True
    """Shuffle each epoch (seeded by trainer.seed)."""
    max_samples: int = -1
    """Use at most this many training rows (-1 = all)."""
    val_max_samples: int = -1
    """Use at most this many validation rows (-1 = all)."""
    train_probs: Optional[list[float]] = None
    """Interleave the train_files sources with these sampling probabilities (OpenRLHF's --dataset_probs);
    None = concatenate them."""
    train_split: str = "train"
    """Split read from a train source that is a dataset name or dir (datasets.load_dataset)."""
    val_split: str = "train"
    """Split read from a val source that is a dataset name or dir."""
    input_template: Optional[str] = None
    """Format string with {} applied to a string prompt when no chat template renders it (OpenRLHF's
    --input_template, e.g. "User: {}\\nAssistant: ")."""


@dataclass
class KTODataConfig(PreferenceDataConfig):
    completion_key: str = "completion"
    """KTO: completion column (TRL's unpaired format)."""
    label_key: str = "label"
    """KTO: desirable (true) / undesirable (false) column."""


@dataclass
class SPINDataConfig:
    train_files: list[str] = field(default_factory=list)
    """SFT data (parquet or jsonl): a prompt column and the ground-truth response column."""
    prompt_key: str = "prompt"
    """Prompt column: a string or a list of chat messages."""
    response_key: str = "response"
    """Ground-truth response column (SPIN's y ~ p_data): a string."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (as the RL trainer and `tiller sft` do)."""
    input_template: Optional[str] = None
    """Format string with {} applied to a string prompt when no chat template renders it."""
    max_length: int = 512
    """Longest prompt + response in tokens (real and generated)."""
    truncation: str = "error"
    """Over max_length: error | left (drop the prompt start) | right (drop the response end)."""
    train_batch_size: int = 16
    """Pairs (real, generated) per optimizer step."""
    micro_batch_size_per_gpu: int = 4
    """Pairs per forward/backward."""
    shuffle: bool = True
    """Shuffle each epoch (seeded by trainer.seed)."""
    max_samples: int = -1
    """Use at most this many rows (-1 = all)."""
    train_split: str = "train"
    """Split read from a train source that is a dataset name or dir (datasets.load_dataset)."""


# ---------------------------------------------------------------------------------------------- model


@dataclass
class JobModelConfig:
    partial_pretrain: str = ""
    """Model to train: a Hugging Face causal-LM dir (verl's name)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer dir; None = model.partial_pretrain."""
    ref_path: Optional[str] = None
    """DPO / KTO reference model; None = the starting policy: partial_pretrain (with LoRA: the base with adapters
    disabled; with lora_adapter_path: the base with that adapter merged in)."""
    trust_remote_code: bool = False
    """Pass trust_remote_code to from_pretrained."""
    custom_chat_template: Optional[str] = None
    """A Jinja chat template replacing the tokenizer's (and a VLM processor's) after loading (verl's
    model.custom_chat_template): the data renders with it and the saved model keeps it; null = the tokenizer's own."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    use_torch_compile: bool = False
    """Compile each decoder layer of the trained model with torch.compile (regional compilation, one graph shared by
    every layer: tiller.models.compile; TRL's torch_compile): Inductor fuses the norms, rotary embedding, activation
    and residual adds, forward and backward. A compile that fails warns and runs eagerly."""
    use_liger: bool = False
    """SFT (verl's SFT key, TRL's use_liger_kernel): the LM head run with the log-probs of the labelled tokens only,
    chunk by chunk (tiller.algos.entropy.head_logprobs_and_entropy, not Liger's kernels; what its fused linear
    cross-entropy saves): the [tokens, vocabulary] logits and their gradient never exist whole, and prompt tokens cost
    no head matmul. For causal LMs whose head is a plain Linear applied as is (not an FSDP2-sharded one), text rows,
    no sequence parallelism; elsewhere the logits are computed whole, said once. Refused with
    model.router_aux_loss_coef, algorithm.label_smoothing and in the other jobs."""
    disable_dropout: bool = False
    """Set every dropout probability of the trained model to 0 (TRL's disable_dropout, its default for DPO / KTO /
    reward models): the policy's log-probs are then those the reference and the loss assume."""
    attn_implementation: Optional[str] = None
    """transformers attention: sdpa | eager | flash_attention_2; None = transformers' default."""
    lora_rank: int = 0
    """LoRA rank (0 = full fine-tuning)."""
    lora_alpha: int = 16
    """LoRA alpha (scale = alpha / rank)."""
    use_rslora: bool = False
    """Rank-stabilised LoRA (peft's / TRL's use_rslora): scale = alpha / sqrt(rank)."""
    use_dora: bool = False
    """DoRA (peft's / TRL's use_dora; Liu et al. 2024, arXiv 2402.09353): each adapted weight's direction and a
    learned magnitude per output feature; merged into the export as peft merges it."""
    lora_dropout: float = 0.0
    """LoRA dropout."""
    target_modules: Any = "all-linear"
    """LoRA target modules: a list of module names or 'all-linear' (a vision-language model: its language model's)."""
    target_parameters: Any = None
    """tiller (peft's target_parameters, TRL's lora_target_parameters): with LoRA, parameters adapted by name besides
    target_modules: a mixture-of-experts model's experts (transformers stores each layer's experts as 3-D parameters,
    which 'all-linear' does not reach), e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj]; a list of parameter
    names (suffixes of full names)."""
    exclude_modules: Any = None
    """LoRA: modules left out of target_modules (peft's exclude_modules): a list of module names, or a regex string
    matched against full module names."""
    modules_to_save: Any = None
    """LoRA: modules trained in full beside the adapters and saved with them (peft's modules_to_save, TRL's
    lora_modules_to_save), e.g. [lm_head, embed_tokens] after adding tokens; a list of module names. On a model that
    ties them (tie_word_embeddings) either name trains the one shared matrix and the export stays tied."""
    lora_adapter_path: Optional[str] = None
    """Continue training from a saved LoRA adapter (a peft adapter dir, e.g. a LoRA run's checkpoint model/), loaded
    trainable onto partial_pretrain (verl's model.lora_adapter_path); rank, alpha, targets and dropout come from its
    adapter_config.json (the lora_* keys left at their defaults, or set to the same values). LoRA is on with it even
    at lora_rank=0."""
    load_in_4bit: bool = False
    """QLoRA: the body's linear layers loaded as bitsandbytes 4-bit weights, frozen, LoRA adapters training on them
    (TRL's / transformers' load_in_4bit, OpenRLHF's --load_in_4bit); needs LoRA and the bitsandbytes package. The
    export is the dequantized base with the adapters merged (the function trained)."""
    bnb_4bit_quant_type: str = "nf4"
    """With load_in_4bit: nf4 (NormalFloat4, QLoRA's) | fp4 (transformers' BitsAndBytesConfig name)."""
    bnb_4bit_use_double_quant: bool = False
    """With load_in_4bit: quantize the block scales too (~0.4 bit per weight less; TRL's use_bnb_nested_quant,
    OpenRLHF sets it)."""
    router_aux_loss_coef: float = 0.0
    """A mixture-of-experts model (its config has output_router_logits: Mixtral, Qwen2-MoE, Qwen3-MoE, ...): its router
    load-balancing loss (transformers' load_balancing_loss_func) added with this weight, each micro-batch's by its
    share of the step (OpenRLHF's --aux_loss_coef, TRL's router_aux_loss_coef); SFT / DPO / KTO. 0 = off."""
    neftune_noise_alpha: Optional[float] = None
    """NEFTune (Jain et al. 2023; TRL's / transformers' neftune_noise_alpha): while training, uniform noise of
    magnitude alpha / sqrt(L d) added to the input embeddings (L the row length, d the hidden size); validation is
    noise-free. None = off; 5 is the paper's usual value."""
    freeze_vision_tower: bool = False
    """Freeze a vision-language model's vision tower (patch embedding, blocks and merger), as the RL actor's
    actor.freeze_vision_tower; an error on a text-only model."""


@dataclass
class JobOptimConfig:
    lr: float = 1e-5
    """Peak learning rate."""
    optimizer: str = "AdamW"
    """Optimizer class name in optimizer_impl, built as verl builds it (`tiller.models.optimizer`): lr and
    weight_decay, + betas and eps for Adam-family names, then override_optimizer_config."""
    optimizer_impl: str = "torch.optim"
    """Module of the optimizer class (torch.optim, transformers.optimization, bitsandbytes.optim, ...)."""
    override_optimizer_config: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the optimizer class, applied last (e.g. SGD's {momentum: 0.9})."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam betas (Adam-family classes)."""
    eps: float = 1e-8
    """Adam epsilon (Adam-family classes)."""
    weight_decay: float = 0.01
    """Weight decay."""
    weight_decay_exempt: Optional[str] = None
    """The parameters weight decay spares. null: none, every trainable parameter decays (verl's SFT trainer);
    transformers: biases, norm weights and LayerNorm parameters, as transformers' Trainer (TRL) groups them; openrlhf:
    the names containing bias / layer_norm.weight / layernorm.weight / norm.weight / ln_f.weight (OpenRLHF). The
    TRL and OpenRLHF front ends set theirs when weight decay is on."""
    warmup_steps_ratio: float = 0.0
    """Linear warmup over int(this x total) steps, from lr 0 at the first step (verl's SFT engine and transformers
    count warmup steps from 0)."""
    lr_scheduler: str = "cosine"
    """After warmup: cosine | constant | linear (to 0 at the last step, transformers' formula), or transformers'
    cosine_with_restarts | polynomial | inverse_sqrt | warmup_stable_decay (their formulas and warmup exactly, their
    keywords in lr_scheduler_kwargs)."""
    lr_scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keywords of transformers' schedules (its get_scheduler's scheduler_specific_kwargs): cosine_with_restarts:
    num_cycles; polynomial: lr_end, power; inverse_sqrt: timescale; warmup_stable_decay: num_decay_steps (required),
    num_stable_steps, warmup_type, decay_type, min_lr_ratio, num_cycles. Refused with tiller's own schedules."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr."""
    clip_grad: float = 1.0
    """Max global gradient norm (<= 0 disables clipping)."""
    dtype: str = "float32"
    """Compute dtype: float32 | bfloat16 (autocast; weights and optimizer stay float32). Unset: bfloat16 where
    trainer.device=cuda (verl's SFT trainer computes in bf16 over fp32 weights), float32 on a CPU."""


@dataclass
class JobTrainerConfig:
    project_name: str = "tiller"
    """Project name (tracking)."""
    experiment_name: str = "run"
    """Experiment name (tracking, run dir)."""
    default_local_dir: str = "runs/${trainer.project_name}/${trainer.experiment_name}"
    """Run directory: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, plots/, hf_model/."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """console | jsonl | tensorboard | wandb | mlflow | file (verl's file logger, as in tiller rl)."""
    total_epochs: int = 1
    """Passes over the training data."""
    total_training_steps: Optional[int] = None
    """Stop after this many optimizer steps (overrides total_epochs)."""
    save_freq: int = -1
    """Checkpoint every N steps (-1 = only at the end)."""
    test_freq: int = -1
    """Validate every N steps (-1 = only at the end)."""
    max_ckpt_to_keep: Optional[int] = None
    """Keep only the newest N checkpoints (and the best_metric's best one)."""
    best_metric: Optional[str] = None
    """A validation metric as logged (val/loss, val/rewards/accuracies, ...): the checkpoint where it was best is the
    model exported at the end (hf_model), and kept whatever max_ckpt_to_keep says (TRL's load_best_model_at_end with
    metric_for_best_model). Needs data.val_files and trainer.save_freq a multiple of trainer.test_freq; null = the
    last model."""
    best_metric_greater: Optional[bool] = None
    """Whether a larger best_metric is better; null: False for a metric ending in loss, else True (HF's default)."""
    resume_mode: str = "auto"
    """auto (latest checkpoint in the run dir, if any) | disable | resume_path."""
    resume_from_path: Optional[str] = None
    """Checkpoint dir for resume_mode=resume_path."""
    export_hf: bool = True
    """At the end write <default_local_dir>/hf_model: a from_pretrained-ready model, LoRA merged."""
    seed: int = 1
    """Seed of initialisation, shuffling and dropout."""
    device: str = "cpu"
    """cpu | cuda."""
    num_threads: int = 0
    """torch threads (0 = leave torch's default)."""
    strategy: str = "fsdp"
    """Under `torchrun --nproc_per_node N` (N > 1): fsdp (FSDP2, sharded) | ddp; one process ignores it."""


# ----------------------------------------------------------------------------------------- algorithms


@dataclass
class SFTAlgoConfig:
    loss: str = "nll"
    """Token loss: nll (-log p) | dft (Dynamic Fine-Tuning, Wu et al. 2025: -p log p with p detached)."""
    label_smoothing: float = 0.0
    """Label smoothing eps of the nll loss (transformers' LabelSmoother, TRL's label_smoothing_factor): (1 - eps) x
    -log p(target) + eps x the mean of -log p over the vocabulary; in [0, 1), 0 = off; not with dft. The
    perplexity reported stays the plain nll's."""


@dataclass
class RMAlgoConfig:
    loss: str = "sigmoid"
    """Pairwise loss: sigmoid (-log sigma(s_c - s_r - margin)) | logexp (OpenRLHF's name, same value)."""
    center_rewards_coefficient: float = 0.0
    """Weight of the centring term c * ((s_c + s_r) ** 2) averaged over pairs (Eisenstein et al. 2023, TRL's
    center_rewards_coefficient; OpenRLHF has none): keeps the scores near 0; 0 = off."""


@dataclass
class DPOAlgoConfig:
    loss: Any = "dpo"
    """dpo | ipo | cdpo (conservative DPO: dpo with label smoothing) | hinge (SLiC) | robust (robust DPO: unbiased
    under label noise algorithm.label_smoothing), or one of TRL 1.16's other DPO losses: exo_pair, nca_pair,
    bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, sigmoid_norm, sft (the chosen completions'
    NLL), and TRL's `sigmoid` (dpo without label smoothing, as TRL's); a list of them is their weighted sum
    (algorithm.loss_weights; TRL's MPO: [sigmoid, bco_pair, sft]). Without a reference model (none is loaded when
    every loss is one of these or sft): simpo (SimPO: length-averaged log-probs, margin algorithm.simpo_gamma), cpo
    (CPO: summed log-probs, plus algorithm.cpo_alpha x the chosen completions' NLL), orpo (ORPO: the odds-ratio term
    weighted by beta, plus the chosen completions' NLL), cpo_hinge / cpo_ipo (TRL's CPOTrainer hinge / ipo: the hinge
    on summed log-probs, IPO's square on averaged ones, plus the cpo_alpha NLL term); TRL's CPOTrainer simpo with
    cpo_alpha > 0 is [simpo, sft] weighted [1, cpo_alpha]. algorithm.alphapo_alpha: AlphaPO with simpo / cpo_ipo."""
    loss_weights: Optional[list] = None
    """One weight per loss of a list (default 1.0 each)."""
    beta: float = 0.1
    """Inverse temperature beta (IPO: the regularisation tau)."""
    label_smoothing: float = 0.0
    """cDPO / robust / exo_pair / aot: probability that a label is flipped (must be > 0 for cdpo and exo_pair)."""
    f_divergence: str = "reverse_kl"
    """f-DPO's divergence (TRL's f_divergence_type): reverse_kl (standard) | forward_kl | js_divergence |
    alpha_divergence; only for dpo / cdpo / sigmoid_norm / hinge / ipo / exo_pair / robust / discopop / sft."""
    f_alpha_divergence_coef: float = 0.5
    """alpha of alpha_divergence."""
    discopop_tau: float = 0.05
    """DiscoPOP's temperature of the logistic / exponential blend."""
    ld_alpha: Optional[float] = None
    """LD-DPO (Liu et al. 2024): the log-probs of tokens past the shorter completion of a pair weighted by ld_alpha
    in [0, 1] (null: off)."""
    use_weighting: bool = False
    """WPO (Zhou et al. 2024): each pair's loss weighted by the product of its completions' length-normalised,
    distribution-aligned probabilities (detached), as TRL's use_weighting."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (TRL's simpo_gamma): the loss reads a_c - a_r - gamma / beta."""
    cpo_alpha: float = 1.0
    """CPO's weight of the chosen completions' NLL next to its preference term (TRL's cpo_alpha), read with cpo,
    cpo_hinge and cpo_ipo."""
    alphapo_alpha: float = 0.0
    """AlphaPO (Gupta et al. 2025, arXiv 2501.03884; TRL's CPOConfig alpha): with simpo or cpo_ipo, each
    length-averaged log-prob l becomes the reward (1 - e^(-alpha l)) / alpha; 0 = off (the log-prob itself)."""
    ref_model_sync_steps: Optional[int] = None
    """TR-DPO (TRL's sync_ref_model / ref_model_sync_steps): every N optimizer steps the reference model becomes
    ref_model_mixup_alpha x policy + (1 - alpha) x reference; null = a frozen reference. Needs a reference model of
    its own (not LoRA's adapter-disabled policy, not precomputed log-probs) and one process; checkpoints carry it."""
    ref_model_mixup_alpha: float = 0.6
    """TR-DPO's alpha (TRL's default 0.6), read with ref_model_sync_steps."""


def dpo_loss_names(loss: Any) -> list[str]:
    """algorithm.loss of `tiller dpo` as a list of names (a name, a list, or OmegaConf's ListConfig)."""
    return [loss] if isinstance(loss, str) else [str(n) for n in loss]


@dataclass
class KTOAlgoConfig:
    loss: str = "kto"
    """kto | apo_zero_unpaired (APO-zero, D'Oosterlinck et al. 2024, arXiv 2408.06266, unpaired: KTO's two losses
    with the KL baseline fixed at 0, so no mismatched pairs are run)."""
    beta: float = 0.1
    """Inverse temperature beta."""
    desirable_weight: float = 1.0
    """lambda_D: weight of desirable examples."""
    ref_model_sync_steps: Optional[int] = None
    """TR-DPO (TRL's sync_ref_model / ref_model_sync_steps): every N optimizer steps the reference model becomes
    ref_model_mixup_alpha x policy + (1 - alpha) x reference; null = a frozen reference. Needs a reference model of
    its own (not LoRA's adapter-disabled policy, not precomputed log-probs) and one process; checkpoints carry it."""
    ref_model_mixup_alpha: float = 0.6
    """TR-DPO's alpha (TRL's default 0.6), read with ref_model_sync_steps."""
    undesirable_weight: float = 1.0
    """lambda_U: weight of undesirable examples."""


@dataclass
class SPINAlgoConfig:
    iterations: int = 2
    """Self-play iterations T: each generates the model's own responses, then trains against them (paper: 3)."""
    beta: float = 0.1
    """lambda of the SPIN loss log(1 + exp(-lambda (log p/p_t (y) - log p/p_t (y')))) (DPO's beta; paper: 0.1)."""
    max_new_tokens: int = 256
    """Longest generated response, in tokens."""
    temperature: float = 1.0
    """Sampling temperature of the self-generated responses (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling of the self-generated responses (1 = off)."""


# --------------------------------------------------------------------------------------------- jobs


@dataclass
class SFTConfig:
    """`tiller sft`: supervised fine-tuning."""

    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: JobModelConfig = field(default_factory=JobModelConfig)
    optim: JobOptimConfig = field(default_factory=JobOptimConfig)
    trainer: JobTrainerConfig = field(default_factory=JobTrainerConfig)
    algorithm: SFTAlgoConfig = field(default_factory=SFTAlgoConfig)
    ulysses_sequence_parallel_size: int = 1
    """verl's SFT key: under torchrun, groups of this many ranks split each micro-batch's tokens (packed into one
    sequence; all-to-all around attention: tiller.workers.ulysses), so a rank holds 1/size of the activations and
    logits; text rows only; the model's attention heads must divide by it. One process runs whole sequences."""


@dataclass
class RMConfig:
    """`tiller rm`: pairwise reward model."""

    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    model: JobModelConfig = field(default_factory=JobModelConfig)
    optim: JobOptimConfig = field(default_factory=JobOptimConfig)
    trainer: JobTrainerConfig = field(default_factory=JobTrainerConfig)
    algorithm: RMAlgoConfig = field(default_factory=RMAlgoConfig)
    ulysses_sequence_parallel_size: int = 1
    """Under torchrun, groups of this many ranks split each micro-batch's tokens (as `tiller sft`'s key): the score
    head's per-token outputs are gathered and each sequence's last token read, so the loss runs unchanged."""


@dataclass
class DPOConfig:
    """`tiller dpo`: DPO / IPO / cDPO."""

    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    model: JobModelConfig = field(default_factory=JobModelConfig)
    optim: JobOptimConfig = field(default_factory=JobOptimConfig)
    trainer: JobTrainerConfig = field(default_factory=JobTrainerConfig)
    algorithm: DPOAlgoConfig = field(default_factory=DPOAlgoConfig)
    ulysses_sequence_parallel_size: int = 1
    """Under torchrun, groups of this many ranks split each micro-batch's tokens (as `tiller sft`'s key; the
    reference's forward too): the per-token log-probs are gathered, so every loss runs unchanged. Text pairs only."""


@dataclass
class KTOConfig:
    """`tiller kto`: Kahneman-Tversky optimisation."""

    data: KTODataConfig = field(default_factory=KTODataConfig)
    model: JobModelConfig = field(default_factory=JobModelConfig)
    optim: JobOptimConfig = field(default_factory=JobOptimConfig)
    trainer: JobTrainerConfig = field(default_factory=JobTrainerConfig)
    algorithm: KTOAlgoConfig = field(default_factory=KTOAlgoConfig)
    ulysses_sequence_parallel_size: int = 1
    """Under torchrun, groups of this many ranks split each micro-batch's tokens (as `tiller sft`'s key; the
    reference's and the KL pairs' forwards too): the per-token log-probs are gathered, so the loss runs unchanged."""


@dataclass
class SPINConfig:
    """`tiller spin`: self-play fine-tuning (DPO with the SFT target as chosen, the model's own generation as
    rejected, the previous iteration as reference). trainer.total_epochs / total_training_steps count per
    iteration."""

    data: SPINDataConfig = field(default_factory=SPINDataConfig)
    model: JobModelConfig = field(default_factory=JobModelConfig)
    optim: JobOptimConfig = field(default_factory=JobOptimConfig)
    trainer: JobTrainerConfig = field(default_factory=JobTrainerConfig)
    algorithm: SPINAlgoConfig = field(default_factory=SPINAlgoConfig)


# ------------------------------------------------------------------------------------------ validate



def _validate_best_metric(cfg: Any) -> None:
    """trainer.best_metric: a validation metric, validated at every checkpoint (HF's save_steps a multiple of
    eval_steps), so that the best value's checkpoint exists to export."""
    tr = cfg.trainer
    if tr.best_metric is None:
        if tr.best_metric_greater is not None:
            raise ConfigError("trainer.best_metric_greater is read only with trainer.best_metric")
        return
    if not str(tr.best_metric).startswith("val/"):
        raise ConfigError(f"trainer.best_metric={tr.best_metric!r}: a validation metric as logged, e.g. val/loss")
    if not cfg.data.val_files:
        raise ConfigError(f"trainer.best_metric={tr.best_metric}: needs data.val_files (the metric is a validation "
                          "one)")
    if tr.test_freq <= 0 or tr.save_freq <= 0 or tr.save_freq % tr.test_freq:
        raise ConfigError(f"trainer.best_metric={tr.best_metric}: every checkpoint must be validated, so "
                          f"trainer.save_freq ({tr.save_freq}) must be a positive multiple of trainer.test_freq "
                          f"({tr.test_freq}) (HF's save_steps a multiple of eval_steps)")


def validate_job(cfg: Any) -> None:
    """Cross-field checks shared by the four jobs, then the job's own."""
    data, model, optim, tr = cfg.data, cfg.model, cfg.optim, cfg.trainer
    if not model.partial_pretrain:
        raise ConfigError("model.partial_pretrain is required: the Hugging Face model dir to train")
    if not data.train_files:
        raise ConfigError("data.train_files is required: one or more parquet / jsonl files")
    for key in ("max_length", "train_batch_size", "micro_batch_size_per_gpu"):
        _positive(f"data.{key}", getattr(data, key))
    if data.train_batch_size % data.micro_batch_size_per_gpu:
        raise ConfigError(f"data.train_batch_size ({data.train_batch_size}) must be a multiple of "
                          f"data.micro_batch_size_per_gpu ({data.micro_batch_size_per_gpu})")
    _choice("data.truncation", data.truncation, ("error", "left", "right"))
    _positive("optim.lr", optim.lr)
    _choice("optim.lr_scheduler", optim.lr_scheduler, ("cosine", "constant", "linear", *HF_SCHEDULES))
    check_schedule_kwargs(optim.lr_scheduler, optim.lr_scheduler_kwargs, optim.lr, "optim.lr_scheduler_kwargs")
    keys = given_keys(cfg)
    if tr.device == "cuda" and ("optim.dtype" not in keys if keys is not None else optim.dtype == "float32"):
        optim.dtype = "bfloat16"  # (unset: verl's mixed precision on a GPU)
    _choice("optim.dtype", optim.dtype, ("float32", "fp32", "bfloat16", "bf16"))
    check_optimizer(optim, "optim")  # the class imports, takes its keyword arguments, and the exemption rule is known
    if not 0 <= optim.warmup_steps_ratio < 1:
        raise ConfigError(f"optim.warmup_steps_ratio must be in [0, 1), got {optim.warmup_steps_ratio}")
    if model.lora_rank < 0:
        raise ConfigError(f"model.lora_rank must be >= 0, got {model.lora_rank}")
    if model.router_aux_loss_coef < 0:
        raise ConfigError(f"model.router_aux_loss_coef must be >= 0, got {model.router_aux_loss_coef}")
    if model.router_aux_loss_coef and isinstance(cfg, (RMConfig, SPINConfig)):
        raise ConfigError("model.router_aux_loss_coef: the router loss is added in SFT, DPO and KTO (not here)")
    if model.neftune_noise_alpha is not None:
        _positive("model.neftune_noise_alpha", model.neftune_noise_alpha)
    if model.use_liger and not isinstance(cfg, SFTConfig):
        raise ConfigError("model.use_liger=True: the LM head run with the log-probs is SFT's (tiller sft); this job "
                          "computes its logits whole")
    check_quantization(model, "model", model.lora_rank > 0 or bool(model.lora_adapter_path))
    for flag in ("use_rslora", "use_dora", "modules_to_save", "target_parameters"):
        if getattr(model, flag) and not (model.lora_rank > 0 or model.lora_adapter_path):
            raise ConfigError(f"model.{flag}={getattr(model, flag)} needs LoRA (model.lora_rank > 0 or "
                              "model.lora_adapter_path)")
    for name in tr.logger:
        _choice("trainer.logger", name, LOGGERS)
    _choice("trainer.resume_mode", tr.resume_mode, ("auto", "disable", "resume_path"))
    _choice("trainer.strategy", tr.strategy, ("fsdp", "ddp"))
    if tr.resume_mode == "resume_path" and not tr.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    _positive("trainer.total_epochs", tr.total_epochs)
    _validate_best_metric(cfg)
    # before any model work: the template compiles and renders (with SFT's kwargs)
    check_chat_template_settings(model.custom_chat_template, getattr(data, "apply_chat_template_kwargs", {}),
                                 template_key="model.custom_chat_template",
                                 kwargs_key="data.apply_chat_template_kwargs")
    if isinstance(cfg, SFTConfig):
        _choice("data.format", data.format, ("auto", "prompt_response", "messages", "text"))
        _choice("algorithm.loss", cfg.algorithm.loss, ("nll", "dft"))
        if not 0.0 <= cfg.algorithm.label_smoothing < 1.0:
            raise ConfigError(f"algorithm.label_smoothing must be in [0, 1), got {cfg.algorithm.label_smoothing}")
        if cfg.algorithm.label_smoothing and cfg.algorithm.loss != "nll":
            raise ConfigError(f"algorithm.label_smoothing={cfg.algorithm.label_smoothing} smooths the nll loss; "
                              f"algorithm.loss={cfg.algorithm.loss} (TRL applies it with loss_type nll only)")
        if data.pack_length is not None:
            _positive("data.pack_length", data.pack_length)
    if isinstance(cfg, RMConfig):
        _choice("algorithm.loss", cfg.algorithm.loss, ("sigmoid", "logexp"))
        if cfg.algorithm.center_rewards_coefficient < 0:
            raise ConfigError("algorithm.center_rewards_coefficient must be >= 0, got "
                              f"{cfg.algorithm.center_rewards_coefficient}")
    if isinstance(cfg, (DPOConfig, KTOConfig)):
        _validate_ref_sync(cfg)
    if isinstance(cfg, DPOConfig):
        _validate_dpo(cfg)
    if isinstance(cfg, SPINConfig):
        _validate_spin(cfg)
    if isinstance(cfg, KTOConfig):
        _positive("algorithm.beta", cfg.algorithm.beta)
        if cfg.algorithm.desirable_weight < 0 or cfg.algorithm.undesirable_weight < 0:
            raise ConfigError("algorithm.desirable_weight and algorithm.undesirable_weight must be >= 0")
        _choice("algorithm.loss", cfg.algorithm.loss, ("kto", "apo_zero_unpaired"))
        if cfg.algorithm.loss == "kto" and cfg.data.train_batch_size < 2:
            raise ConfigError("KTO needs data.train_batch_size >= 2: the KL baseline pairs each prompt with "
                              "another example's completion")


def _validate_ref_sync(cfg: Any) -> None:
    """TR-DPO's reference updates need a reference model of their own."""
    algo, model = cfg.algorithm, cfg.model
    if not check_ref_sync(algo.ref_model_sync_steps, algo.ref_model_mixup_alpha, "algorithm.",
                          model.lora_rank > 0 or bool(model.lora_adapter_path),
                          "the reference is the policy with its adapters off, or a full model the adapters cannot be "
                          "mixed into"):
        return
    if getattr(cfg.data, "ref_chosen_logps_key", None):
        raise ConfigError("algorithm.ref_model_sync_steps: refused with precomputed reference log-probs "
                          "(data.ref_chosen_logps_key): there is no reference model to update")


def _validate_dpo(cfg: DPOConfig) -> None:
    algo = cfg.algorithm
    names = dpo_loss_names(algo.loss)
    valid = ("dpo", "cdpo", *DPO_LOSS_TYPES, "sft", *REFERENCE_FREE_LOSSES)
    for name in names:
        _choice("algorithm.loss", name, valid)
    if len(set(names)) != len(names):
        raise ConfigError(f"algorithm.loss={names}: a loss named twice")
    if algo.loss_weights is not None and (len(algo.loss_weights) != len(names)
                                          or any(float(w) < 0 for w in algo.loss_weights)):
        raise ConfigError(f"algorithm.loss_weights={list(algo.loss_weights)}: one weight >= 0 per loss of "
                          f"algorithm.loss={names}")
    _positive("algorithm.beta", algo.beta)
    if not 0 <= algo.label_smoothing < 0.5:
        raise ConfigError(f"algorithm.label_smoothing must be in [0, 0.5), got {algo.label_smoothing}")
    if "cdpo" in names and algo.label_smoothing == 0:
        raise ConfigError("algorithm.loss=cdpo needs algorithm.label_smoothing > 0 (e.g. 0.1)")
    if "exo_pair" in names and algo.label_smoothing == 0:
        raise ConfigError("algorithm.loss=exo_pair needs algorithm.label_smoothing > 0 (the EXO paper uses 1e-3)")
    smoothed = {"dpo", "cdpo", "robust", "exo_pair", "aot", "aot_unpaired", "cpo", "simpo"}
    if algo.label_smoothing != 0 and not set(names) & smoothed:
        raise ConfigError(f"algorithm.label_smoothing applies to {', '.join(sorted(smoothed))}, not {names}")
    _choice("algorithm.f_divergence", algo.f_divergence, F_DIVERGENCES)
    allowed = {"dpo", "cdpo", "sft", *F_DIVERGENCE_LOSSES}
    if algo.f_divergence != "reverse_kl" and not set(names) <= allowed:
        raise ConfigError(f"algorithm.f_divergence={algo.f_divergence}: only for {', '.join(sorted(allowed))} (the "
                          f"reparameterised log Z cancels only in their chosen - rejected difference), not {names}")
    _positive("algorithm.discopop_tau", algo.discopop_tau)
    if algo.cpo_alpha < 0:
        raise ConfigError(f"algorithm.cpo_alpha must be >= 0, got {algo.cpo_alpha}")
    free = set(names) & set(REFERENCE_FREE_LOSSES)
    if free and (algo.f_divergence != "reverse_kl" or algo.ld_alpha is not None or algo.use_weighting):
        raise ConfigError(f"algorithm.loss={names}: {', '.join(sorted(free))} read no reference, so "
                          "f_divergence / ld_alpha / use_weighting (which shape the policy-reference log-ratios) do "
                          "not apply")
    if algo.simpo_gamma != DPOAlgoConfig.simpo_gamma and "simpo" not in names:
        raise ConfigError(f"algorithm.simpo_gamma={algo.simpo_gamma} is read only with algorithm.loss=simpo")
    if algo.cpo_alpha != DPOAlgoConfig.cpo_alpha and not set(names) & {"cpo", "cpo_hinge", "cpo_ipo"}:
        raise ConfigError(f"algorithm.cpo_alpha={algo.cpo_alpha} is read only with algorithm.loss=cpo / cpo_hinge / "
                          "cpo_ipo (SimPO with an NLL term: algorithm.loss=[simpo,sft] "
                          "algorithm.loss_weights=[1,ALPHA])")
    if algo.alphapo_alpha and not set(names) <= {*ALPHAPO_LOSSES, "sft"}:
        raise ConfigError(f"algorithm.alphapo_alpha={algo.alphapo_alpha}: AlphaPO's reward transformation applies to "
                          f"{', '.join(ALPHAPO_LOSSES)} (and an sft term beside them), not {names}")
    if algo.ld_alpha is not None and not 0 <= algo.ld_alpha <= 1:
        raise ConfigError(f"algorithm.ld_alpha must be in [0, 1] or null, got {algo.ld_alpha}")
    if algo.use_weighting and set(names) & {"aot", "aot_unpaired"}:
        raise ConfigError("algorithm.use_weighting (WPO) with aot / aot_unpaired: those losses sort the pairs, so "
                          "per-pair weights would not line up")
    precomputed = cfg.data.ref_chosen_logps_key is not None
    if precomputed and algo.ld_alpha is not None:
        raise ConfigError("algorithm.ld_alpha needs the reference's per-token log-probs: not with "
                          "data.ref_chosen_logps_key (precomputed sums)")
    keys = (cfg.data.ref_chosen_logps_key, cfg.data.ref_rejected_logps_key)
    if (keys[0] is None) != (keys[1] is None):
        raise ConfigError("set both data.ref_chosen_logps_key and data.ref_rejected_logps_key, or neither")
    if not uses_reference(names):
        for key, value in (("model.ref_path", cfg.model.ref_path), ("data.ref_chosen_logps_key", keys[0]),
                           ("algorithm.ref_model_sync_steps", algo.ref_model_sync_steps)):
            if value is not None:
                raise ConfigError(f"{key} is set but algorithm.loss={names} reads no reference model")


def uses_reference(loss_names: list[str]) -> bool:
    """Whether a `tiller dpo` loss list reads a reference (every loss but sft and the reference-free ones)."""
    return not set(loss_names) <= {"sft", *REFERENCE_FREE_LOSSES}


def _validate_spin(cfg: SPINConfig) -> None:
    algo = cfg.algorithm
    _positive("algorithm.iterations", algo.iterations)
    _positive("algorithm.beta", algo.beta)
    _positive("algorithm.max_new_tokens", algo.max_new_tokens)
    _positive("algorithm.temperature", algo.temperature)
    if not 0 < algo.top_p <= 1:
        raise ConfigError(f"algorithm.top_p must be in (0, 1], got {algo.top_p}")
    if cfg.model.ref_path is not None:
        raise ConfigError("model.ref_path is refused by `tiller spin`: the reference of each iteration is the "
                          "previous iteration's model (the paper's p_theta_t)")
