"""Image prompts of TRL 1.16's GRPO / RLOO on tiller's vision-language RL path (docs/vlm.md).

TRL takes a batch's images from the `images` column (a list per row) or else the `image` column (one per row, None
for none), and turns each conversational prompt into content parts with `prepare_multimodal_messages`: string
contents become `{"type": "text", "text": ...}` parts, and the first user message's text gets one
`{"type": "image"}` part per image in front of it; parts a prompt already has are kept (an image part that
already holds its image keeps it, the others are filled from the column in order). The processor's chat template
renders that and the processor expands each image's placeholder. Reward functions get those prompts (the image
parts holding their images) and every other column as it is, `image` / `images` included.

On tiller: `multimodal_row` builds the same parts, without the image objects (the chat template only needs their
places), plus the images in the order of their parts; the run's prompt file carries those as verl's multimodal
rows (`images: [{"bytes": ...}]`, data.image_key=images) in parquet (bytes have no JSON form), written atomically;
tiller's RL data path renders them with the processor's chat template (tiller.data.rl_dataset). Standard (string)
prompts with images are an error, as in TRL.
"""

from __future__ import annotations

import io
from typing import Any

from tiller.errors import DataError

IMAGE_COLUMNS = ("images", "image")  # TRL reads "images" first, then "image"


def image_column(rows: list[dict]) -> str | None:
    """The column TRL takes a batch's images from (`images` before `image`), judged by the first row as TRL does;
    None when there is none."""
    return next((c for c in IMAGE_COLUMNS if c in rows[0]), None)


def row_images(row: dict, column: str | None) -> list:
    """One row's images as TRL collects them: `images` as a list, `image` as [image] (None: no images)."""
    if column is None:
        return []
    value = row.get(column)
    if value is None:
        return []
    if column == "image":
        return [value]
    return list(value)


def multimodal_row(prompt: Any, images: list, where: str) -> tuple[list[dict], list[dict], list]:
    """TRL's `prepare_multimodal_messages(prompt, images)`: (the messages in parts without the image objects, the
    messages with each image part holding its image (what reward functions get), the images in part order)."""
    if not isinstance(prompt, (list, tuple)):
        raise DataError(f"{where}: a standard (string) prompt with images: multimodal training takes conversational "
                        "prompts (a list of {'role', 'content'} messages), as in TRL")
    parts, included = [], False
    for message in prompt:
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant", "tool"):
            raise DataError(f"{where}: invalid role in message: {role!r} (expected system, user, assistant or tool)")
        if isinstance(content, str):
            if role == "user" and not included:
                content = [*({"type": "image"} for _ in images), {"type": "text", "text": content}]
                included = True
            else:
                content = [{"type": "text", "text": content}]
        parts.append({**message, "content": content})
    holes = sum(1 for m in parts if m.get("content") and m["role"] != "tool"
                for p in m["content"] if p.get("type") == "image" and "image" not in p)
    if holes != len(images):
        raise DataError(f"{where}: {len(images)} image(s) in the image column but {holes} image placeholder(s) "
                        "({'type': 'image'} parts) in the prompt")
    filled, plain, ordered, k = [], [], [], 0
    for message in parts:
        content = message.get("content")
        if not isinstance(content, (list, tuple)) or not content:
            filled.append(message)
            plain.append(message)
            continue
        with_images, without = [], []
        for part in content:
            if part.get("type") == "image":
                if "image" not in part and message["role"] == "tool":
                    raise DataError(f"{where}: a tool message's image part without its image")
                image = part["image"] if "image" in part else images[k]
                k += "image" not in part
                ordered.append(image)
                with_images.append({**part, "image": image})
                without.append({key: v for key, v in part.items() if key != "image"})
            else:
                with_images.append(part)
                without.append(part)
        filled.append({**message, "content": with_images})
        plain.append({**message, "content": without})
    return plain, filled, ordered


def image_entry(image: Any, where: str) -> dict:
    """An image as verl's `{"bytes": ...}` entry: the encoded bytes of a `datasets` image entry (or raw bytes) as
    they are, else the image (PIL, a path) read and stored as PNG (lossless)."""
    if isinstance(image, dict) and image.get("bytes") is not None:
        return {"bytes": bytes(image["bytes"])}
    if isinstance(image, (bytes, bytearray)):
        return {"bytes": bytes(image)}
    # import cost: PIL loads only for image prompts
    from tiller.models.vision import to_pil

    buf = io.BytesIO()
    to_pil(image, where).save(buf, format="PNG")
    return {"bytes": buf.getvalue()}
