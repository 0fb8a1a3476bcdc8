"""LoRA adapters through peft: `apply_lora`, `merge_lora`, `is_lora`.

LoRA (Hu et al. 2021, arXiv 2106.09685) freezes a weight W and learns a low-rank update:
W x + (alpha / r) B A x, with A [r, in] random and B [out, r] zero at start, so the adapted model
starts out equal to the base. `merge_lora` folds B A into W (peft's `merge_and_unload`), giving a
plain transformers model that `save_pretrained` / `from_pretrained` handle like any other.

For a sequence-classification model (reward model) the fresh `score` head is trained in full
(peft `modules_to_save`), as TRL and OpenRLHF do; `all-linear` never adapts the output head.

A vision-language model (Qwen2-VL / Qwen2.5-VL): `all-linear` adapts the language model's linear layers only,
not the vision tower's (patch embedding, blocks, merger), as verl and TRL do for VLM LoRA; a list of module
names is the user's choice and is taken as given (Qwen2-VL's `q_proj` / `v_proj` / ... live in the language
model only, its vision blocks use `qkv` / `proj` / `fc1` / `fc2`, so naming those adapts the vision tower).
"""

from __future__ import annotations

from typing import Any, Sequence

import re

import torch

from tiller.errors import ConfigError
from tiller.models.vision import is_vision_model


def is_lora(model: torch.nn.Module) -> bool:
    """True for a peft model (adapters attached)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def apply_lora(model: torch.nn.Module, rank: int, alpha: float, target_modules: Any = "all-linear",
               dropout: float = 0.0, modules_to_save: Sequence[str] | None = None):
    """Wrap `model` with LoRA adapters of rank `rank`; only adapter (and `modules_to_save`) weights train.

    target_modules: "all-linear" (every linear layer but the output head) or module-name suffixes
    such as ["q_proj", "v_proj"]. A sequence-classification model keeps its `score` head trainable.
    """
    from peft import LoraConfig, TaskType, get_peft_model

    if rank <= 0:
        raise ConfigError(f"model.lora_rank must be > 0 to apply LoRA, got {rank}")
    if isinstance(target_modules, str) and target_modules != "all-linear":
        target_modules = [target_modules]
    if not isinstance(target_modules, str):
        target_modules = [str(t) for t in target_modules]
        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        unknown = [t for t in target_modules if t not in names]
        if unknown:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                             if isinstance(m, torch.nn.Linear)})
            raise ConfigError(f"model.target_modules: no module named {unknown} in the model; "
                              f"linear layers: {', '.join(linear)}")
    if target_modules == "all-linear":
        target_modules = language_model_targets(model) or target_modules
    is_seq_cls = type(model).__name__.endswith("ForSequenceClassification")
    config = LoraConfig(
        r=int(rank), lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
        task_type=TaskType.SEQ_CLS if is_seq_cls else TaskType.CAUSAL_LM,
        modules_to_save=list(modules_to_save) if modules_to_save else None,
    )
    return get_peft_model(model, config)


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
    """The plain transformers model with adapters merged into the weights (a non-LoRA model as is)."""
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
