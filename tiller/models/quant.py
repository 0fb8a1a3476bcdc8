"""Quantized base weights under LoRA (QLoRA, Dettmers et al. 2023, arXiv 2305.14314) through bitsandbytes.

`model.load_in_4bit=true` loads every linear layer of the body (not the output head) as bitsandbytes 4-bit
(`bnb_4bit_quant_type` nf4 | fp4, `bnb_4bit_use_double_quant` quantizing the block scales too) through transformers'
`BitsAndBytesConfig`, as TRL's `get_quantization_config(ModelConfig)` and
OpenRLHF's `--load_in_4bit` (nf4, double quantization) build it. The quantized weights are frozen: LoRA adapters
train on top (a quantized model without LoRA is refused: there is nothing to train). The matmuls run in the run's
compute dtype (float32, or bfloat16 under `dtype=bfloat16`), as TRL passes its model dtype.

A merged model (the export of `tiller sft` / `dpo` / ..., the rollout's weights in RL) is the DEQUANTIZED base with the
adapters folded in by peft (`dequantized_merge`): the function the adapters were trained with, in full precision;
merging into the original unquantized checkpoint instead would give other log-probs than those trained. (peft's own
`merge_and_unload` on a 4-bit model re-quantizes the sum, which loses the adapters' update to rounding.) 8-bit
LLM.int8 (TRL's load_in_8bit) is not offered: it quantizes the activations too, so no full-precision merge gives the
trained function, and with bitsandbytes 0.50.2 on a CPU a training forward after an inference forward fails.

bitsandbytes is optional (`pip install bitsandbytes`, or tiller's `quant` extra); asking for quantization without it
is an error naming the key and the package. On a CPU, bitsandbytes (0.50.2 seen) repacks a 4-bit weight in place at its
first inference forward on an AVX-512-BF16 host, after which a training forward fails ("a view of a leaf Variable ...
in an in-place operation"): `quantize_after_load` turns that repacking off, so evaluation and training
interleave (validation, the RL rollout) on every host alike.
"""

from __future__ import annotations

from typing import Any

import copy

import torch

from tiller.errors import ConfigError
from tiller.models.quiet import quiet_peft

QUANT_TYPES = ("nf4", "fp4")


def wants_quantization(section: Any) -> bool:
    """True when a model section asks for 4-bit base weights."""
    return bool(getattr(section, "load_in_4bit", False))


def check_quantization(section: Any, key: str, lora: bool) -> None:
    """Refuse what cannot run, naming the key: an unknown 4-bit type, no LoRA, no bitsandbytes."""
    quant_type = getattr(section, "bnb_4bit_quant_type", "nf4")
    if quant_type not in QUANT_TYPES:
        raise ConfigError(f"{key}.bnb_4bit_quant_type={quant_type!r}: must be one of {', '.join(QUANT_TYPES)}")
    if not wants_quantization(section):
        for name, default in (("bnb_4bit_quant_type", "nf4"), ("bnb_4bit_use_double_quant", False)):
            if getattr(section, name, default) != default:
                raise ConfigError(f"{key}.{name}={getattr(section, name)!r} is only read with {key}.load_in_4bit=true")
        return
    flag = f"{key}.load_in_4bit"
    if not lora:
        raise ConfigError(f"{flag}=true needs LoRA ({key}.lora_rank > 0 or a lora_adapter_path): quantized weights "
                          "are frozen, only adapters train on them (QLoRA)")
    try:
        _import_bitsandbytes()
    except ImportError as err:
        raise ConfigError(f"{flag}=true needs the bitsandbytes package (pip install bitsandbytes): "
                          f"{str(err).splitlines()[0]}") from err


def _import_bitsandbytes():
    """bitsandbytes, its CPU backend's notice about the optional `kernels` package (used only by the inference
    repacking that `quantize_after_load` turns off) quieted."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes

    return bitsandbytes


def bnb_config(section: Any, compute_dtype: torch.dtype, keep: tuple[str, ...] | None = None):
    """transformers' `BitsAndBytesConfig` for a model section, or None when it asks for no quantization. `keep`:
    module names left unquantized (a value model's head `score`; default: transformers' own choice, the LM head)."""
    if not wants_quantization(section):
        return None
    _import_bitsandbytes()
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=section.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=bool(section.bnb_4bit_use_double_quant),
                              bnb_4bit_compute_dtype=compute_dtype,
                              **({"llm_int8_skip_modules": list(keep)} if keep else {}))


def quantize_after_load(model: torch.nn.Module) -> torch.nn.Module:
    """Settle a freshly loaded quantized model: bitsandbytes' one-way CPU repacking off (module docstring)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def is_quantized(model: torch.nn.Module) -> bool:
    """True for a model (or a peft model around one) loaded with bitsandbytes 4-bit weights."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(base, "is_loaded_in_4bit", False))


def _dequantized(module: torch.nn.Module) -> torch.Tensor | None:
    """A bitsandbytes linear layer's weight in full precision (None for any other module)."""
    weight = getattr(module, "weight", None)
    if type(weight).__name__ != "Params4bit":
        return None
    return _import_bitsandbytes().functional.dequantize_4bit(weight.data, weight.quant_state).float()


def _source(base: torch.nn.Module, key: str) -> torch.Tensor:
    """The tensor of the quantized (and maybe adapter-wrapped) `base` behind the plain model's state-dict `key`:
    LoRA wrappers step to their base layer, peft's modules_to_save copies to the original, bitsandbytes weights
    dequantize."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    path, attr = key.rsplit(".", 1) if "." in key else ("", key)
    module = base
    for part in path.split(".") if path else []:
        module = module.get_submodule(part)
        if isinstance(module, BaseTunerLayer):
            module = module.get_base_layer()
        elif type(module).__name__ == "ModulesToSaveWrapper":
            module = module.original_module
    weight = _dequantized(module) if attr == "weight" else None
    return (weight if weight is not None else getattr(module, attr)).detach()


def unquantized_like(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """An unquantized copy of a quantized transformers model (a peft model's base, adapters not folded in), every
    bitsandbytes weight dequantized; built on the meta device and filled, so no weight is initialised twice."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = copy.deepcopy(base.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    with torch.device("meta"):
        plain = type(base)._from_config(config, dtype=dtype)
    state = {key: _source(base, key).to(dtype if tensor.is_floating_point() else tensor.dtype).clone()
             for key, tensor in plain.state_dict().items()}
    plain.load_state_dict(state, strict=True, assign=True)
    for name, buffer in list(plain.named_buffers()):  # non-persistent ones (rotary inv_freq) are not in the state
        if buffer.is_meta:
            owner, attr = name.rsplit(".", 1) if "." in name else ("", name)
            plain.get_submodule(owner)._buffers[attr] = _source(base, name).clone()
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    return plain.requires_grad_(False).eval()


def dequantized_merge(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The plain transformers model of a quantized peft model (the PeftModel, or the transformers model its adapters
    are injected into): its base dequantized, then its adapter (LoRA, DoRA, rsLoRA, modules_to_save) folded in by
    peft's own `merge_and_unload` on that full-precision copy. The training model is untouched."""
    from peft import get_peft_model

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    plain = unquantized_like(inner, dtype)
    configs = getattr(inner, "peft_config", None) or {}
    if not configs:
        return plain
    if len(configs) != 1:
        raise ValueError(f"one adapter expected on a quantized model, found {sorted(configs)}")
    (name, config), = configs.items()
    config = copy.deepcopy(config)
    config.inference_mode = False
    with quiet_peft():
        wrapped = get_peft_model(plain, config, adapter_name=name)
    prefix, source = "base_model.model.", inner.state_dict()
    wanted = [k for k in wrapped.state_dict() if "lora_" in k or ".modules_to_save." in k]
    lost = [k for k in wanted if k[len(prefix):] not in source]
    if lost:
        raise RuntimeError(f"adapter weights not found on the quantized model: {lost[:4]}")
    wrapped.load_state_dict({k: source[k[len(prefix):]].detach().to(dtype) for k in wanted}, strict=False)
    return wrapped.merge_and_unload().requires_grad_(False).eval()
