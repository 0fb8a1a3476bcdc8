"""Vision-language models: load Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE / Qwen3.5 / GLM-4.1V and turn image
prompts into model inputs.

A vision-language checkpoint (a hub Qwen2-VL dir, or one from `tiller.models.tiny_vlm`) holds a tokenizer
with the vision special tokens (`<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>`), an image processor
config (`preprocessor_config.json`) and a chat template that renders `{"type": "image"}` content parts as
`<|vision_start|><|image_pad|><|vision_end|>`. `load_processor` returns `AutoProcessor.from_pretrained(path)`
when transformers can build it; Qwen2-VL's processor also needs its video processor, which needs torchvision,
so without torchvision it falls back to `ImageTextProcessor`: the same image processor and tokenizer, and
the processor's own rule for prompts, namely each `<|image_pad|>` becomes `prod(image_grid_thw) / merge_size**2`
placeholder tokens (one per merged patch), and `mm_token_type_ids` marks them 1.

`encode_image_prompt(processor, text, images)` is the one entry point every caller (data, rollout, serve) uses:
token ids plus `pixel_values [N_patches, C*T*P*P]`, `image_grid_thw [n_images, 3]` and
`mm_token_type_ids [L]` for one prompt. `is_vision_model(config)` says whether a model takes images;
`mrope_position_ids` computes a batch's M-RoPE positions (3 x [B, L]) by the model's own rule
(`get_rope_index`), so left padding and image grids are handled exactly as the model does in `generate`.

Qwen3-VL (`qwen3_vl`) takes the same path: the same vision special tokens and processor (patch 16 in its
`preprocessor_config.json`), `get_rope_index` with the same arguments (its interleaved M-RoPE is the model's own
rotary code), and its deepstack features computed by its own forward from the pixels (the rollout engines pass them
with the vision outputs, `tiller.rollout.images.encoder_outputs`). Qwen3-VL-MoE (`qwen3_vl_moe`, Qwen3-VL-30B-A3B) is
Qwen3-VL with a mixture of experts in each language-model layer's MLP: the same processor, positions and deepstack
path. GLM-4.1V (`glm4v`) differs in its tokens: an image renders as `<|begin_of_image|><|image|><|end_of_image|>`
and `<|image|>` is the placeholder the processor expands (`image_token(processor)`: the processor's `image_token`, or
the token of the checkpoint's `config.image_token_id`); its `get_rope_index` and image features are the model's own as
above. Videos (Qwen3-VL's timestamped frames included) are refused.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from tiller.errors import DataError, UserError
from tiller.models.loading import load_tokenizer, VISION_MODEL_TYPES

IMAGE_PLACEHOLDER = "<image>"
"""verl's placeholder for an image inside a prompt message's text."""
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]


def is_vision_model(config) -> bool:
    """Whether an HF config (or a model) is one of the vision-language families tiller drives."""
    config = getattr(config, "config", config)
    return getattr(config, "model_type", None) in VISION_MODEL_TYPES


@dataclass
class ImageTextProcessor:
    """The Qwen2-VL processor's image path (image processor + tokenizer), for hosts without torchvision."""

    image_processor: Any
    tokenizer: Any
    image_token: str = IMAGE_PAD
    """the model's image placeholder token (`<|image_pad|>`; GLM-4.1V: `<|image|>`)"""

    @property
    def chat_template(self):
        return getattr(self.tokenizer, "chat_template", None)

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def save_pretrained(self, directory, **kwargs):
        """Write `preprocessor_config.json` and the tokenizer files (chat template included), as the full
        processor does, so `AutoProcessor` / `load_processor` read the dir back."""
        self.image_processor.save_pretrained(directory)
        return self.tokenizer.save_pretrained(directory, **kwargs)

    def __call__(self, text: Sequence[str], images=None, return_tensors: str = "pt"):
        pad = self.image_token
        image_pad_id = self.tokenizer.convert_tokens_to_ids(pad)
        merge = int(self.image_processor.merge_size) ** 2
        out: dict[str, Any] = {}
        grids: list = []
        if images:
            vision = self.image_processor(images=list(images), return_tensors="pt")
            out["pixel_values"], out["image_grid_thw"] = vision["pixel_values"], vision["image_grid_thw"]
            grids = [int(g.prod()) // merge for g in vision["image_grid_thw"]]
        expanded, k = [], 0
        for t in text:
            pieces = t.split(pad)
            rebuilt = pieces[0]
            for piece in pieces[1:]:
                if k >= len(grids):
                    raise DataError(f"more {pad} placeholders than images ({len(grids)})")
                rebuilt += pad * grids[k] + piece
                k += 1
            expanded.append(rebuilt)
        if k != len(grids):
            raise DataError(f"{len(grids)} images but {k} {pad} placeholders in the text")
        enc = self.tokenizer(expanded, add_special_tokens=False)
        ids = enc["input_ids"]
        out["input_ids"] = ids
        out["mm_token_type_ids"] = [[int(t == image_pad_id) for t in row] for row in ids]
        return out


def load_processor(path, tokenizer=None, trust_remote_code: bool = False):
    """`AutoProcessor.from_pretrained(path)`, or `ImageTextProcessor` when transformers cannot build the full
    processor on this host (Qwen2-VL's video processor needs torchvision). `tokenizer`: reuse this one."""
    from transformers import AutoImageProcessor, AutoProcessor

    path = os.path.expanduser(os.fspath(path))
    try:
        proc = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        if hasattr(proc, "image_processor"):
            return proc
    except (ImportError, AttributeError, ValueError, TypeError):
        pass  # no torchvision: Qwen2VLProcessor cannot be built; its image path is rebuilt below
    except OSError as err:
        raise UserError(f"cannot load the processor of {path!r}: {str(err).splitlines()[0]}") from err
    try:
        image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: a vision-language model needs its image processor (preprocessor_config.json): "
                        f"{str(err).splitlines()[0]}") from err
    if tokenizer is None:
        tokenizer = load_tokenizer(path, padding_side="left", trust_remote_code=trust_remote_code)
    return ImageTextProcessor(image_processor, tokenizer, _image_token(path, tokenizer))


def _image_token(path: str, tokenizer) -> str:
    """The image placeholder token of the model dir `path`: its config's `image_token_id` in `tokenizer`."""
    import json

    try:
        token_id = json.loads((Path(path) / "config.json").read_text()).get("image_token_id")
    except (OSError, ValueError):
        token_id = None
    return tokenizer.convert_ids_to_tokens(int(token_id)) if token_id is not None else IMAGE_PAD


def image_token(processor) -> str:
    """The image placeholder token a processor expands (`<|image_pad|>`; GLM-4.1V's `<|image|>`)."""
    return getattr(processor, "image_token", None) or IMAGE_PAD


IMAGE_SLOTS = {IMAGE_PAD: VISION_START + IMAGE_PAD + VISION_END,
               "<|image|>": "<|begin_of_image|><|image|><|end_of_image|>"}


def image_slot(processor) -> str:
    """The text one image part renders to in the processor's chat template, before expansion: Qwen's
    `<|vision_start|><|image_pad|><|vision_end|>`, GLM-4.1V's `<|begin_of_image|><|image|><|end_of_image|>`."""
    token = image_token(processor)
    return IMAGE_SLOTS.get(token, token)


def to_pil(image, where: str = "image"):
    """A PIL RGB image from a PIL image, raw bytes, a path, or verl's `{"bytes": ...}` / `{"path": ...}` dict."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, dict):
        if image.get("bytes") is not None:
            image = image["bytes"]
        elif image.get("path"):
            image = image["path"]
        elif image.get("image") is not None:
            return to_pil(image["image"], where)
        else:
            raise DataError(f"{where}: image entry has neither 'bytes' nor 'path' ({sorted(image)})")
    try:
        if isinstance(image, (bytes, bytearray)):
            img = Image.open(io.BytesIO(bytes(image)))
        elif isinstance(image, (str, os.PathLike)):
            p = Path(os.path.expanduser(os.fspath(image)))
            if not p.is_file():
                raise DataError(f"{where}: image file not found: {p}")
            img = Image.open(p)
        else:
            raise DataError(f"{where}: an image must be bytes, a path or a {{'bytes'|'path': ...}} dict, "
                            f"got {type(image).__name__}")
        img.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise DataError(f"{where}: unreadable image ({str(err).splitlines()[0] if str(err) else type(err).__name__})") \
            from None
    return img.convert("RGB")


def split_placeholders(messages: list[dict], n_images: int, where: str) -> list[dict]:
    """verl's `<image>` placeholders in string contents -> content parts (`{"type": "image"}`, `{"type": "text"}`),
    as verl's RLHFDataset does before the processor's chat template. Content already in parts is kept; the
    number of image parts must equal `n_images`."""
    out, count = [], 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            parts = []
            for i, seg in enumerate(content.split(IMAGE_PLACEHOLDER)):
                if i > 0:
                    parts.append({"type": "image"})
                    count += 1
                if seg:
                    parts.append({"type": "text", "text": seg})
            m = {**m, "content": parts}
        elif isinstance(content, (list, tuple)):
            parts = [dict(p) for p in content]
            count += sum(1 for p in parts if p.get("type") == "image" or "image" in p)
            m = {**m, "content": parts}
        out.append(m)
    if count != n_images:
        raise DataError(f"{where}: the prompt has {count} image placeholder(s) ({IMAGE_PLACEHOLDER} or "
                        f"{{'type': 'image'}}) but the row has {n_images} image(s)")
    return out


@dataclass
class ImagePrompt:
    """One prompt with its images, as the model takes it."""

    prompt_ids: list[int]
    text: str
    pixel_values: torch.Tensor
    """[N_patches, C * temporal_patch * patch * patch]"""
    image_grid_thw: torch.Tensor
    """[n_images, 3] (temporal, height, width) patches per image"""


def encode_image_prompt(processor, text: str, images: Sequence, where: str = "prompt") -> ImagePrompt:
    """Token ids (image placeholders expanded) and pixel tensors of one rendered prompt with its images."""
    try:
        enc = processor(text=[text], images=list(images), return_tensors="pt")
    except DataError as err:
        raise DataError(f"{where}: {err}") from None
    except ValueError as err:  # the full processor's placeholder / image count check
        raise DataError(f"{where}: {str(err).splitlines()[0]}") from None
    ids = enc["input_ids"][0]
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return ImagePrompt(prompt_ids=[int(t) for t in ids], text=text, pixel_values=enc["pixel_values"],
                       image_grid_thw=torch.as_tensor(enc["image_grid_thw"]).long())


def image_token_id(model) -> int:
    cfg = getattr(model, "config", model)
    return int(cfg.image_token_id)


def mrope_position_ids(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """M-RoPE positions `[3, B, L]` of a left-padded batch by the model's `get_rope_index` (image tokens
    take (t, h, w) grid positions, text continues after the image's largest one); pads get 0 / 1.
    image_grid_thw: `[n_images, 3]` of every image in the batch in row order (None: text only)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = base.model
    mm_types = (input_ids == image_token_id(base)).int()
    if image_grid_thw is None or len(image_grid_thw) == 0:
        pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return pos.unsqueeze(0).expand(3, -1, -1)
    pos, _ = inner.get_rope_index(input_ids, mm_types, image_grid_thw=image_grid_thw.to(input_ids.device),
                                  attention_mask=attention_mask)
    return pos


def vision_inputs(model, ids: torch.Tensor, mask: torch.Tensor, multi_modal) -> tuple[dict, torch.Tensor]:
    """(pixel keywords, position ids) of a micro-batch's forward: `pixel_values` / `image_grid_thw` of the rows with
    images in row order and M-RoPE positions `[3, B, L]`; ({}, 2-D positions `cumsum(mask) - 1`) for text rows.
    ids, mask: `[B, L]` (any padding); multi_modal: per row None or {"pixel_values", "image_grid_thw"}, or None.
    Image tokens in `ids` with no pixels raise: the model would read the placeholders as text."""
    if multi_modal is None or all(m is None for m in multi_modal):
        config = getattr(model, "config", None)
        if is_vision_model(config) and bool((ids == config.image_token_id).any()):
            raise RuntimeError("image tokens in a forward's input but no pixel_values: the batch lost its "
                               "multi_modal_inputs (a tiller bug; please report it)")
        return {}, (mask.long().cumsum(-1) - 1).clamp(min=0)
    rows = [m for m in multi_modal if m is not None]
    grid = torch.cat([m["image_grid_thw"] for m in rows]).to(ids.device)
    pixels = torch.cat([m["pixel_values"] for m in rows]).to(ids.device)
    return {"pixel_values": pixels, "image_grid_thw": grid}, mrope_position_ids(model, ids, mask, grid)


def vision_tower(model):
    """The vision encoder module of a Qwen2-VL-family model (a PeftModel: of its base model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.visual
