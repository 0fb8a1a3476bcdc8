"""OpenAI `image_url` content parts for a vision-language model served by `tiller serve`.

A chat message's content may hold `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`
parts (OpenAI's format; a bare string for `image_url` is taken too, as vLLM does). Only `data:` URLs with base64
payloads are read: the server never fetches a remote `http(s)://` URL (a request must not make the server open
connections on its behalf), which is a 400 saying to send a data: URL. The image is decoded with PIL
(`tiller.models.vision.to_pil`) and goes with the rendered prompt through the model's processor
(`encode_image_prompt`), so the served model sees exactly what the trainer's data path gives it. An image part
sent to a text-only model is a 400; a payload that is not base64 or not an image is a 400 naming the part.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from tiller.errors import DataError
from tiller.models.vision import to_pil
from tiller.serve.protocol import RequestError


def image_part_url(part: dict, where: str) -> str:
    """The URL of an `image_url` content part (its `image_url.url`, or `image_url` itself when a string)."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where}.image_url.url is required (a data:image/...;base64,... URL)",
                           f"{where}.image_url")
    return url


def decode_image_url(url: str, where: str):
    """A PIL RGB image from a base64 `data:` URL; RequestError (400, naming `where`) for anything else."""
    from PIL import Image

    if url.startswith(("http://", "https://")):
        raise RequestError(f"{where}.image_url: remote image URLs are not fetched: send a data: URL "
                           "(data:image/png;base64,...)", f"{where}.image_url")
    header, comma, payload = url.partition(",")
    if not url.startswith("data:") or not comma or not header.endswith(";base64"):
        raise RequestError(f"{where}.image_url: not a base64 data: URL (expected data:image/<type>;base64,<data>, "
                           f"got {url[:40]!r}...)", f"{where}.image_url")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise RequestError(f"{where}.image_url: the data: URL's payload is not valid base64 ({err})",
                           f"{where}.image_url") from None
    try:
        return to_pil(raw, f"{where}.image_url")
    except DataError as err:
        raise RequestError(str(err), f"{where}.image_url") from None
    except Image.DecompressionBombError as err:
        raise RequestError(f"{where}.image_url: {err}", f"{where}.image_url") from None


def message_content(content: list[dict[str, Any]], where: str, images: list | None) -> str | list[dict]:
    """A message's content parts for the chat template: the text parts joined into one string when there is no
    image, else the parts in order (`{"type": "text"}` / `{"type": "image"}`), each image decoded and appended to
    `images`. `images` None: the model takes text only, and an image part is a 400."""
    parts: list[dict] = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "image_url":
            if images is None:
                raise RequestError(f"{where}[{j}]: image_url parts need a vision-language model; this model takes "
                                   "text only", f"{where}[{j}]")
            images.append(decode_image_url(image_part_url(part, f"{where}[{j}]"), f"{where}[{j}]"))
            parts.append({"type": "image"})
        else:
            accepted = "text and image_url" if images is not None else "text"
            raise RequestError(f"{where}: only {accepted} parts are supported, got {kind!r}", where)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts
