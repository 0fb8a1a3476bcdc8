"""The attention mask each decoder layer gets when tiller's engines build masks themselves.

The native engine and the continuous batcher keep their own key / value cache and pass transformers a ready mask,
which transformers then uses as given. One causal mask is right only for a model whose every layer attends to the
whole past. transformers 5 models say what each layer is in `config.layer_types`, and take a dict of masks keyed by
those names in place of one mask (`masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING` names the kinds):

- `full_attention`: causal over the row's tokens;
- `sliding_attention`: causal and `query - key < config.sliding_window` (Gemma 2 / 3, gpt-oss, Qwen2 / Qwen3 with
  `use_sliding_window`, Cohere 2, ...; transformers' `sliding_window_overlay`);
- `chunked_attention`: causal within the same `config.attention_chunk_size` block of positions (Llama 4);
- `linear_attention` / `conv`: recurrent layers (Gated DeltaNet in Qwen3.5 / Qwen3-Next, Mamba in Falcon-H1 /
  Granite 4 / Nemotron-H / Jamba, LFM2's short convolutions) keep a state instead of keys; they take the 2D padding
  mask of a multi-token forward (transformers' `create_recurrent_attention_mask`: pads are zeroed before they
  reach the state) and None for a one-token step;
- `hybrid`: attention and a Mamba mixer side by side in one layer (Falcon-H1), which reads the `full_attention` and
  `linear_attention` entries;
- `mlp` / `moe`: a layer that mixes no tokens (Nemotron-H's MLP and MoE blocks): nothing.

Models without `layer_types` apply `config.sliding_window` to every layer when it is set (Mistral, Mixtral, Phi-3,
Qwen3-MoE with `use_sliding_window`, Starcoder2: their forward picks `create_sliding_window_causal_mask` then).
Distances are in sequence positions (a row's token index), as transformers counts them.

A layer kind outside these (e.g. DeepSeek-V4's compressed attention) is refused by `layout_of` with the model type
named: tiller's engines cannot reproduce its mask (`rollout.name=hf` runs transformers' own `generate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiller.errors import UserError

ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
RECURRENT_KINDS = ("linear_attention", "conv", "hybrid")
MASKLESS_KINDS = ("mlp", "moe")
"""Layers with no token mixing (Nemotron-H's MLP and MoE blocks): no mask, no cache."""


def text_config(config):
    """A vision-language config's `text_config`, else the config itself."""
    return getattr(config, "text_config", None) or config


@dataclass(frozen=True)
class Layout:
    """How a model's layers attend: `kinds` (its `layer_types`, empty when it has none), `window` (the sliding
    window, or None), `chunk` (Llama 4's attention chunk, or None)."""

    model_type: str
    kinds: tuple[str, ...] = ()
    window: int | None = None
    chunk: int | None = None

    @property
    def plain(self) -> bool:
        """Every layer attends to the whole past: one causal mask serves them all."""
        if self.kinds:
            return all(k in ("full_attention", *MASKLESS_KINDS) for k in self.kinds)
        return self.window is None

    def masks(self, valid: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, padding: torch.Tensor | None,
              to_mask=None):
        """The `attention_mask` argument for a forward.

        valid: bool [B, 1, Q, K] the causal mask over real tokens (what a full-attention layer gets);
        q_pos [B, Q] / k_pos [B, K]: the sequence position of each query / key column (anything for pads);
        padding: [B, Q] the 2D padding mask of a multi-token forward (None for a one-token step);
        to_mask: bool mask -> the mask the attention implementation takes (identity when None).
        Returns one mask, or a dict per layer kind.
        """
        convert = to_mask or (lambda m: m)
        if self.plain:
            return convert(valid)
        distance = q_pos[:, None, :, None] - k_pos[:, None, None, :]
        if not self.kinds:  # one sliding window for every layer
            return convert(valid & (distance < self.window))
        out = {"full_attention": convert(valid)}
        for kind in RECURRENT_KINDS:
            out[kind] = padding  # "hybrid" layers read "full_attention" and "linear_attention"
        if self.window is not None:
            out["sliding_attention"] = convert(valid & (distance < self.window))
        if self.chunk is not None:
            same = (q_pos[:, None, :, None] // self.chunk) == (k_pos[:, None, None, :] // self.chunk)
            out["chunked_attention"] = convert(valid & same)
        return out


def has_recurrent_layers(model_or_config) -> bool:
    """Some layers keep a recurrent state (`RECURRENT_KINDS`); never raises (training forwards use transformers'
    own masks, whatever the kinds)."""
    config = text_config(getattr(model_or_config, "config", model_or_config))
    return any(k in RECURRENT_KINDS for k in (getattr(config, "layer_types", None) or ()))


def _windows_every_layer(config) -> bool:
    """A model without `layer_types` whose forward builds transformers' sliding-window mask when
    `config.sliding_window` is set (Mistral, Mixtral, Phi-3, ...): its modeling module imports that mask."""
    import importlib

    name = type(config).__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(name)
    except ImportError:
        return True  # a remote-code or unknown model: take its config's window at its word
    return hasattr(module, "create_sliding_window_causal_mask")


def layout_of(model_or_config) -> Layout:
    """The `Layout` of a model (or config); refuses layer kinds tiller's engines cannot mask."""
    config = text_config(getattr(model_or_config, "config", model_or_config))
    model_type = str(getattr(config, "model_type", "?"))
    kinds = tuple(getattr(config, "layer_types", None) or ())
    unknown = sorted(set(kinds) - set(ATTENTION_KINDS) - set(RECURRENT_KINDS) - set(MASKLESS_KINDS))
    if unknown:
        raise UserError(f"model_type {model_type!r} has layers of kind {unknown} (config.layer_types), whose attention "
                        f"tiller's engines do not reproduce; known kinds: {list(ATTENTION_KINDS + RECURRENT_KINDS)}; "
                        "use rollout.name=hf (transformers' own generate)")
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    if "sliding_attention" in kinds and not window:
        raise UserError(f"model_type {model_type!r} has sliding_attention layers but no config.sliding_window")
    if "chunked_attention" in kinds and not chunk:
        raise UserError(f"model_type {model_type!r} has chunked_attention layers but no config.attention_chunk_size")
    if kinds:
        window = window if "sliding_attention" in kinds else None
        chunk = chunk if "chunked_attention" in kinds else None
    else:
        window, chunk = (window if window and _windows_every_layer(config) else None), None
    return Layout(model_type, kinds, int(window) if window else None, int(chunk) if chunk else None)


def refuse_packing(model, key: str = "data.packing") -> None:
    """A model with recurrent layers cannot pack sequences into one row (see `packed_masks`): refused naming `key`."""
    config = text_config(model.config)
    if has_recurrent_layers(config):
        kinds = sorted(set(config.layer_types) & set(RECURRENT_KINDS))
        raise UserError(f"{key}=True: model_type {config.model_type!r} has recurrent layers ({', '.join(kinds)}) whose "
                        "state would run from one packed sequence into the next; set it false")


def packed_masks(model, position_ids: torch.Tensor, key: str = "data.packing"):
    """The `attention_mask` of rows packing several sequences (`position_ids` [R, L] restarting at 0 at each): causal
    within each sequence, with each layer kind's window (`Layout.masks`). transformers can infer the sequences from
    `position_ids` alone, but not in every model (gpt-oss's forward does not pass them to its mask functions), so
    tiller builds the mask itself for the sdpa and eager implementations; None (transformers' own detection) for
    the others (FlashAttention reads the sequence boundaries from `position_ids`). A model with recurrent layers is
    refused: their state would run from one packed sequence into the next."""
    refuse_packing(model, key)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return None
    seq = (position_ids == 0).cumsum(-1)  # [R, L] the sequence each token belongs to
    idx = torch.arange(position_ids.shape[1], device=position_ids.device)
    valid = (seq[:, :, None] == seq[:, None, :]) & (idx[None, :] <= idx[:, None])[None]  # [R, q, k]
    dtype = next(model.parameters()).dtype
    return layout_of(model).masks(valid[:, None], position_ids, position_ids, None,
                                  lambda m: to_attention_mask(m, dtype, impl))


def to_attention_mask(valid: torch.Tensor, dtype: torch.dtype, impl: str) -> torch.Tensor:
    """bool `valid` -> the mask the attention implementation takes: bool for sdpa, additive (0 / dtype min) else."""
    if impl == "sdpa":
        return valid
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill(~valid, torch.finfo(dtype).min)

