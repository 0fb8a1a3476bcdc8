"""SFT on image + text conversations (verl's multi-turn SFT parquet with an `images` column).

A row is a chat conversation (`data.messages_key`) whose messages hold verl's `<image>` placeholders (or
`{"type": "image"}` content parts), plus the row's images in `data.image_key` (default `images`; the same
entries as RL rows: `{"bytes"}` / `{"path"}` dicts, raw bytes, paths, PIL images), one per placeholder, in order.

Encoding (`tiller.data.sft`, with `expand_images` here): the placeholders become image parts
(`split_placeholders`), the conversation is rendered by the chat template with ONE `<|image_pad|>` per image, and
the assistant-token mask is computed on that text exactly as for text conversations
(`tiller.data.sft.encode_messages`). Each `<|image_pad|>` is then expanded to the image's
`prod(image_grid_thw) / merge_size**2` tokens (mask 0: no loss on image tokens), and the result is checked against
the processor's own encoding of the same text (`tiller.models.vision.encode_image_prompt`, which also gives the
pixels), so the ids are the ones the model's processor produces. `data.max_length` counts the image tokens; an
image conversation is never truncated (cutting image tokens breaks the input): over the limit is an error naming
file and row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tiller.errors import DataError
from tiller.models.vision import IMAGE_PLACEHOLDER, encode_image_prompt, image_token


def plain_messages(messages: Any) -> Any:
    """numpy arrays (parquet lists) -> Python lists, in the messages and in their content parts."""
    if isinstance(messages, np.ndarray):
        messages = messages.tolist()
    if not isinstance(messages, (list, tuple)):
        return messages
    out = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), np.ndarray):
            m = {**m, "content": [dict(p) if isinstance(p, dict) else p for p in m["content"].tolist()]}
        out.append(m)
    return out


def count_placeholders(messages: Any) -> int:
    """Image slots in a conversation: `<image>` in string contents plus `{"type": "image"}` parts."""
    n = 0
    for m in plain_messages(messages) or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            n += content.count(IMAGE_PLACEHOLDER)
        elif isinstance(content, (list, tuple)):
            n += sum(1 for p in content if isinstance(p, dict) and (p.get("type") == "image" or "image" in p))
    return n


def expand_image_pads(ids: list[int], mask: list[int], image_pad_id: int, counts: list[int],
                      where: str, pad: str = "<|image_pad|>") -> tuple[list[int], list[int]]:
    """Replace the k-th image placeholder (`pad`, id `image_pad_id`) of `ids` by `counts[k]` copies (mask 0 on
    each)."""
    out_ids, out_mask, k = [], [], 0
    for t, m in zip(ids, mask):
        if t == image_pad_id:
            if k >= len(counts):
                raise DataError(f"{where}: the rendered conversation has more {pad} tokens than images "
                                f"({len(counts)})")
            out_ids += [t] * counts[k]
            out_mask += [0] * counts[k]
            k += 1
        else:
            out_ids.append(t)
            out_mask.append(m)
    if k != len(counts):
        raise DataError(f"{where}: the rendered conversation has {k} {pad} token(s) for {len(counts)} image(s)")
    return out_ids, out_mask


def expand_images(parts: list[dict], ids: list[int], mask: list[int], images: list, processor, tokenizer,
                  where: str, chat_template_kwargs: dict | None = None) -> tuple[list[int], list[int], dict]:
    """(ids, loss mask, {"pixel_values", "image_grid_thw"}) of a conversation in image parts (`split_placeholders`)
    whose `ids` / `mask` were rendered with one `<|image_pad|>` per image (`tiller.data.sft.encode_messages`): each
    pad expanded to its image's tokens (mask 0), the result checked against the processor's own encoding."""
    text = tokenizer.apply_chat_template(parts, tokenize=False, **(chat_template_kwargs or {}))
    enc = encode_image_prompt(processor, text, images, where)
    merge = int(processor.image_processor.merge_size) ** 2
    counts = [int(g.prod()) // merge for g in enc.image_grid_thw]
    pad = image_token(processor)
    ids, mask = expand_image_pads(ids, mask, tokenizer.convert_tokens_to_ids(pad), counts, where, pad)
    if ids != enc.prompt_ids:
        raise DataError(f"{where}: the chat template's tokens differ from the processor's encoding of the same "
                        "conversation (a tokenizer / processor mismatch in the model dir)")
    return ids, mask, {"pixel_values": enc.pixel_values, "image_grid_thw": torch.as_tensor(enc.image_grid_thw).long()}
