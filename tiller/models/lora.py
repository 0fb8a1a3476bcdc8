"""LoRA adapters through peft: `apply_lora`, `merge_lora`, `is_lora`.

LoRA (Hu et al. 2021, arXiv 2106.09685) freezes a weight W and learns a low-rank update:
W x + (alpha / r) B A x, with A [r, in] random and B [out, r] zero at start, so the adapted model
starts out equal to the base. `merge_lora` folds B A into W (peft's `merge_and_unload`), giving a
plain transformers model that `save_pretrained` / `from_pretrained` handle like any other.

For a sequence-classification model (reward model) the fresh `score` head is trained in full
(peft `modules_to_save`), as TRL and OpenRLHF do; `all-linear` never adapts the output head. A token-classification
model (the PPO critic's value model) is the same: peft task TOKEN_CLS, as verl's FSDP critic worker
(`fsdp_workers.CriticWorker`) sets it, so its scalar `score` head trains in full and is saved with the adapter, and
`all-linear` adapts every linear layer of the body. (verl's engine-based critic builds CAUSAL_LM adapters on the value
model, which peft >= 0.18 cannot wrap around a token-classification model; and with TOKEN_CLS + `all-linear` peft
both adapts `score` and wraps it for saving, which it refuses: tiller leaves the head out of `all-linear`.)

A vision-language model (Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE / Qwen3.5 / GLM-4.1V): `all-linear` adapts
the language model's linear layers only (of a Qwen3-VL-MoE: the attention's; its experts are 3-D parameters, not
linear modules; of a Qwen3.5: its Gated DeltaNet projections too; of a GLM-4.1V: its fused `gate_up_proj`), not the
vision tower's (patch embedding, blocks, merger), as verl and TRL do for VLM LoRA; a list of module
names is the user's choice and is taken as given (Qwen2-VL's `q_proj` / `v_proj` / ... live in the language
model only, its vision blocks use `qkv` / `proj` / `fc1` / `fc2`, so naming those adapts the vision tower).

`exclude_modules` (peft's, as verl's `model.exclude_modules`): module-name suffixes (a list) or a regex (a string,
matched in full) left out of `target_modules`.

Continuing from a saved adapter (verl's `model.lora_adapter_path` / `model.lora.adapter_path`): `attach_lora` loads it
onto the base with peft (`PeftModel.from_pretrained(..., is_trainable=True)`); rank, alpha, targets come from its
`adapter_config.json`. A LoRA key left at its default takes the adapter's value; a key set to another value than the
adapter's is refused (verl lets the adapter win silently). The adapter's weights must fit the base exactly: every saved
tensor loads and every adapted module gets one (peft itself only warns about missing keys).
"""

from __future__ import annotations

from typing import Any, Sequence

import json
import re
from pathlib import Path

import torch

from tiller.errors import ConfigError
from tiller.models.quant import dequantized_merge, is_quantized
from tiller.models.quiet import quiet_peft
from tiller.models.vision import is_vision_model


def is_lora(model: torch.nn.Module) -> bool:
    """True for a peft model (adapters attached)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def apply_lora(model: torch.nn.Module, rank: int, alpha: float, target_modules: Any = "all-linear",
               dropout: float = 0.0, modules_to_save: Sequence[str] | None = None, exclude_modules: Any = None,
               key: str = "model", use_rslora: bool = False, use_dora: bool = False, target_parameters: Any = None):
    """Wrap `model` with LoRA adapters of rank `rank`; only adapter (and `modules_to_save`) weights train.

    target_modules: "all-linear" (every linear layer but the output head) or module-name suffixes
    such as ["q_proj", "v_proj"]. A sequence-classification model keeps its `score` head trainable.
    exclude_modules: module-name suffixes (a list) or a regex (a string, full match) that get no adapter.
    modules_to_save: module names trained in full beside the adapters and saved with them (peft's, TRL's
    lora_modules_to_save), e.g. [lm_head, embed_tokens] after adding tokens; on a model that ties them
    (tie_word_embeddings) either name trains the one shared matrix and the pair stays tied (peft's
    ensure_weight_tying), so the export keeps the model's architecture and an engine that reads the head from the
    embedding (vLLM) runs the trained one. `key` is the config section named in errors (`model`,
    `actor_rollout_ref.model`).
    `use_rslora`: the adapter scaled by alpha / sqrt(rank) (rank-stabilised LoRA, Kalajdzievski 2023, arXiv
    2312.03732) instead of alpha / rank.
    `use_dora`: DoRA (Liu et al. 2024, arXiv 2402.09353), peft's weight-decomposed adapters.
    `target_parameters`: parameter names (suffixes of full names) adapted besides the modules, peft's
    `target_parameters`: a mixture-of-experts model's fused 3-D expert weights (`mlp.experts.gate_up_proj`,
    `mlp.experts.down_proj`), each expert getting its own low-rank update.
    """
    from peft import LoraConfig, TaskType, get_peft_model

    if rank <= 0:
        raise ConfigError(f"{key}.lora_rank must be > 0 to apply LoRA, got {rank}")
    task = task_type(model)
    modules_to_save = _saved_modules(model, modules_to_save, target_modules, key)
    if isinstance(target_modules, str) and target_modules != "all-linear":
        target_modules = [target_modules]
    if not isinstance(target_modules, str):
        target_modules = _known_names(model, target_modules, f"{key}.target_modules")
        heads = sorted(set(target_modules) & head_names(model))
        if heads:
            raise ConfigError(f"{key}.target_modules: {heads} is the model's {task} head, which trains in full "
                              "(peft modules_to_save) rather than through an adapter; name body modules only")
    if target_modules == "all-linear":
        target_modules = language_model_targets(model) or (sorted(_module_set("all-linear", model))
                                                           if task == "TOKEN_CLS" else target_modules)
    if exclude_modules is not None and not isinstance(exclude_modules, str):
        exclude_modules = _known_names(model, exclude_modules, f"{key}.exclude_modules") or None
    target_parameters = _known_parameters(model, target_parameters, f"{key}.target_parameters")
    if target_parameters and use_dora:
        raise ConfigError(f"{key}.target_parameters={_show(target_parameters)} with {key}.use_dora=true: peft's DoRA "
                          "adapts modules only; use plain LoRA (or rsLoRA) for the expert parameters")
    tying = {"ensure_weight_tying": True} if set(modules_to_save or ()) & _tied_names(model) else {}
    if tying and "ensure_weight_tying" not in LoraConfig.__dataclass_fields__:
        raise ConfigError(f"{key}.modules_to_save={_show(modules_to_save)}: the model ties its input and output "
                          "embeddings, and keeping them tied needs peft's ensure_weight_tying (peft >= 0.18): "
                          "pip install -U peft")
    config = LoraConfig(
        r=int(rank), lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
        exclude_modules=exclude_modules, task_type=getattr(TaskType, task),
        modules_to_save=modules_to_save, use_rslora=bool(use_rslora),
        use_dora=bool(use_dora), **tying, **({"target_parameters": target_parameters} if target_parameters else {}),
    )
    try:
        with quiet_peft():
            return get_peft_model(model, config)
    except ValueError as err:  # e.g. exclude_modules leaves no module to adapt
        raise ConfigError(f"{key}.target_modules={_show(target_modules)} / {key}.exclude_modules="
                          f"{_show(exclude_modules)}: {_first_line(err)}") from None


def _tied(model: torch.nn.Module) -> bool:
    """Whether the model's output embedding (LM head) is its input embedding (tie_word_embeddings)."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return out is not None and inp is not None and out.weight is inp.weight


def _tied_names(model: torch.nn.Module) -> set[str]:
    """The names (last parts) of the input and output embedding modules when the model ties them, else empty."""
    if not _tied(model):
        return set()
    mine = (model.get_input_embeddings(), model.get_output_embeddings())
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if any(m is e for e in mine)}


def _saved_modules(model: torch.nn.Module, names: Any, target_modules: Any, key: str) -> list[str] | None:
    """`modules_to_save` as a list of module names the model has, none of them also adapted (a ConfigError naming
    `key`.modules_to_save otherwise); None when empty."""
    if not names:
        return None
    names = _known_names(model, [names] if isinstance(names, str) else names, f"{key}.modules_to_save")
    targets = [target_modules] if isinstance(target_modules, str) and target_modules != "all-linear" else target_modules
    both = sorted(set(names) & (_module_set(targets, model) or set()))
    if both:
        raise ConfigError(f"{key}.modules_to_save={_show(names)}: {both} also in {key}.target_modules="
                          f"{_show(target_modules)}: a module is adapted or trained in full, not both")
    return names


TASKS = {"CAUSAL_LM": "causal language model (a policy)", "SEQ_CLS": "sequence-classification model (a reward model)",
         "TOKEN_CLS": "token-classification model (a critic's value model)"}
"""peft's task type of each kind of model tiller adapts, in words."""


def task_type(model: torch.nn.Module) -> str:
    """peft's task type for `model`: SEQ_CLS (`*ForSequenceClassification`), TOKEN_CLS (`*ForTokenClassification`,
    the critic's value model) or CAUSAL_LM (anything else: a policy, a vision-language model)."""
    name = type(model).__name__
    if name.endswith("ForSequenceClassification"):
        return "SEQ_CLS"
    return "TOKEN_CLS" if name.endswith("ForTokenClassification") else "CAUSAL_LM"


def head_names(model: torch.nn.Module) -> set[str]:
    """The classification head's module name(s) of a SEQ_CLS / TOKEN_CLS model (peft trains `score` / `classifier`
    in full there); empty for a causal LM."""
    if task_type(model) == "CAUSAL_LM":
        return set()
    return {name for name, _ in model.named_children() if name in ("score", "classifier")}


def _known_names(model: torch.nn.Module, names: Any, key: str) -> list[str]:
    """`names` as a list of strings, each the last part of some module's name in `model` (else a ConfigError)."""
    names = [str(t) for t in names]
    present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    unknown = [t for t in names if t not in present]
    if unknown:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(f"{key}: no module named {unknown} in the model; linear layers: {', '.join(linear)}")
    return names


def _known_parameters(model: torch.nn.Module, names: Any, key: str) -> list[str] | None:
    """`target_parameters` as a list of parameter-name suffixes, each matching some parameter of `model` (else a
    ConfigError naming `key` and the model's 3-D parameters, the experts' weights); None when empty."""
    if not names:
        return None
    names = [str(t) for t in ([names] if isinstance(names, str) else names)]
    params = [n for n, _ in model.named_parameters()]
    unknown = [t for t in names if not any(n == t or n.endswith("." + t) for n in params)]
    if unknown:
        fused = sorted({n.split(".layers.")[-1].split(".", 1)[-1] for n, p in model.named_parameters()
                        if p.dim() == 3})
        raise ConfigError(f"{key}: no parameter named {unknown} in the model; its 3-D (expert) parameters: "
                          f"{', '.join(fused) or 'none (not a mixture-of-experts model)'}")
    return names


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple, set)) else str(value)


def _first_line(err: BaseException) -> str:
    """The line of an error's message that says what is wrong (torch's load_state_dict puts the cause, e.g.
    `size mismatch for ...`, under a header line)."""
    text = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if len(text) > 1 and text[0].startswith("Error(s) in loading state_dict"):
        return text[1]
    return text[0] if text else type(err).__name__


# -------------------------------------------------------------------------------- a saved adapter

ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # what peft's save_pretrained writes
LORA_DEFAULTS = {"lora_rank": 0, "lora_alpha": 16, "target_modules": "all-linear", "exclude_modules": None,
                 "lora_dropout": 0.0, "use_rslora": False, "use_dora": False, "modules_to_save": None,
                 "target_parameters": None}
LORA_FLAGS = ("use_rslora", "use_dora")
"""peft's boolean LoraConfig options a section may set (tiller keys of the same names)."""
"""The LoRA keys' defaults (verl's, the same in every tiller section that has them): a key at its default takes the
adapter's value."""


def lora_enabled(section: Any) -> bool:
    """LoRA is on for a model config section (`model.lora_rank > 0` or a saved adapter), as in verl."""
    return section.lora_rank > 0 or bool(section.lora_adapter_path)


def _flags(section: Any) -> dict[str, bool]:
    """A config section's peft flags (LORA_FLAGS; False where the section has no such key)."""
    return {"use_rslora": bool(getattr(section, "use_rslora", False)),
            "use_dora": bool(getattr(section, "use_dora", False))}


def attach_lora(model: torch.nn.Module, section: Any, key: str):
    """`model` with the LoRA adapters its config section asks for: a saved adapter (`lora_adapter_path`, loaded
    trainable, with its own dropout), fresh ones (`lora_rank > 0`; `lora_alpha`, `target_modules`, `exclude_modules`,
    `lora_dropout`), or `model` itself (LoRA off). `key` names the section in errors (`model`,
    `actor_rollout_ref.model`). Dropout acts in train mode only: the RL workers compute logprobs and values in eval
    mode, so only their updates' forwards are random."""
    dropout = float(getattr(section, "lora_dropout", 0.0))
    if section.lora_adapter_path:
        user = {"lora_rank": section.lora_rank, "lora_alpha": section.lora_alpha,
                "target_modules": section.target_modules, "exclude_modules": section.exclude_modules,
                "modules_to_save": getattr(section, "modules_to_save", None),
                "target_parameters": getattr(section, "target_parameters", None), **_flags(section)}
        if hasattr(section, "lora_dropout"):
            user["lora_dropout"] = dropout
        return load_lora_adapter(model, section.lora_adapter_path, f"{key}.lora_adapter_path", user, key)
    if section.lora_rank > 0:
        return apply_lora(model, section.lora_rank, section.lora_alpha, section.target_modules, dropout,
                          exclude_modules=section.exclude_modules, key=key,
                          modules_to_save=getattr(section, "modules_to_save", None),
                          target_parameters=getattr(section, "target_parameters", None), **_flags(section))
    return model


def read_adapter_config(path: str | Path, key: str) -> dict:
    """The `adapter_config.json` of a saved LoRA adapter dir; a ConfigError naming `key` when the path is missing,
    holds no adapter config, or holds another peft method's adapter."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ConfigError(f"{key}={path}: no such file or directory")
    file = folder / "adapter_config.json"
    if not file.is_file():
        inner = folder / "model" / "adapter_config.json"  # a tiller checkpoint dir: its adapter is in model/
        hint = f"; the adapter of this checkpoint is {folder / 'model'}" if inner.is_file() else ""
        raise ConfigError(f"{key}={path}: no adapter_config.json there (a peft adapter dir, as save_pretrained of a "
                          f"LoRA model or a tiller LoRA checkpoint's model/ writes, is expected){hint}")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}: cannot read {file}: {_first_line(err)}") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise ConfigError(f"{key}={path}: a {kind or 'non-peft'} adapter; tiller continues training LoRA adapters "
                          "only (peft_type LORA)")
    return config


def adapter_settings(path: str | Path, key: str) -> dict[str, Any]:
    """The saved adapter's LoRA settings as a job section's keys (`lora_rank`, `lora_alpha`, `target_modules`,
    `exclude_modules`, `lora_dropout`): fresh adapters of the same shape."""
    config = read_adapter_config(path, key)
    targets = config.get("target_modules")
    return {"lora_rank": int(config["r"]), "lora_alpha": config.get("lora_alpha", config["r"]),
            "target_modules": sorted(targets) if isinstance(targets, (list, tuple, set)) else targets,
            "exclude_modules": config.get("exclude_modules"), "lora_dropout": float(config.get("lora_dropout") or 0),
            "modules_to_save": _user_saved(config.get("modules_to_save")),
            "target_parameters": sorted(config["target_parameters"]) if config.get("target_parameters") else None,
            **{flag: bool(config.get(flag, False)) for flag in LORA_FLAGS}}


def _user_saved(names: Any, model: torch.nn.Module | None = None) -> list[str] | None:
    """A modules_to_save list as a user would write it: the last part of each name (peft stores `model.embed_tokens`
    for a tied head), without the classification heads peft adds itself (`score`, `classifier`), and with `model`
    tying its embeddings, either one's name read as the same (the one matrix); None when that is nothing."""
    names = [names] if isinstance(names, str) else list(names or ())
    out = {str(n).rsplit(".", 1)[-1] for n in names} - {"score", "classifier"}
    tied = _tied_names(model) if model is not None else set()
    if tied:
        out = {min(tied) if n in tied else n for n in out}
    return sorted(out) or None


def adapter_contradictions(adapter: dict, user: dict[str, Any], model: torch.nn.Module) -> list[tuple[str, Any, Any]]:
    """(key, user's value, adapter's value) for each LoRA key the user set (not at `LORA_DEFAULTS`) to something else
    than the adapter's `adapter_config.json` says; `target_modules` compared as sets of names ('all-linear' as
    every linear layer but the output head)."""
    out = []
    theirs = {"lora_rank": adapter.get("r"), "lora_alpha": adapter.get("lora_alpha"),
              "target_modules": adapter.get("target_modules"), "exclude_modules": adapter.get("exclude_modules"),
              "lora_dropout": adapter.get("lora_dropout", 0.0), "modules_to_save": adapter.get("modules_to_save"),
              "target_parameters": sorted(adapter.get("target_parameters") or ()) or None,
              **{flag: bool(adapter.get(flag, False)) for flag in LORA_FLAGS}}
    for name, value in user.items():
        if value == LORA_DEFAULTS[name] or (name in ("exclude_modules", "modules_to_save", "target_parameters")
                                            and not value):
            continue
        if name == "modules_to_save":
            same = _user_saved(value, model) == _user_saved(theirs[name], model)
        elif name in ("target_modules", "exclude_modules"):
            same = _module_set(value, model) == _module_set(theirs[name], model)
        elif name == "target_parameters":
            same = set(map(str, [value] if isinstance(value, str) else value)) == set(theirs[name] or ())
        elif name in LORA_FLAGS:
            same = bool(value) == theirs[name]
        else:
            same = theirs[name] is not None and float(value) == float(theirs[name])
        if not same:
            out.append((name, value, theirs[name]))
    return out


def _module_set(value: Any, model: torch.nn.Module) -> Any:
    if value == "all-linear":  # every linear layer but the output head (a classifier's head: trained in full)
        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        heads = head_names(model)
        return frozenset(n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and m is not out and n not in heads)
    if isinstance(value, (list, tuple, set)):
        return frozenset(map(str, value))
    return value or None


def load_lora_adapter(model: torch.nn.Module, path: str | Path, key: str, user: dict[str, Any] | None = None,
                      section: str = "model"):
    """`model` with the saved LoRA adapter at `path` loaded onto it, trainable (peft's `PeftModel.from_pretrained(...,
    is_trainable=True)`). `user`: the section's LoRA keys (`lora_rank`, `lora_alpha`, ...) whose values, where set,
    must agree with the adapter's. Every refusal is a ConfigError naming `key` (or the contradicting keys) and the
    path. The loaded adapter's config names `model`'s own path as its base (what `tiller export` merges into)."""
    from peft import PeftModel, get_peft_model_state_dict, load_peft_weights

    config = read_adapter_config(path, key)
    kind, want = str(config.get("task_type") or "CAUSAL_LM").upper(), task_type(model)
    if kind != want:
        hint = (" (a tiller critic's adapter is the model/ dir of checkpoints/critic/global_step_N)"
                if want == "TOKEN_CLS" else "")
        raise ConfigError(f"{key}={path}: a {TASKS.get(kind, kind)}'s adapter (task_type {kind} in its "
                          f"adapter_config.json), but {section} is a {TASKS[want]} ({type(model).__name__}): "
                          f"continue from an adapter of a {want} model{hint}")
    clash = adapter_contradictions(config, user or {}, model)
    if clash:
        raise ConfigError("; ".join(f"{section}.{name}={_show(mine)} but the adapter {key}={path} has "
                                    f"{_show(theirs)} (its adapter_config.json)" for name, mine, theirs in clash)
                          + ": leave the key unset (the adapter's value is used) or set it to the adapter's")
    base_name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", "")
    if not any((Path(path).expanduser() / name).is_file() for name in ADAPTER_WEIGHTS):
        raise ConfigError(f"{key}={path}: no adapter weights there ({' or '.join(ADAPTER_WEIGHTS)}), only its "
                          "adapter_config.json")
    try:
        with quiet_peft():
            peft_model = PeftModel.from_pretrained(model, str(path), is_trainable=True)
        saved = load_peft_weights(str(path), device="cpu")
    except (ValueError, RuntimeError, KeyError, OSError) as err:  # no target module / shape mismatch / no weights
        raise ConfigError(f"{key}={path}: the adapter does not fit the base model {base_name}: "
                          f"{_first_line(err)}") from None
    expected = set(get_peft_model_state_dict(peft_model))
    missing, unexpected = sorted(expected - set(saved)), sorted(set(saved) - expected)
    if missing or unexpected:
        raise ConfigError(f"{key}={path}: the adapter does not fit the base model {base_name} (another base?): "
                          f"{len(missing)} adapter weights missing from it ({', '.join(missing[:3])}), "
                          f"{len(unexpected)} it holds that the model has no place for ({', '.join(unexpected[:3])})")
    if base_name:
        peft_model.peft_config["default"].base_model_name_or_path = base_name
    return peft_model


def language_model_targets(model: torch.nn.Module) -> str | None:
    """For a vision-language model, peft's `target_modules` regex (full match on module names) of every linear
    layer inside its language model, e.g. `model\\.language_model\\..*\\.(?:down_proj|...|v_proj)`; None for a
    text model (`all-linear` applies as is)."""
    if not is_vision_model(model):
        return None
    lm = getattr(getattr(model, "model", None), "language_model", None)
    prefix = next((name for name, m in model.named_modules() if m is lm), None) if lm is not None else None
    if not prefix:
        raise ConfigError(f"model.target_modules=all-linear: cannot find the language model of "
                          f"{type(model).__name__} (model.language_model); name the modules to adapt")
    names = sorted({n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if isinstance(m, torch.nn.Linear)})
    return rf"{re.escape(prefix)}\..*\.(?:{'|'.join(map(re.escape, names))})"


def merge_lora(model: torch.nn.Module) -> torch.nn.Module:
    """The plain transformers model with adapters merged into the weights (a non-LoRA model as is); a 4-bit (QLoRA)
    model: its dequantized base with the adapters merged, a new model (tiller.models.quant.dequantized_merge)."""
    if is_quantized(model):
        return dequantized_merge(model)
    if is_lora(model):
        return model.merge_and_unload()
    return model


def lora_template(peft_model: torch.nn.Module) -> torch.nn.Module:
    """A weightless (meta-device) copy of `peft_model`'s structure, for `merged_state_dict` (take it before
    FSDP wrapping, which replaces the parameters with shards)."""
    import copy

    return copy.deepcopy(peft_model).to("meta")


def merged_state_dict(template: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model's weights with every adapter folded in by peft itself (`merge_and_unload`: LoRA, DoRA
    and whatever else peft can merge), from the PeftModel's full state dict `state` (e.g. gathered from FSDP
    shards). Runs on a copy of `template` (`lora_template`) filled with copies of `state`, so the training
    model and its weights are untouched; the keys are the plain transformers model's."""
    import copy

    clone = copy.deepcopy(template)
    clone.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True, assign=True)
    return {k: v.detach() for k, v in clone.merge_and_unload().state_dict().items()}


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Name -> parameter for every parameter with requires_grad."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}
