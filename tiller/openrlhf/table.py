"""The one table of OpenRLHF's flags: every option of `train_sft`, `train_rm`, `train_dpo`, `train_kto` and
`train_ppo_ray`, flat (0.8.x) and dotted (0.10+), in one of three classes.

- mapped:  translated into tiller config keys (with unit and default conversions; OpenRLHF's default is
           written out whenever tiller's differs). `text` names the tiller keys.
- hint:    a hardware / launcher setting: accepted; when given, one notice line says what tiller does instead.
- refused: given with a value other than OpenRLHF's default, the run stops (exit 2) naming the flag and `text`.

A row is keyed by the flat name (a dotted-only option by its dotted name); `dotted` lists the 0.10+ spellings
of the same setting. `jobs` overrides the class per job where it differs ({"P": (kind, text)}).
`tests/openrlhf/test_table.py` checks that every option of `tiller.openrlhf.spec` has exactly one row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAPPED, HINT, REFUSED = "mapped", "hint", "refused"
JOB_LETTER = {"train_sft": "S", "train_rm": "R", "train_dpo": "D", "train_kto": "K", "train_ppo_ray": "P"}


@dataclass(frozen=True)
class Flag:
    name: str
    kind: str
    text: str
    dotted: tuple[str, ...] = ()
    jobs: dict[str, tuple[str, str]] = field(default_factory=dict)

    def for_job(self, job: str) -> tuple[str, str]:
        """(class, text) of this flag in `job` (train_sft, ..., train_ppo_ray)."""
        return self.jobs.get(JOB_LETTER[job], (self.kind, self.text))


def _f(name: str, kind: str, text: str, *dotted: str, **jobs: tuple[str, str]) -> Flag:
    return Flag(name, kind, text, tuple(dotted), dict(jobs))


_DS = "DeepSpeed setting: tiller trains in one process (no DeepSpeed); "
_FSDP = "FSDP2 backend setting: tiller shards with FSDP2 (RL: trainer.backend=ray; SFT / RM / DPO: torchrun); "
_GPUS = "a Ray / GPU placement setting: tiller runs every role in this process (trainer.backend=local)"
_SEQ_SPLIT = ("a sequence split over GPUs (the same math): tiller's process runs whole sequences; on Ray workers tiller "
              "splits them with Ulysses (PPO: actor_rollout_ref.actor.ulysses_sequence_parallel_size, "
              "critic.ulysses_sequence_parallel_size)")
_SFT_SPLIT = ("ulysses_sequence_parallel_size: under torchrun groups of this many ranks split each micro-batch's "
              "tokens (Ulysses instead of ring attention, the same math); one process runs whole sequences")
_VLLM = "a vLLM engine setting: tiller samples with its rollout engine (actor_rollout_ref.rollout.name, native on CPU)"

TABLE: tuple[Flag, ...] = (
    # ------------------------------------------------------------------ models
    _f("pretrain", MAPPED, "model.partial_pretrain (PPO: actor_rollout_ref.model.path)",
       "model.model_name_or_path", "actor.model_name_or_path"),
    _f("reward_pretrain", MAPPED, "reward_model.enable=True, reward_model.model.path (one model; a comma list is "
       "refused)", "reward.model_name_or_path"),
    _f("critic_pretrain", MAPPED, "critic.model.path (gae; default: the reward model, or the policy with a remote "
       "reward)", "critic.model_name_or_path"),
    _f("ref_pretrain", MAPPED, "model.ref_path", "ref.model_name_or_path"),
    _f("remote_rm_url", MAPPED, "http(s) URL: reward_model.remote_url + reward_model.remote_format=openrlhf; a .py "
       "file: custom_reward_function.path, name=reward_func, reward_model.reward_manager=openrlhf",
       "reward.remote_url"),
    _f("value_head_prefix", REFUSED, "tiller's reward / value heads are transformers' `score` head only",
       "ds.value_head_prefix", "fsdp.value_head_prefix"),
    _f("agent_func_path", MAPPED, "actor_rollout_ref.rollout.agent.env_path (the file's AgentExecutor: its "
       "AgentInstance driven by tiller's environment loop as OpenRLHF's MultiTurnAgentExecutor drives it; "
       "agent.max_context = --max_len; the agent's rewards replace any reward model)", "train.agent_func_path"),
    # ------------------------------------------------------------------ data
    _f("dataset", MAPPED, "data.train_files (comma list; a dataset name loads through datasets.load_dataset)",
       "data.dataset"),
    _f("dataset_probs", MAPPED, "data.train_probs (interleave the --dataset sources)", "data.dataset_probs"),
    _f("dataset_split", MAPPED, "data.train_split", "data.dataset_split"),
    _f("prompt_data", MAPPED, "data.train_files", "data.prompt_dataset"),
    _f("prompt_data_probs", MAPPED, "data.train_probs", "data.prompt_probs"),
    _f("prompt_split", MAPPED, "data.train_split", "data.prompt_split"),
    _f("eval_dataset", MAPPED, "data.val_files", "eval.dataset"),
    _f("eval_split", MAPPED, "data.val_split", "eval.split"),
    _f("train_split", HINT, "declared but unused by OpenRLHF's train_sft (use --dataset_split)"),
    _f("max_samples", MAPPED, "data.max_samples", "data.max_samples"),
    _f("input_key", MAPPED, "data.input_key (KTO: data.prompt_key; PPO: data.prompt_key)", "data.input_key"),
    _f("output_key", MAPPED, "data.output_key (KTO: data.completion_key)", "data.output_key"),
    _f("label_key", MAPPED, "KTO: data.label_key; PPO: data.label_key (ground truth) + data.default_data_source",
       "data.label_key"),
    _f("prompt_key", MAPPED, "data.prompt_key (None: the prompt is inside the chosen / rejected conversations: "
       "data.prompt_key=null)", "data.prompt_key"),
    _f("chosen_key", MAPPED, "data.chosen_key", "data.chosen_key"),
    _f("rejected_key", MAPPED, "data.rejected_key", "data.rejected_key"),
    _f("input_template", MAPPED, "data.input_template", "data.input_template"),
    _f("apply_chat_template", MAPPED, "data.apply_chat_template (OpenRLHF's default: off)",
       "data.apply_chat_template"),
    _f("tokenizer_chat_template", MAPPED, "model.custom_chat_template: replaces the tokenizer's chat template",
       "data.tokenizer_chat_template"),
    _f("max_len", MAPPED, "data.max_length with data.truncation=right (PPO: prompt + response budget)",
       "data.max_len"),
    _f("prompt_max_len", MAPPED, "data.max_prompt_length, data.truncation=right"),
    _f("generate_max_len", MAPPED, "data.max_response_length", "rollout.max_new_tokens"),
    _f("multiturn", MAPPED, "data.format=messages, data.messages_key=<input_key> (loss on every assistant turn)",
       "data.multiturn"),
    _f("pretrain_mode", REFUSED, "continued pretraining (loss on every token) is not a tiller sft mode",
       "model.pretrain_mode_enable"),
    _f("disable_fast_tokenizer", REFUSED, "tiller loads the tokenizer with AutoTokenizer's default (fast)",
       "data.disable_fast_tokenizer"),
    _f("data.dataloader_num_workers", HINT, "tiller tokenizes the data once up front (no data-loader workers)"),
    _f("data.image_key", MAPPED, "data.image_key (PPO: image prompts of a vision-language model, docs/vlm.md)",
       S=(REFUSED, "OpenRLHF's SFT image data is not translated yet; `tiller sft` takes verl's multi-turn image "
          "parquet directly (data.image_key, docs/vlm.md)"),
       R=(REFUSED, "reward models on images are not supported"), D=(REFUSED, "DPO on images is not supported"),
       K=(REFUSED, "KTO on images is not supported")),
    _f("data.max_images_per_prompt", HINT, "tiller encodes every image of a row (no per-prompt cap; the prompt's "
       "tokens, image tokens included, are capped by data.max_prompt_length)"),
    _f("actor.freeze_visual_encoder", MAPPED, "actor_rollout_ref.actor.freeze_vision_tower",
       S=(REFUSED, "OpenRLHF's SFT image flags are not translated yet; `tiller sft` takes verl's multi-turn image "
          "parquet directly, with model.freeze_vision_tower (docs/vlm.md)")),
    _f("use_ms", REFUSED, "ModelScope hub: tiller loads local dirs and the Hugging Face cache only", "use_ms"),
    # ------------------------------------------------------------------ batches and schedule
    _f("train_batch_size", MAPPED, "data.train_batch_size (PPO: samples per update: actor.ppo_mini_batch_size = "
       "train_batch_size / n_samples_per_prompt prompts)", "train.batch_size"),
    _f("micro_train_batch_size", MAPPED, "data.micro_batch_size_per_gpu (PPO: actor / critic "
       "ppo_micro_batch_size_per_gpu, samples)", "train.micro_batch_size"),
    _f("rollout_batch_size", MAPPED, "data.train_batch_size (prompts per step)", "rollout.batch_size"),
    _f("micro_rollout_batch_size", MAPPED, "rollout / ref log_prob_micro_batch_size_per_gpu, "
       "critic.forward_micro_batch_size_per_gpu, reward_model.micro_batch_size_per_gpu", "rollout.micro_batch_size"),
    _f("n_samples_per_prompt", MAPPED, "actor_rollout_ref.rollout.n", "rollout.n_samples_per_prompt"),
    _f("max_epochs", MAPPED, "trainer.total_epochs (PPO: actor.ppo_epochs and critic.ppo_epochs)",
       "train.max_epochs"),
    _f("num_episodes", MAPPED, "trainer.total_epochs", "train.num_episodes"),
    _f("use_dynamic_batch", MAPPED, "actor.use_dynamic_bsz (and the log-prob / critic passes)",
       "train.dynamic_batch_enable"),
    _f("train_max_tokens_per_gpu", MAPPED, "actor.ppo_max_token_len_per_gpu, critic.ppo_max_token_len_per_gpu",
       "train.max_tokens_per_gpu"),
    _f("rollout_max_tokens_per_gpu", MAPPED, "rollout / ref log_prob_max_token_len_per_gpu, "
       "critic.forward_max_token_len_per_gpu", "rollout.max_tokens_per_gpu"),
    _f("vllm_generate_batch_size", HINT, "tiller generates the whole rollout batch in one engine call "
       "(the engine batches internally)", "rollout.vllm_generate_batch_size"),
    _f("seed", MAPPED, "trainer.seed (PPO: and data.seed); OpenRLHF's default 42", "train.seed"),
    _f("full_determinism", HINT, "tiller runs are seeded and deterministic on CPU without a switch",
       "train.full_determinism_enable"),
    # ------------------------------------------------------------------ optimizer
    _f("learning_rate", MAPPED, "optim.lr", "adam.lr"),
    _f("actor_learning_rate", MAPPED, "actor_rollout_ref.actor.optim.lr", "actor.adam.lr"),
    _f("critic_learning_rate", MAPPED, "critic.optim.lr", "critic.adam.lr"),
    _f("adam_betas", MAPPED, "optim.betas (PPO: actor and critic); OpenRLHF's default (0.9, 0.95)",
       "adam.betas", "actor.adam.betas"),
    _f("critic.adam.betas", MAPPED, "critic.optim.betas"),
    _f("adam.eps", MAPPED, "AdamW eps: OpenRLHF's 1e-8 is tiller's (PPO: actor.optim.eps)", "actor.adam.eps"),
    _f("critic.adam.eps", MAPPED, "critic.optim.eps"),
    _f("l2", MAPPED, "optim.weight_decay (PPO: actor and critic) on the parameters OpenRLHF decays: not biases or "
       "norm weights (optim.weight_decay_exempt=openrlhf); OpenRLHF's default 0", "adam.weight_decay",
       "actor.adam.weight_decay"),
    _f("critic.adam.weight_decay", MAPPED, "critic.optim.weight_decay"),
    _f("lr_scheduler", MAPPED, "cosine_with_min_lr -> cosine to min_lr_ratio x lr; cosine -> cosine to 0; "
       "constant_with_warmup -> constant; linear, cosine_with_restarts, polynomial, inverse_sqrt -> transformers' "
       "formulas with their default keywords (others refused)", "lr_scheduler", "actor.lr_scheduler"),
    _f("critic.lr_scheduler", MAPPED, "critic.optim.warmup_style / min_lr_ratio"),
    _f("lr_warmup_ratio", MAPPED, "optim.warmup_steps_ratio (PPO: optim.lr_warmup_steps_ratio); OpenRLHF's 3%",
       "lr_warmup_ratio", "actor.lr_warmup_ratio"),
    _f("critic.lr_warmup_ratio", MAPPED, "critic.optim.lr_warmup_steps_ratio"),
    _f("min_lr_ratio", MAPPED, "optim.min_lr_ratio (cosine floor; OpenRLHF's 0.1)", "min_lr_ratio",
       "actor.min_lr_ratio"),
    _f("critic.min_lr_ratio", MAPPED, "critic.optim.min_lr_ratio"),
    _f("max_norm", MAPPED, "optim.clip_grad (PPO: actor.grad_clip, critic.grad_clip)", "max_norm",
       "actor.max_norm"),
    _f("critic.max_norm", MAPPED, "critic.grad_clip"),
    _f("optim", REFUSED, "tiller's optimizer is AdamW (muon is not available)", "actor.optim", "critic.optim"),
    _f("muon.lr", REFUSED, "Muon is not available (AdamW only)", "actor.muon.lr", "critic.muon.lr"),
    _f("muon.momentum", REFUSED, "Muon is not available (AdamW only)", "actor.muon.momentum", "critic.muon.momentum"),
    _f("muon.ns_steps", REFUSED, "Muon is not available (AdamW only)", "actor.muon.ns_steps", "critic.muon.ns_steps"),
    _f("muon.nesterov", REFUSED, "Muon is not available (AdamW only)", "actor.muon.nesterov",
       "critic.muon.nesterov"),
    _f("muon.no_nesterov", REFUSED, "Muon is not available (AdamW only)", "actor.muon.no_nesterov",
       "critic.muon.no_nesterov"),
    _f("muon.weight_decay", REFUSED, "Muon is not available (AdamW only)", "actor.muon.weight_decay",
       "critic.muon.weight_decay"),
    _f("aux_loss_coef", MAPPED, "model.router_aux_loss_coef (a mixture-of-experts model's router load-balancing loss)",
       "model.aux_loss_coef", "actor.aux_loss_coef",
       R=(REFUSED, "no router loss in tiller's reward-model job"),
       P=(MAPPED, "actor_rollout_ref.actor.router_aux_loss_coef (the actor's update; OpenRLHF adds it to a "
                  "mixture-of-experts critic's loss too, tiller's critic has none)")),
    # ------------------------------------------------------------------ precision, memory, kernels
    _f("bf16", MAPPED, "optim.dtype / actor.dtype / critic.dtype = bfloat16 (else float32)"),
    _f("ds.param_dtype", MAPPED, "optim.dtype / actor.dtype / critic.dtype: bf16 -> bfloat16, fp32 -> float32 "
       "(OpenRLHF 0.10+'s default bf16)", "fsdp.param_dtype"),
    _f("flash_attn", HINT, "tiller loads models with transformers' default attention (sdpa)"),
    _f("ds.attn_implementation", HINT, "tiller loads models with transformers' default attention (sdpa)",
       "fsdp.attn_implementation"),
    _f("ds.experts_implementation", HINT, "tiller loads MoE models with transformers' default experts code"),
    _f("gradient_checkpointing", MAPPED, "model.enable_gradient_checkpointing (PPO: actor_rollout_ref.model.)",
       "model.gradient_checkpointing_enable", "actor.gradient_checkpointing_enable"),
    _f("gradient_checkpointing_use_reentrant", HINT, "tiller uses transformers' default (non-reentrant) "
       "checkpointing", "model.gradient_checkpointing_reentrant", "actor.gradient_checkpointing_reentrant"),
    _f("packing_samples", MAPPED, "SFT: data.packing=True; PPO: actor_rollout_ref.model.use_remove_padding=True and "
       "critic.model.use_remove_padding=True (each micro-batch's rows packed into one sequence); RM / DPO: notice "
       "(tiller pads and trims each micro-batch)", "ds.packing_samples", "fsdp.packing_samples"),
    _f("fsdp.no_packing_samples", HINT, "packing off: tiller pads and trims each micro-batch unless packing is on "
       "(SFT: data.packing)"),
    _f("use_liger_kernel", HINT, "tiller uses its own chunked log-prob / entropy kernels", "ds.use_liger_kernel",
       "fsdp.use_liger_kernel"),
    _f("load_in_4bit", MAPPED, "QLoRA (with --lora_rank): model.load_in_4bit / actor_rollout_ref.model.load_in_4bit "
       "(and critic.model.load_in_4bit for the PPO critic, as OpenRLHF quantizes it too), nf4 with double "
       "quantization as OpenRLHF's BitsAndBytesConfig (bitsandbytes)", "ds.load_in_4bit"),
    _f("lora_rank", MAPPED, "model.lora_rank", "ds.lora.rank", "fsdp.lora.rank"),
    _f("lora_alpha", MAPPED, "model.lora_alpha", "ds.lora.alpha", "fsdp.lora.alpha"),
    _f("target_modules", MAPPED, "model.target_modules", "ds.lora.target_modules", "fsdp.lora.target_modules"),
    _f("lora_dropout", MAPPED, "model.lora_dropout (PPO: actor_rollout_ref.model.lora_dropout and, with critic LoRA, "
       "critic.model.lora_dropout: in the updates' forwards only)",
       "ds.lora.dropout", "fsdp.lora.dropout"),
    _f("zero_stage", MAPPED, "trainer.strategy: 0 / 1 -> ddp, 2 / 3 -> fsdp (FSDP2), used when the job runs under "
       "torchrun --nproc_per_node N", "ds.zero_stage",
       P=(HINT, _DS + "tiller's RL workers shard with FSDP2 on Ray (trainer.backend=ray, actor strategy fsdp)")),
    _f("zpg", HINT, _DS + "no ZeRO++ partitions", "ds.zpg"),
    _f("adam_offload", HINT, _DS + "optimizer states stay with the model", "ds.adam_offload"),
    _f("overlap_comm", HINT, _DS + "no communication to overlap", "ds.overlap_comm"),
    _f("grad_accum_dtype", HINT, _DS + "gradients accumulate in float32", "ds.grad_accum_dtype"),
    _f("deepcompile", HINT, _DS + "no compilation", "ds.deepcompile"),
    _f("ds_tensor_parallel_size", HINT, _DS + "no tensor parallelism in training", "ds.tensor_parallel_size",
       P=(MAPPED, "no tensor parallelism in training (same math); the token budgets are OpenRLHF's per GPU of the "
          "group: x this size")),
    _f("ring_attn_size", HINT, _SEQ_SPLIT, "ds.ring_attn_size",
       P=(MAPPED, _SEQ_SPLIT + "; the token budgets are OpenRLHF's per GPU of the ring: x this size"),
       S=(MAPPED, _SFT_SPLIT), D=(MAPPED, _SFT_SPLIT), R=(MAPPED, _SFT_SPLIT)),
    _f("ring_head_stride", HINT, "ring attention's head layout: " + _SEQ_SPLIT, "ds.ring_attn_head_stride"),
    _f("local_rank", HINT, "set by the deepspeed launcher; tiller runs one process", "local_rank"),
    _f("deepspeed_enable_sleep", HINT, "tiller's in-process engines share the actor's weights (nothing to "
       "offload while sampling)", "ds.enable_sleep", "fsdp.enable_sleep"),
    # the FSDP2 / AutoModel backend's own flags (OpenRLHF's `automodel` branch; the rest alias the --ds.* rows)
    _f("fsdp.tp_size", HINT, _FSDP + "no tensor parallelism in training (each rank holds whole layers; same math)"),
    _f("fsdp.cp_size", HINT, "context parallelism: " + _SEQ_SPLIT),
    _f("fsdp.ep_size", HINT, _FSDP + "no expert parallelism (each rank holds every expert; same math)"),
    _f("fsdp.pp_size", HINT, _FSDP + "no pipeline parallelism (each rank holds every layer; same math)"),
    _f("fsdp.sequence_parallel", HINT, _FSDP + "no tensor parallelism, so no sequence parallelism in it"),
    _f("fsdp.no_sequence_parallel", HINT, _FSDP + "no tensor parallelism, so no sequence parallelism in it"),
    _f("fsdp.cpu_offload", HINT, _FSDP + "parameters stay on the training device (no per-layer CPU offload)"),
    _f("fsdp.force_hf_model", HINT, "tiller always loads the transformers (HF) model classes"),
    _f("ref_offload", HINT, "the reference model stays in memory (tiller: one process)", "ref.offload"),
    _f("ref_reward_offload", HINT, "reference and reward models stay in memory (tiller: one process)",
       "reward.offload"),
    # ------------------------------------------------------------------ checkpoints and logging
    _f("save_path", MAPPED, "trainer.default_local_dir (the run dir; the final HF model goes to "
       "<run dir>/hf_model)", "ckpt.output_dir"),
    _f("ckpt_path", HINT, "tiller keeps checkpoints in <run dir>/checkpoints (the run dir is the save path)",
       "ckpt.path"),
    _f("save_steps", MAPPED, "trainer.save_freq", "ckpt.save_steps"),
    _f("save_hf_ckpt", HINT, "tiller checkpoints hold a from_pretrained model dir already", "ckpt.save_hf"),
    _f("disable_ds_ckpt", HINT, "tiller writes its own checkpoints (no DeepSpeed ones)", "ckpt.disable_ds"),
    _f("use_ds_universal_ckpt", HINT, "tiller's checkpoints do not depend on the world size",
       "ds.use_universal_ckpt"),
    _f("max_ckpt_num", MAPPED, "trainer.max_ckpt_to_keep (PPO: trainer.max_actor_ckpt_to_keep)", "ckpt.max_num"),
    _f("max_ckpt_mem", HINT, "tiller bounds checkpoints by count (--max_ckpt_num), not by size", "ckpt.max_mem"),
    _f("ckpt.best_metric_key", HINT, "tiller keeps the newest checkpoints (no best-metric copy)"),
    _f("load_checkpoint", MAPPED, "trainer.resume_mode=auto (absent: disable; OpenRLHF resumes only on request)",
       "ckpt.load_enable"),
    _f("logging_steps", HINT, "tiller logs every step", "logger.logging_steps"),
    _f("eval_steps", MAPPED, "trainer.test_freq (-1: offline jobs at the end; PPO never, as OpenRLHF)",
       "eval.steps"),
    _f("use_wandb", MAPPED, "trainer.logger += wandb (a key is exported as WANDB_API_KEY)", "logger.wandb.key"),
    _f("wandb_org", MAPPED, "environment WANDB_ENTITY", "logger.wandb.org"),
    _f("wandb_group", MAPPED, "environment WANDB_RUN_GROUP", "logger.wandb.group"),
    _f("wandb_project", MAPPED, "trainer.project_name", "logger.wandb.project"),
    _f("wandb_run_name", MAPPED, "trainer.experiment_name (strftime-expanded as OpenRLHF does)",
       "logger.wandb.run_name"),
    _f("use_tensorboard", HINT, "tiller always writes TensorBoard logs to <run dir>/tensorboard",
       "logger.tensorboard_dir"),
    # ------------------------------------------------------------------ SFT / RM / DPO / KTO losses
    _f("loss", MAPPED, "algorithm.loss: sigmoid -> sigmoid, anything else -> logexp", "model.loss_type"),
    _f("margin_loss", MAPPED, "data.margin_key=margin", "model.margin_loss_enable"),
    _f("compute_fp32_loss", HINT, "tiller computes every loss in float32", "model.compute_fp32_loss_enable"),
    _f("beta", MAPPED, "algorithm.beta", "model.beta"),
    _f("ipo", MAPPED, "algorithm.loss=ipo", "model.ipo_enable"),
    _f("label_smoothing", MAPPED, "algorithm.loss=cdpo, algorithm.label_smoothing", "model.label_smoothing"),
    _f("nll_loss_coef", REFUSED, "DPO + NLL (Llama 3.1 style) is not in tiller's DPO", "model.nll_loss_coef"),
    _f("desirable_loss_weight", MAPPED, "algorithm.desirable_weight"),
    _f("undesirable_loss_weight", MAPPED, "algorithm.undesirable_weight"),
    # ------------------------------------------------------------------ PPO algorithm
    _f("advantage_estimator", MAPPED, "algorithm.adv_estimator: gae, reinforce -> reinforce_plus_plus, rloo, "
       "reinforce_baseline -> reinforce_plus_plus_baseline, group_norm -> grpo, dr_grpo -> grpo with "
       "norm_adv_by_std_in_grpo=False", "algo.advantage.estimator"),
    _f("no_advantage_std_norm", MAPPED, "no effect with rloo / group_norm / dr_grpo (as in OpenRLHF); refused with "
       "gae / reinforce / reinforce_baseline (tiller's whitening always divides by the std)",
       "algo.advantage.no_std_norm"),
    _f("gamma", MAPPED, "algorithm.gamma", "algo.advantage.gamma"),
    _f("lambd", MAPPED, "algorithm.lam", "algo.advantage.lambd"),
    _f("init_kl_coef", MAPPED, "actor.kl_loss_coef with --use_kl_loss, else algorithm.use_kl_in_reward=True and "
       "algorithm.kl_ctrl.kl_coef (OpenRLHF's default 0.01 in the reward; 0 turns KL off)", "algo.kl.init_coef"),
    _f("use_kl_loss", MAPPED, "actor.use_kl_loss", "algo.kl.use_loss"),
    _f("kl_estimator", MAPPED, "k1 -> kl, k2 -> mse, k3 -> low_var_kl: actor.kl_loss_type or algorithm.kl_penalty",
       "algo.kl.estimator"),
    _f("kl_target", MAPPED, "algorithm.kl_ctrl.type=adaptive, target_kl (KL in reward only)", "algo.kl.target"),
    _f("kl_horizon", MAPPED, "algorithm.kl_ctrl.horizon", "algo.kl.horizon"),
    _f("eps_clip", MAPPED, "actor.clip_ratio", "actor.eps_clip"),
    _f("eps_clip_low_high", MAPPED, "actor.clip_ratio_low, actor.clip_ratio_high", "actor.eps_clip_low_high"),
    _f("dual_clip", MAPPED, "actor.clip_ratio_c (absent: 1e9, i.e. no dual clip as in OpenRLHF)", "actor.dual_clip"),
    _f("value_clip", MAPPED, "critic.cliprange_value", "critic.value_clip"),
    _f("policy_loss_type", MAPPED, "actor.policy_loss.loss_mode: ppo -> vanilla, gspo -> gspo",
       "actor.policy_loss_type"),
    _f("entropy_loss_coef", MAPPED, "actor.entropy_coeff (None: 0)", "actor.entropy_coef"),
    _f("temperature", MAPPED, "actor_rollout_ref.rollout.temperature", "rollout.temperature"),
    _f("top_p", MAPPED, "actor_rollout_ref.rollout.top_p", "rollout.top_p"),
    _f("eval_temperature", MAPPED, "rollout.val_kwargs.temperature (do_sample when > 0)", "eval.temperature"),
    _f("eval_n_samples_per_prompt", MAPPED, "rollout.val_kwargs.n", "eval.n_samples_per_prompt"),
    _f("freezing_actor_steps", MAPPED, "trainer.critic_warmup", "critic.freezing_steps"),
    _f("save_value_network", HINT, "tiller's checkpoints always hold the critic (<run dir>/checkpoints/critic)",
       "critic.save_value_network"),
    _f("normalize_reward", MAPPED, "reward_model.normalize (mean / std from the reward model's config.json)",
       "reward.normalize_enable"),
    _f("reward_clip_range", MAPPED, "reward_model.clip_range (OpenRLHF's default [-10, 10])", "reward.clip_range"),
    _f("overlong_buffer_len", MAPPED, "reward_model.overlong_buffer.enable / len, reward_manager=dapo",
       "reward.overlong_buffer_len"),
    _f("overlong_penalty_factor", MAPPED, "reward_model.overlong_buffer.penalty_factor",
       "reward.overlong_penalty_factor"),
    _f("reward.stop_properly_penalty_coef", MAPPED, "reward_model.stop_properly_penalty_coef (ProRL: truncated "
       "samples' reward scaled by coef in [0, 1], or set to coef when negative)"),
    _f("dynamic_filtering", MAPPED, "algorithm.filter_groups.enable=True, metric=acc (OpenRLHF's scores; drop "
       "groups whose scores are all equal)", "algo.dynamic_filtering_enable"),
    _f("dynamic_filtering_reward_range", MAPPED, "(0, 1) only: the same groups as tiller's equal-score filter for "
       "0 / 1 rewards; other ranges refused", "algo.dynamic_filtering_range"),
    _f("enable_vllm_is_correction", MAPPED, "algorithm.rollout_correction.rollout_is=token",
       "algo.advantage.is_correction_enable"),
    _f("vllm_is_truncated_threshold", MAPPED, "algorithm.rollout_correction.rollout_is_threshold"),
    _f("algo.advantage.is_correction_threshold", MAPPED, "tis: rollout_is_threshold = high; icepop: rollout_rs="
       "token_k1 with threshold 1/high_1/low (verl's k1 bounds p_rollout / p_old)"),
    _f("algo.advantage.is_correction_type", MAPPED, "tis -> rollout_is=token; icepop -> rollout_rs=token_k1; "
       "seq-mask-tis refused"),
    _f("enable_ema", REFUSED, "no EMA copy of the actor in tiller", "train.enable_ema"),
    _f("ema_beta", HINT, "EMA is not supported (--enable_ema is refused)", "train.ema_beta"),
    _f("async_train", MAPPED, "async_training.staleness_threshold = --train.async_queue_size (OpenRLHF's generator "
       "runs up to that many batches ahead of the trainer; tiller's producer is a thread of the trainer's process, "
       "trainer.backend=local, native / hf engine)", "train.async_enable"),
    _f("train.async_queue_size", MAPPED, "async_training.staleness_threshold (with --train.async_enable; >= 1)"),
    _f("train.partial_rollout_enable", MAPPED, "async_training.partial_rollout=True (with --train.async_enable: "
       "unfinished samples continue under weights that arrive mid-generation)"),
    _f("ptx_coef", HINT, "has no effect in OpenRLHF 0.8.x either (there is no --pretrain_data)"),
    _f("perf", HINT, "declared but unused by OpenRLHF"),
    _f("actor_init_on_gpu", HINT, "declared but unused by OpenRLHF"),
    # ------------------------------------------------------------------ Ray / vLLM placement
    _f("actor_num_nodes", HINT, _GPUS, "actor.num_nodes"),
    _f("actor_num_gpus_per_node", HINT, _GPUS, "actor.num_gpus_per_node"),
    _f("critic_num_nodes", HINT, _GPUS, "critic.num_nodes"),
    _f("critic_num_gpus_per_node", HINT, _GPUS, "critic.num_gpus_per_node"),
    _f("ref_num_nodes", HINT, _GPUS, "ref.num_nodes"),
    _f("ref_num_gpus_per_node", HINT, _GPUS, "ref.num_gpus_per_node"),
    _f("reward_num_nodes", HINT, _GPUS, "reward.num_nodes"),
    _f("reward_num_gpus_per_node", HINT, _GPUS, "reward.num_gpus_per_node"),
    _f("colocate_actor_ref", HINT, _GPUS, "train.colocate_actor_ref"),
    _f("colocate_critic_reward", HINT, _GPUS, "train.colocate_critic_reward"),
    _f("colocate_all_models", HINT, _GPUS, "train.colocate_all"),
    _f("vllm_num_engines", HINT, _VLLM, "vllm.num_engines"),
    _f("vllm_tensor_parallel_size", HINT, _VLLM, "vllm.tensor_parallel_size"),
    _f("vllm_sync_backend", HINT, "tiller syncs weights in process (in-process engines share the actor's "
       "weights; vllm gets them through collective_rpc)", "vllm.sync_backend"),
    _f("vllm_sync_with_ray", HINT, "tiller syncs weights in process", "vllm.sync_with_ray"),
    _f("enable_prefix_caching", HINT, _VLLM, "vllm.enable_prefix_caching"),
    _f("enforce_eager", MAPPED, "actor_rollout_ref.rollout.enforce_eager (when given)", "vllm.enforce_eager"),
    _f("vllm_enable_sleep", HINT, "in-process engines free nothing between rollouts; vllm sleeps when CUDA is "
       "available", "vllm.enable_sleep"),
    _f("vllm_gpu_memory_utilization", MAPPED, "actor_rollout_ref.rollout.gpu_memory_utilization (when given)",
       "vllm.gpu_memory_utilization"),
)
