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
import sys
from dataclasses import dataclass
from typing import Any, Callable

from tiller.config.readers import schema_sections, config_reads
from tiller.config.schema import DistillationInferenceConfig, FSDPConfig, RLConfig, TraceConfig
from tiller.errors import ConfigError

HONOURED, NOOP, REFUSED = "honoured", "no-op", "refused"


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


def num_workers(cfg: RLConfig) -> int:
    """Data-parallel workers of the actor group: nnodes x n_gpus_per_node with trainer.backend=ray, else 1."""
    tr = cfg.trainer
    return tr.nnodes * tr.n_gpus_per_node if tr.backend == "ray" else 1


_PADDING = ("tiller pads each micro-batch and trims it to the columns its rows use; there are no varlen "
            "kernels to switch on")
_ULYSSES = ("tiller runs whole sequences on each worker (the update is the same; memory per worker is not "
            "split); the token budgets are per worker")
_VLLM = "a vLLM engine knob"

RULES: dict[str, Rule] = {
    "distillation.distillation_loss.policy_loss_mode": refused(
        "the distillation surrogate is PPO's vanilla clipped loss (verl allows only vanilla too)",
        use="leave it vanilla", allowed=("vanilla",)),
    "distillation.distillation_loss.topk": noop("only the *_topk loss modes read it, and tiller refuses them"),
    "distillation.distillation_loss.clip_ratio": noop(
        "verl's vanilla surrogate reads clip_ratio_low / clip_ratio_high, which always have a value"),
    "distillation.num_workers": noop("tiller's teacher is a frozen model inside each actor worker"),
    "distillation.teacher_model.enable_resource_pool": noop("tiller's teacher is a frozen model inside each actor "
                                                            "worker"),
    "distillation.teacher_model.n_gpus_per_node": noop("tiller's teacher is a frozen model inside each actor worker"),
    "distillation.teacher_model.nnodes": noop("tiller's teacher is a frozen model inside each actor worker"),
    "actor_rollout_ref.model.lora.adapter_path": refused(
        "tiller starts new LoRA adapters; loading a saved adapter is not built",
        use="merge the adapter into the base model and point model.path at it", allowed=(None,)),
    "actor_rollout_ref.model.lora.merge": noop("tiller always syncs merged weights (base + adapters) to the rollout "
                                               "engine"),
    "actor_rollout_ref.hybrid_engine": refused(
        "tiller runs actor, rollout and reference in one worker (verl's hybrid engine); the split layout is "
        "not built", use="leave it True", allowed=(True,)),
    "actor_rollout_ref.rollout.multi_turn.format": refused(
        "tiller's agent loop parses Hermes / Qwen tool calls (<tool_call>{json}</tool_call>) only",
        use="format=hermes with a model whose chat template emits <tool_call> blocks", allowed=("hermes",)),
    "actor_rollout_ref.model.use_remove_padding": noop(_PADDING),
    "critic.model.use_remove_padding": noop(_PADDING),
    "reward_model.model.use_remove_padding": noop(_PADDING),
    "actor_rollout_ref.model.use_shm": noop("tiller loads the model from model.path (no /dev/shm copy)"),
    "actor_rollout_ref.model.use_fused_kernels": noop("tiller computes logprobs chunk by chunk from the logits (no "
                                                      "fused LM-head kernels)"),
    "actor_rollout_ref.actor.calculate_sum_pi_squared": noop(
        "tiller's old-logprob forward returns sum pi^2 whenever algorithm.adv_estimator is an optimal token "
        "baseline (the only user), set or not"),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": noop(_ULYSSES),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": noop(_ULYSSES),
    "critic.ulysses_sequence_parallel_size": noop(_ULYSSES),
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
for _key in ("gpu_memory_utilization", "tensor_model_parallel_size", "enforce_eager", "free_cache_engine",
             "max_num_batched_tokens", "enable_chunked_prefill"):
    RULES[f"actor_rollout_ref.rollout.{_key}"] = noop(_VLLM, _vllm, "rollout.name=vllm")

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


def _section_rules() -> None:
    """Every key of every `fsdp_config`, `rollout.trace` and distillation teacher `inference` section is a no-op (its
    field doc says why)."""
    sections, _, _ = schema_sections(RLConfig)
    for path, cls in sections.items():
        if cls in (FSDPConfig, TraceConfig, DistillationInferenceConfig):
            docs = _field_docs(cls)
            for f in dataclasses.fields(cls):
                RULES[f"{path}.{f.name}"] = noop(docs.get(f.name) or "a verl knob with no counterpart in tiller")


def _field_docs(cls: type) -> dict[str, str]:
    """The one-line doc under each field of a schema dataclass."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
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
    "actor_rollout_ref.model.lora.rank": "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.model.lora.alpha": "actor_rollout_ref.model.lora_alpha",
    "actor_rollout_ref.model.lora.target_modules": "actor_rollout_ref.model.target_modules",
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size":
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size":
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
    "critic.model.fsdp_config.ulysses_sequence_parallel_size": "critic.ulysses_sequence_parallel_size",
}
for _f in ("path", "name", "reward_kwargs", "overlong_buffer.enable", "overlong_buffer.len",
           "overlong_buffer.penalty_factor", "overlong_buffer.log"):
    LAYOUT_ALIASES[f"reward.custom_reward_function.{_f}"] = f"custom_reward_function.{_f}"
# verl's on-policy distillation section -> tiller's algorithm.distill (resolved by `_resolve_distillation`)
DISTILLATION_ALIASES: dict[str, str] = {
    "distillation.teacher_model.model_path": "algorithm.distill.teacher_path",
    "distillation.distillation_loss.loss_mode": "algorithm.distill.loss_mode",
    "distillation.distillation_loss.use_task_rewards": "algorithm.distill.use_outcome_reward",
    "distillation.distillation_loss.distillation_loss_coef": "algorithm.distill.coef",
    "distillation.distillation_loss.task_loss_coef": "algorithm.distill.outcome_coef",
    "distillation.distillation_loss.loss_max_clamp": "algorithm.distill.loss_max_clamp",
    "distillation.distillation_loss.log_prob_min_clamp": "algorithm.distill.log_prob_min_clamp",
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
    RULES.setdefault(_new, Rule(HONOURED, f"verl 0.8+ layout: the same setting as {_old} (resolved onto it at load "
                                          "time; setting both is an error)"))


# ------------------------------------------------------------------------------------------ access
def get(cfg: Any, path: str) -> Any:
    node = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node


def _set(cfg: Any, path: str, value: Any) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(get(cfg, parent) if parent else cfg, leaf, value)


def _default(path: str) -> Any:
    return get(RLConfig(), path)


def _given(cfg: RLConfig, path: str) -> bool:
    """Did the user set `path`? (for a config not from `load_config`: differs from the default)"""
    # lazy, a cycle: tiller.config.loader imports tiller.config.validate, which imports this module
    from tiller.config.loader import given_keys

    keys = given_keys(cfg)
    if keys is None:
        return get(cfg, path) != _default(path)
    return path in keys


def _given_under(cfg: RLConfig, path: str) -> bool:
    """`path` or, for an open-ended mapping, a key inside it was set by the user."""
    # lazy, a cycle: tiller.config.loader imports tiller.config.validate, which imports this module
    from tiller.config.loader import given_keys

    keys = given_keys(cfg)
    if keys is None:
        return get(cfg, path) != _default(path)
    return any(k == path or k.startswith(path + ".") for k in keys)


# ------------------------------------------------------------------------------------ at load time
def apply_edge(cfg: RLConfig) -> None:
    """Resolve verl's two layouts, convert deprecated keys, resolve keys that follow another key, raise on refused
    values."""
    _resolve_distillation(cfg)
    _resolve_layouts(cfg)
    _convert_deprecated(cfg)
    _resolve_followers(cfg)
    for path, rule in RULES.items():
        if rule.state != REFUSED:
            continue
        value = get(cfg, path)
        if value != _default(path) and value not in rule.allowed:
            raise ConfigError(f"{path}={value!r} is refused: {rule.reason}. Instead: {rule.use}")


def _resolve_layouts(cfg: RLConfig) -> None:
    """verl 0.8+ keys (`reward.*`, `model.lora.*`, `fsdp_config.ulysses_sequence_parallel_size`) onto the legacy
    keys tiller reads; the new-layout key goes back to its default so `tiller config show` prints one config."""
    for new, old in LAYOUT_ALIASES.items():
        if not _given_under(cfg, new):
            continue
        if _given_under(cfg, old):
            raise ConfigError(f"{new} and {old} are the same setting (verl's newer and older layouts): set one of them")
        _set(cfg, old, get(cfg, new))
        _set(cfg, new, _default(new))


def _resolve_distillation(cfg: RLConfig) -> None:
    """verl's `distillation.*` onto `algorithm.distill.*`: with distillation.enabled, every aliased key (given or at
    verl's default) is copied and goes back to its default, as does `enabled`. Decided by values, not by the keys
    given, so a second pass is a no-op."""
    section = cfg.distillation
    on = section.enabled or bool(section.enable)
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
    if not section.teacher_model.model_path:
        raise ConfigError("distillation.enabled=true needs distillation.teacher_model.model_path (the teacher's "
                          "Hugging Face model dir)")
    mode = section.distillation_loss.loss_mode
    if mode.endswith("_topk"):
        raise ConfigError(f"distillation.distillation_loss.loss_mode={mode} is refused: tiller's teacher returns "
                          "the log-probs of the sampled tokens only (no top-k distributions). Instead: k1 with "
                          "use_policy_gradient=true, or k3 / k2")
    rule = RULES["distillation.distillation_loss.policy_loss_mode"]
    if section.distillation_loss.policy_loss_mode not in rule.allowed:
        raise ConfigError(f"distillation.distillation_loss.policy_loss_mode="
                          f"{section.distillation_loss.policy_loss_mode!r} is refused: {rule.reason}. "
                          f"Instead: {rule.use}")
    for new, old in DISTILLATION_ALIASES.items():
        _set(cfg, old, get(cfg, new))
        _set(cfg, new, _default(new))
    section.enabled, section.enable = False, None  # the no-op keys keep their values (the start-up line names them)


def _convert_deprecated(cfg: RLConfig) -> None:
    workers = num_workers(cfg)
    for old, (new, divide) in DEPRECATED.items():
        value = get(cfg, old)
        if value is None:
            continue
        if _given(cfg, new):
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
    if critic.forward_max_token_len_per_gpu is None:
        critic.forward_max_token_len_per_gpu = critic.ppo_max_token_len_per_gpu
    if rm.use_dynamic_bsz is None:
        rm.use_dynamic_bsz = critic.use_dynamic_bsz
    if rm.forward_max_token_len_per_gpu is None:
        rm.forward_max_token_len_per_gpu = critic.forward_max_token_len_per_gpu
    if cfg.data.gen_batch_size is None:
        cfg.data.gen_batch_size = cfg.data.train_batch_size


# ------------------------------------------------------------------------------------- at start-up
def noop_keys(cfg: RLConfig) -> list[str]:
    """The no-op keys the user set (and whose condition, if any, does not hold), as `key=value`."""
    out = []
    for path, rule in RULES.items():
        if rule.state != NOOP or not _given(cfg, path):
            continue
        if rule.honoured_if is not None and rule.honoured_if(cfg):
            continue
        out.append(f"{path}={get(cfg, path)!r}")
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
            if not readers:
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
    return out


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


__all__ = ["RULES", "DEPRECATED", "Rule", "KeyState", "apply_edge", "noop_keys", "noop_line",
           "report_noop_keys", "key_states", "markdown", "num_workers", "HONOURED", "NOOP", "REFUSED"]
