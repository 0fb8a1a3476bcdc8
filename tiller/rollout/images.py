"""Image prompts in the native engine and its continuous batcher (Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE /
Qwen3.5 / GLM-4.1V).

The native engine runs a vision-language model's own HF forward, so the language model's layers, its M-RoPE
and the image-token merge are the model's code; what this module adds is the engine's side of it:

- **Vision once per prompt.** `ImagePrompts(model, prompts, multi_modal)` runs the vision tower once over the
  pixels of every prompt of a wave (`get_image_features`) and keeps each prompt's per-image outputs (a Qwen3-VL's
  deepstack features too); the prefill passes them as `mm_encoder_outputs` (the model then merges them into the
  image-token slots (`<|image_pad|>`; GLM-4.1V's `<|image|>`), and adds a Qwen3-VL's deepstack features to those slots after its first layers), and
  the n samples of a prompt copy its prefilled keys / values, so nothing visual is repeated per sample.
- **M-RoPE positions by the model's rule.** Each prompt's `[3, L]` (temporal, height, width) positions come
  from the model's `get_rope_index` on that prompt alone (image tokens take grid positions, text continues
  after the largest one); a prefill chunk left-pads them (pads masked). A response token t of a prompt sits at
  position `max(prompt positions) + 1 + t` on all three axes, which is what `generate` computes
  (`len(prompt) + t + rope_delta`, `rope_delta = max + 1 - len(prompt)`); `next_position` holds that start.
- **Vision special tokens are never sampled** (`suppress_vision_tokens`), as in the hf engine: a response
  holding an image token would be read as an image slot by every later forward.

Decode: a response token's three M-RoPE positions are equal, where M-RoPE is the plain rotary embedding, so
Qwen2-VL / Qwen3-VL / Qwen3-VL-MoE / GLM-4.1V decode with the fused step (`fused_decode`, also compiled with
`compile_decode`) at per-row positions `next_position + t` (Qwen3.5, whose layers the fused step does not run, with
the model's own forward at those positions); an image prompt's prefill always runs the HF forward (it needs the image outputs and the
3D positions). The static-shape / CUDA-graph step (`graphed_decode`) computes positions as `len(prompt) + t`
and samples without the vision-token mask, so a vision-language model never takes it (`NativeRolloutEngine`
warns when it was asked for).

Letters: `c` prompts in a prefill chunk, `w` chunk width, `L` a prompt's length.
"""

from __future__ import annotations

import torch

from tiller.errors import UserError
from tiller.models.vision import image_token_id, is_vision_model

__all__ = ["ImagePrompts", "check_multi_modal", "encode_images", "encoder_outputs", "next_positions",
           "suppress_vision_tokens", "vision_token_ids"]


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_multi_modal(model, prompt_ids: list[list[int]], multi_modal) -> list[dict | None] | None:
    """`multi_modal` checked against the prompts: one entry per prompt (None = text), images only for a vision
    model, each image prompt's `<|image_pad|>` count matching its grids. Returns None when no prompt has images."""
    if multi_modal is None:
        return None
    if len(multi_modal) != len(prompt_ids):
        raise UserError(f"rollout: multi_modal has {len(multi_modal)} entries for {len(prompt_ids)} prompts "
                        "(one per prompt, None for a text prompt)")
    if all(m is None for m in multi_modal):
        return None
    base = _base(model)
    if not is_vision_model(base):
        raise UserError(f"rollout: image prompts need a vision-language model; this one is "
                        f"{getattr(base.config, 'model_type', '?')!r} (text only)")
    merge = int(base.config.vision_config.spatial_merge_size) ** 2
    pad = image_token_id(base)
    for i, (ids, m) in enumerate(zip(prompt_ids, multi_modal)):
        if m is None:
            continue
        if not {"pixel_values", "image_grid_thw"} <= set(m):
            raise UserError(f"rollout: multi_modal[{i}] needs 'pixel_values' and 'image_grid_thw', has {sorted(m)}")
        slots = int(m["image_grid_thw"].prod(-1).sum()) // merge
        if sum(1 for t in ids if t == pad) != slots:
            raise UserError(f"rollout: prompt {i} has {sum(1 for t in ids if t == pad)} image tokens but its "
                            f"images fill {slots}")
    return list(multi_modal)


def mrope_positions(model, prompt: list[int], grid: torch.Tensor | None) -> torch.Tensor:
    """`[3, L]` M-RoPE positions of one prompt by the model's `get_rope_index` (a text prompt: 0..L-1)."""
    if grid is None:
        return torch.arange(len(prompt)).expand(3, -1)
    base = _base(model)
    ids = torch.tensor([prompt])
    pos, _ = base.model.get_rope_index(ids, (ids == image_token_id(base)).int(), image_grid_thw=grid.cpu())
    return pos[:, 0]


def next_positions(model, prompts: list[list[int]], multi_modal) -> list[int]:
    """Per prompt, the position of its first response token: `len(prompt)` for text, the largest M-RoPE
    position + 1 for an image prompt."""
    if multi_modal is None:
        return [len(p) for p in prompts]
    return [len(p) if m is None else int(mrope_positions(model, p, m["image_grid_thw"]).max()) + 1
            for p, m in zip(prompts, multi_modal)]


def encode_images(model, multi_modal: list[dict | None]) -> list[list[tuple]]:
    """The vision tower run once over every prompt's pixels (`get_image_features`); per prompt, per image:
    (merged-patch features `[n_tokens, H]`, deepstack features: one `[n_tokens, H]` per deepstack layer of a
    Qwen3-VL, () for Qwen2-VL / Qwen2.5-VL) ([] for a text prompt)."""
    rows = [m for m in multi_modal if m is not None]
    if not rows:
        return [[] for _ in multi_modal]
    device = next(model.parameters()).device
    encoded = _base(model).model.get_image_features(
        torch.cat([m["pixel_values"] for m in rows]).to(device),
        torch.cat([m["image_grid_thw"] for m in rows]).to(device), return_dict=True)
    pooled = encoded.pooler_output
    deep = getattr(encoded, "deepstack_features", None) or []  # per layer, a tuple of per-image features
    images = [(pooled[i], tuple(layer[i] for layer in deep)) for i in range(len(pooled))]
    features, k = [], 0
    for m in multi_modal:
        count = 0 if m is None else len(m["image_grid_thw"])
        features.append(images[k:k + count])
        k += count
    return features


def encoder_outputs(images: list[tuple]) -> dict:
    """`mm_encoder_outputs` of a forward whose image slots hold `images` (`encode_images` items) in order: the
    merged-patch features, plus a Qwen3-VL's deepstack features (added to the image tokens' hidden states after
    its first language-model layers)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    pooled = tuple(p for p, _ in images)
    layers = len(images[0][1]) if images else 0
    if not layers:
        return {"image": BaseModelOutputWithPooling(pooler_output=pooled)}
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    deep = [tuple(d[layer] for _, d in images) for layer in range(layers)]
    return {"image": BaseModelOutputWithDeepstackFeatures(pooler_output=pooled, deepstack_features=deep)}


class ImagePrompts:
    """The image side of one prefill: per prompt its vision outputs (the tower run once for all prompts) and
    its M-RoPE positions; `chunk_inputs` gives a prefill chunk's forward keywords."""

    def __init__(self, model, prompts: list[list[int]], multi_modal: list[dict | None]):
        self.features = encode_images(model, multi_modal)
        self.positions = [mrope_positions(model, p, None if m is None else m["image_grid_thw"])
                          for p, m in zip(prompts, multi_modal)]

    def chunk_inputs(self, chunk_idx: list[int], width: int, device) -> dict:
        """Forward keywords of a prefill chunk (its prompts left-padded to `width`): `position_ids` `[3, c, w]`
        (pads 0, masked anyway) and the chunk's image features as `mm_encoder_outputs` (in row order)."""
        pos = torch.zeros((3, len(chunk_idx), width), dtype=torch.long)
        for row, i in enumerate(chunk_idx):
            p = self.positions[i]
            pos[:, row, width - p.shape[1]:] = p
        feats = tuple(f for i in chunk_idx for f in self.features[i])
        out = {"position_ids": pos.to(device)}
        if feats:
            out["mm_encoder_outputs"] = encoder_outputs(list(feats))
        return out


def suppress_vision_tokens(logits: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """`logits` [B, V] with the vision special tokens set to -inf (a float copy); unchanged when `ids` is None."""
    if ids is None:
        return logits
    return logits.float().index_fill(-1, ids, float("-inf"))


def vision_token_ids(model) -> list[int]:
    """The vision special token ids of a vision-language model (never sampled); [] for a text model."""
    base = _base(model)
    if not is_vision_model(base):
        return []
    cfg = base.config
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
             "image_start_token_id", "image_end_token_id", "video_start_token_id", "video_end_token_id")  # GLM-4.1V
    return [int(getattr(cfg, n)) for n in names if getattr(cfg, n, None) is not None]


def vision_ids_tensor(model, device) -> torch.Tensor | None:
    """The vision special token ids of `model` as a tensor on `device`, or None for a text model."""
    ids = vision_token_ids(model)
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None
