"""Load Hugging Face causal LMs and tokenizers from a local directory or hub id, with user-facing errors.

`load_tokenizer` guarantees a pad token (falls back to eos, as TRL and verl do) and can force the
padding side; `load_causal_lm` maps a dtype name ("float32", "bfloat16", "auto") to torch and turns a
missing path into a `UserError` naming it instead of a hub lookup traceback.
"""

from __future__ import annotations


import functools
import json
import inspect
import os
from pathlib import Path

import torch

from tiller.errors import UserError
from tiller.models.quant import quantize_after_load

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "auto": "auto"}


def resolve_dtype(dtype) -> torch.dtype | str:
    """`torch.dtype`, a name from `DTYPES`, or None (float32)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[key]


def _looks_local(path: str) -> bool:
    """A path, not a hub id: absolute or relative-dotted, more than `org/name`, a trailing slash, or under a dir
    that exists here (`runs/x` when ./runs exists)."""
    if path.startswith((".", "/", "~")) or path.count("/") > 1 or path.endswith("/"):
        return True
    parent = os.path.dirname(path)
    return bool(parent) and os.path.isdir(parent)


def _cached_on_hub(repo: str) -> bool:
    """Whether the Hugging Face cache holds a config or tokenizer of hub id `repo` (usable offline)."""
    try:
        from transformers.utils import try_to_load_from_cache  # huggingface_hub's, as transformers ships it

        return any(isinstance(try_to_load_from_cache(repo, name), str)
                   for name in ("config.json", "tokenizer_config.json"))
    except Exception:  # an id the hub library rejects: transformers will say why
        return False


def _hub_reachable(timeout: float = 5.0) -> str | None:
    """None when one TCP connection to the hub's endpoint opens, else why not (one try: no retry loop)."""
    from urllib.parse import urlparse

    import socket

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return f"{host}:{port}: {getattr(err, 'strerror', None) or err}"
    return None


VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v",
                      "glm4v_moe")
"""HF model types tiller trains as vision-language models (tiller.models.vision)."""
VISION_FAMILIES = "Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE / Qwen3.5 / Qwen3.5-MoE / GLM-4.1V / GLM-4.5V"
"""The families of VISION_MODEL_TYPES, for messages."""


def is_vision_checkpoint(path) -> bool:
    """Whether the model dir `path` holds a vision-language model (reads config.json only)."""
    cfg = Path(os.path.expanduser(os.fspath(path))) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("model_type") in VISION_MODEL_TYPES
    except ValueError:
        return False


def unsupported_vision_model(path) -> str | None:
    """A one-line reason when the model dir `path` holds an image-text model that tiller does not drive (e.g.
    LLaVA `llava`) and that does not load as a causal LM either; else None."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    cfg = Path(os.path.expanduser(os.fspath(path))) / "config.json"
    try:
        model_type = json.loads(cfg.read_text()).get("model_type") if cfg.is_file() else None
    except ValueError:
        return None
    if (model_type in VISION_MODEL_TYPES or model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
            or model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return None
    return (f"{path}: model_type {model_type!r} is a vision-language model that tiller does not train yet (it "
            f"trains {', '.join(VISION_MODEL_TYPES)}: {VISION_FAMILIES})")


def check_model_path(path, what: str) -> str:
    """A local path that must exist, or a hub id (`name` / `org/name`) passed through when the hub can serve it.

    A missing local path fails at once. A hub id not in the local cache fails at once when the hub is switched
    off (`HF_HUB_OFFLINE=1`) or one connection to it fails: Hugging Face's client would retry for over a minute."""
    path = os.path.expanduser(os.fspath(path))
    if os.path.exists(path):
        return path
    if _looks_local(path):
        raise UserError(f"{what} path not found: {path}")
    if _cached_on_hub(path):
        return path
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise UserError(f"{what} path not found: {path} (not a local dir, and HF_HUB_OFFLINE is set, so it is not "
                        "fetched as a Hugging Face hub id)")
    why = _hub_reachable()
    if why is not None:
        raise UserError(f"{what} path not found: {path} is not a local dir, and the Hugging Face hub is unreachable "
                        f"to fetch it as a hub id ({why})")
    return path


def _load_failure(what: str, path: str, err: Exception) -> str:
    """One clear line: a name that is neither a local dir nor reachable on the hub says so first."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if not os.path.exists(path):
        return (f"cannot load {what} from {path!r}: no such local directory, and it could not be fetched as a "
                f"Hugging Face hub id ({first})")
    return f"cannot load {what} from {path!r}: {first}"


def is_load_error(err: BaseException) -> bool:
    """An exception `from_pretrained` raises for a bad model dir (missing / truncated / malformed files) rather
    than a bug: OSError, ValueError (a bad config.json) or safetensors' own error for a truncated file."""
    return isinstance(err, (OSError, ValueError)) or type(err).__name__ == "SafetensorError"


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(path, padding_side: str | None = None, trust_remote_code: bool = False):
    """`AutoTokenizer.from_pretrained(path)` with a pad token guaranteed and an optional padding side."""
    from transformers import AutoTokenizer

    path = check_model_path(path, "tokenizer")
    local = Path(str(path))
    if local.is_dir() and not any((local / name).exists() for name in _TOKENIZER_FILES):
        raise UserError(f"no tokenizer in {local} (none of {', '.join(_TOKENIZER_FILES)}): save the tokenizer "
                        "with the model, or point the tokenizer path key (e.g. actor_rollout_ref.model.tokenizer_path,"
                        " data.tokenizer) at one")
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as err:
        raise UserError(_load_failure("tokenizer", path, err)) from err
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise UserError(f"tokenizer at {path!r} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    if padding_side is not None:
        if padding_side not in ("left", "right"):
            raise UserError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        tok.padding_side = padding_side
    return tok


def model_config(path, override_config: dict | None = None, *, trust_remote_code: bool = False,
                 key: str = "model.override_config", **config_kwargs):
    """The HF config of the model at `path` with `override_config` applied, as verl's `update_model_config`.

    Every key is set on the config before the model is built (so `attention_dropout`, `rope_scaling`, ...
    reach the modules that read them at construction); a dict value is merged into a dict attribute.
    `attn_implementation` selects the attention implementation (verl reads the same key: `eager`, `sdpa`,
    `flash_attention_2`, ...). A key that is not a field of the config is still set (remote-code models read
    their own attributes) with a warning naming it, so a typo does not pass unnoticed.
    """
    import warnings

    from transformers import AutoConfig

    overrides = dict(override_config or {})
    attn = overrides.pop("attn_implementation", None)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **config_kwargs)
    except Exception as err:
        if not is_load_error(err):
            raise
        raise UserError(_load_failure("model", path, err)) from err
    for name, value in overrides.items():
        current = getattr(config, name, None)
        if not hasattr(config, name):
            warnings.warn(f"{key}.{name}: not a field of {type(config).__name__}; set anyway (a model that does "
                          f"not read it ignores it)", stacklevel=2)
        if isinstance(value, dict) and isinstance(current, dict):
            value = {**current, **value}
        setattr(config, name, value)
    if attn is not None:
        if not isinstance(attn, str) or not attn:
            raise UserError(f"{key}.attn_implementation must be a name such as 'sdpa' or 'eager', got {attn!r}")
        config._attn_implementation = attn
    return config


def load_causal_lm(path, dtype="float32", trust_remote_code: bool = False,
                   attn_implementation: str | None = None, device=None, override_config: dict | None = None,
                   key: str = "model.override_config", quantization_config=None):
    """`AutoModelForCausalLM.from_pretrained(path)` (a vision-language model dir: `AutoModelForImageTextToText`) in `dtype` (name or torch.dtype), optionally moved to `device`.

    override_config: keys set on the model's HF config before it is built (`model_config`); `key` names them
    in errors. An explicit `attn_implementation` argument wins over the override's. `quantization_config`: a
    transformers `BitsAndBytesConfig` (tiller.models.quant.bnb_config), the model placed on `device` as it loads.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = check_model_path(path, "model")
    # vision-language checkpoints (VISION_MODEL_TYPES) load through the image-text-to-text class
    reason = unsupported_vision_model(path)
    if reason is not None:
        raise UserError(reason)
    auto = AutoModelForImageTextToText if is_vision_checkpoint(path) else AutoModelForCausalLM
    kwargs = dict(dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code)
    overrides = dict(override_config or {})
    attn_implementation = attn_implementation or overrides.get("attn_implementation")
    if overrides:
        kwargs["config"] = model_config(path, overrides, trust_remote_code=trust_remote_code, key=key)
    if auto is AutoModelForCausalLM and _tied_at_top_only(path):
        config = kwargs.get("config") or model_config(path, trust_remote_code=trust_remote_code, key=key)
        config.get_text_config().tie_word_embeddings = True  # see head_from_embeddings
        kwargs["config"] = config
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if quantization_config is not None:
        kwargs.update(quantization_config=quantization_config, device_map={"": str(device or "cpu")})
    try:
        model, info = auto.from_pretrained(path, output_loading_info=True, **kwargs)
    except Exception as err:
        if attn_implementation and isinstance(err, (ImportError, ValueError)) and \
                ("attn" in str(err).lower() or "attention" in str(err).lower()):
            first = str(err).strip().splitlines()[0]
            raise UserError(f"{key}.attn_implementation={attn_implementation!r}: {first}") from err
        if not is_load_error(err):
            raise
        raise UserError(_load_failure("model", path, err)) from err
    head_from_embeddings(model, path, info)
    if quantization_config is not None:
        return quantize_after_load(model)
    if device is not None:
        model = model.to(device)
    return model


def _tied_at_top_only(path) -> bool:
    """A vision-language checkpoint (Qwen3.5, Gemma 3: transformers maps their model types to a text-only causal LM
    class) whose config.json ties the LM head to the embeddings at its top but not in its `text_config`: transformers
    builds the causal LM from `text_config`, finds no `lm_head.weight` in the files and initialises the head at random
    (its load report says MISSING); the checkpoint's own model ties it, so `load_causal_lm` ties it too."""
    try:
        top = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = top.get("text_config")
    return bool(top.get("tie_word_embeddings")) and isinstance(text, dict) and not text.get("tie_word_embeddings")


def head_from_embeddings(model, path, info: dict) -> None:
    """Refuse a causal LM whose checkpoint has no LM head (transformers would train a random one, saying only
    MISSING in its load report); a tied head is not missing."""
    missing = set(info.get("missing_keys") or ())
    if any(k == "lm_head.weight" or k.endswith(".lm_head.weight") for k in missing):
        raise UserError(f"model {path}: its checkpoint has no lm_head.weight and its config does not tie the LM head "
                        "to the embeddings (tie_word_embeddings), so the head would be random; check the checkpoint")


@functools.lru_cache(maxsize=None)
def _cache_keyword(cls: type) -> str | None:
    params = inspect.signature(cls.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def cache_keyword(model) -> str | None:
    """The keyword an HF model's forward takes its KV cache under: `cache` (transformers >= 5.24, which
    deprecates the old name) or `past_key_values` (earlier); None when it takes neither."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _cache_keyword(type(base))
