"""SFT datasets: prompt / response pairs or chat conversations, tokenized with a loss mask.

Two row formats (parquet or JSONL; `tiller.data.files.read_rows` reads both):

- prompt / response (verl's `SFTDataset`, `data.prompt_key` / `data.response_key`; OpenRLHF's
  `input_key` / `output_key` are accepted as aliases). The prompt is a string or a list of chat
  messages and is rendered exactly as the RL trainer renders prompts (`render_prompt`: the chat
  template with `add_generation_prompt=True`); the response is tokenized as is and followed by the
  eos token, which ends an assistant turn in ChatML. Loss on response tokens (and that eos) only.
- chat messages (verl's `MultiTurnSFTDataset`, `data.messages_key`): a list of
  `{"role", "content"}` turns rendered with the chat template; loss on EVERY assistant turn. The
  mask comes from the template's `{% generation %}` markers (`return_assistant_tokens_mask=True`);
  a template without them is handled by incremental rendering: the assistant span of turn i is the
  text that `messages[:i+1]` adds to `messages[:i]` rendered with `add_generation_prompt=True`.

- plain text (`data.format=text`, `data.text_key`; TRL's language-modeling rows): the text followed by
  eos (unless it already ends with the eos token's text), tokenized as one string; loss on EVERY token.

`data.format=auto` picks messages when the messages column is present, else text when the text column is
present and the prompt column is not, else prompt / response. `data.assistant_only_loss=False` puts the loss
of a chat conversation on every token it renders to (TRL's default for a `messages` dataset).

Length: a sequence over `data.max_length` tokens raises a `DataError` naming file and row
(`data.truncation=error`, the default), or is cut: `right` keeps the start (the response tail is
lost), `left` keeps the end (the prompt head is lost). An example left with no loss token raises.

Images (vision-language models): a chat row with an `images` column (`data.image_key`) and `<image>`
placeholders is encoded by `tiller.data.sft_vision` (pixels kept on the example); see that module.
`data.assistant_only_loss=False` puts its loss on every token, the image tokens included (as TRL's
`DataCollatorForVisionLanguageModeling` labels them).

Each example is stored as `input_ids` and `labels` (the next-token target at every position, -100
where no loss is taken; the last position is always -100), so packed sequences never predict across
a boundary: see `tiller.data.packing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from tiller.data.rl_dataset import render_prompt, row_images
from tiller.data.sft_vision import count_placeholders, expand_images, plain_messages
from tiller.data.sources import load_sources
from tiller.errors import DataError
from tiller.models.loading import VISION_FAMILIES
from tiller.models.vision import split_placeholders

IGNORE = -100
FORMATS = ("auto", "prompt_response", "messages", "text")


@dataclass
class SFTExample:
    """One tokenized training sequence.

    input_ids: [L] token ids.  labels: [L] target of position t (= input_ids[t+1]) or -100.
    """

    input_ids: list[int]
    labels: list[int]
    multi_modal: dict | None = None
    """image conversations: {"pixel_values", "image_grid_thw"} (`tiller.data.sft_vision`); None for text."""

    @property
    def num_loss_tokens(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE)


def shifted_labels(input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[int]:
    """labels[t] = input_ids[t+1] where loss_mask[t+1] else -100; labels[-1] = -100."""
    out = [IGNORE] * len(input_ids)
    for t in range(len(input_ids) - 1):
        if loss_mask[t + 1]:
            out[t] = int(input_ids[t + 1])
    return out


def _as_list(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def _check_text(value: Any, what: str, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {what} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: {what} is empty")
    return value


def encode_prompt_response(prompt: Any, response: Any, tokenizer, apply_chat_template: bool,
                           where: str, input_template: str | None = None,
                           chat_template_kwargs: dict | None = None,
                           add_special_tokens: bool = False) -> tuple[list[int], list[int]]:
    """(prompt_ids, response_ids) with the response followed by eos; raises `DataError` on empty text.
    A string prompt without a chat template goes through `input_template` when one is given (OpenRLHF).
    `chat_template_kwargs`: extra template variables (`tiller sft`'s data.apply_chat_template_kwargs).
    `add_special_tokens`: a prompt no chat template rendered gets the tokenizer's special tokens
    (data.add_special_tokens)."""
    prompt = _as_list(prompt)
    if isinstance(prompt, str):
        _check_text(prompt, "prompt", where)
    text = render_prompt(prompt, tokenizer, apply_chat_template, where, input_template, chat_template_kwargs)
    response = _check_text(_as_list(response), "response", where)
    templated = apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
    prompt_ids = tokenizer(text, add_special_tokens=add_special_tokens and not templated)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        response_ids = response_ids + [tokenizer.eos_token_id]
    return list(prompt_ids), list(response_ids)


def _check_messages(messages: Any, where: str) -> list[dict]:
    messages = _as_list(messages)
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{'role', 'content'}} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {i} must be a dict with 'role' and 'content'")
        out.append({"role": str(m["role"]), "content": m["content"]})
    assistant = [m for m in out if m["role"] == "assistant"]
    if not assistant:
        raise DataError(f"{where}: the conversation has no assistant turn to learn from")
    if any(not str(m["content"]).strip() for m in assistant):
        raise DataError(f"{where}: an assistant turn is empty")
    return out


def encode_messages(messages: Any, tokenizer, where: str,
                    chat_template_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a chat conversation: mask 1 on every assistant turn's tokens.
    `chat_template_kwargs`: extra template variables (data.apply_chat_template_kwargs)."""
    messages = _check_messages(messages, where)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: chat-message data needs a tokenizer with a chat template")
    if "{% generation %}" in tokenizer.chat_template or "{%- generation %}" in tokenizer.chat_template:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **(chat_template_kwargs or {}))
        return list(out["input_ids"]), list(out["assistant_masks"])
    return _encode_incremental(messages, tokenizer, where, chat_template_kwargs)


def _render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **(kwargs or {}))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _encode_incremental(messages: list[dict], tokenizer, where: str,
                        kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """Loss mask by rendering growing prefixes (templates without generation markers)."""
    full = _render_ids(tokenizer, messages, False, kwargs)
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(_render_ids(tokenizer, messages[:i], True, kwargs)) if i else 0
        end = len(_render_ids(tokenizer, messages[: i + 1], False, kwargs))
        if full[:end] != _render_ids(tokenizer, messages[: i + 1], False, kwargs):
            raise DataError(f"{where}: the chat template does not render turns as a prefix; "
                            "add {% generation %} markers to it for multi-turn SFT")
        for t in range(start, min(end, len(full))):
            mask[t] = 1
    return full, mask


def encode_text(text: Any, tokenizer, where: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of a plain-text row: the text + eos (not doubled when the text ends with it), one tokenizer call,
    as TRL's SFTTrainer tokenizes its language-modeling rows (with the special tokens when `add_special_tokens`)."""
    text = _check_text(_as_list(text), "text", where)
    eos = tokenizer.eos_token
    if eos and not text.endswith(eos):
        text = text + eos
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def fit_length(ids: list[int], mask: list[int], max_length: int, truncation: str,
               where: str) -> tuple[list[int], list[int]]:
    """Apply `data.max_length` / `data.truncation` (error | left | right) to a full sequence."""
    if len(ids) <= max_length:
        return ids, mask
    if truncation == "right":
        return ids[:max_length], mask[:max_length]
    if truncation == "left":
        return ids[-max_length:], mask[-max_length:]
    raise DataError(f"{where}: sequence has {len(ids)} tokens > data.max_length={max_length}; "
                    "raise data.max_length or set data.truncation=left|right")


def detect_format(rows: list[dict], data_cfg, path: str) -> str:
    fmt = data_cfg.format
    if fmt != "auto":
        return fmt
    if rows and data_cfg.messages_key in rows[0]:
        return "messages"
    pkey, _ = prompt_response_keys(data_cfg)
    if rows and data_cfg.text_key in rows[0] and pkey not in rows[0]:
        return "text"
    return "prompt_response"


def prompt_response_keys(data_cfg) -> tuple[str, str]:
    """(prompt key, response key) with OpenRLHF's input_key / output_key taking precedence when set."""
    return (data_cfg.input_key or data_cfg.prompt_key, data_cfg.output_key or data_cfg.response_key)


def _encode_image_row(row: dict, fmt: str, data_cfg, tokenizer, processor, where: str) -> SFTExample | None:
    """An image conversation's example (`tiller.data.sft_vision`); None for a text row. Refuses images a text
    model or the prompt / response format cannot take, and placeholders without images."""
    image_key = data_cfg.image_key
    images = row_images(row, image_key, where)
    messages = row.get(data_cfg.messages_key) if fmt == "messages" else None
    if not images:
        slots = count_placeholders(messages) if processor is not None and messages is not None else 0
        if slots:
            raise DataError(f"{where}: the messages have {slots} image placeholder(s) (<image> or {{'type': 'image'}}) "
                            f"but the row has no images (column {image_key!r}, data.image_key)")
        return None
    if processor is None:
        raise DataError(f"{where}: the row has images (column {image_key!r}) but the model is not a vision-language "
                        f"model tiller trains ({VISION_FAMILIES}); drop the column or change data.image_key")
    if fmt != "messages":
        raise DataError(f"{where}: the row has images (column {image_key!r}); image SFT takes chat conversations "
                        f"with <image> placeholders (data.format=messages, column {data_cfg.messages_key!r})")
    if messages is None:
        raise DataError(f"{where}: missing key {data_cfg.messages_key!r} (data.messages_key); row has {sorted(row)}")
    messages = plain_messages(messages)
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise DataError(f"{where}: messages must be a non-empty list of {{'role', 'content'}} dicts")
    parts = split_placeholders([dict(m) for m in messages], len(images), where)
    kwargs = dict(data_cfg.apply_chat_template_kwargs)
    ids, mask = encode_messages(parts, tokenizer, where, kwargs)  # one <|image_pad|> per image
    ids, mask, pixels = expand_images(parts, ids, mask, images, processor, tokenizer, where, kwargs)
    if not data_cfg.assistant_only_loss:  # every token, the image tokens too (TRL's vision collator's labels)
        mask = [1] * len(ids)
    if len(ids) > data_cfg.max_length:
        raise DataError(f"{where}: the conversation has {len(ids)} tokens (image tokens included) > "
                        f"data.max_length={data_cfg.max_length}; image conversations are not truncated: "
                        "raise data.max_length")
    example = SFTExample(input_ids=ids, labels=shifted_labels(ids, mask), multi_modal=pixels)
    if example.num_loss_tokens == 0:
        raise DataError(f"{where}: no assistant token to learn from")
    return example


def encode_row(row: dict, fmt: str, data_cfg, tokenizer, where: str, processor=None) -> SFTExample:
    """Tokenize one row into an `SFTExample` (see the module docstring); `processor`: a vision-language
    model's (`tiller.models.vision.load_processor`), for rows with images."""
    example = _encode_image_row(row, fmt, data_cfg, tokenizer, processor, where)
    if example is not None:
        return example
    if fmt == "messages":
        key = data_cfg.messages_key
        if key not in row:
            raise DataError(f"{where}: missing key {key!r} (data.messages_key); row has {sorted(row)}")
        ids, mask = encode_messages(row[key], tokenizer, where, dict(data_cfg.apply_chat_template_kwargs))
        if not data_cfg.assistant_only_loss:
            mask = [1] * len(ids)
    elif fmt == "text":
        if data_cfg.text_key not in row:
            raise DataError(f"{where}: missing key {data_cfg.text_key!r} (data.text_key); row has {sorted(row)}")
        ids = encode_text(row[data_cfg.text_key], tokenizer, where, data_cfg.add_special_tokens)
        mask = [1] * len(ids)
    else:
        pkey, rkey = prompt_response_keys(data_cfg)
        for key, name in ((pkey, "data.prompt_key"), (rkey, "data.response_key")):
            if key not in row:
                raise DataError(f"{where}: missing key {key!r} ({name}); row has {sorted(row)}")
        p_ids, r_ids = encode_prompt_response(row[pkey], row[rkey], tokenizer, data_cfg.apply_chat_template, where,
                                              data_cfg.input_template, dict(data_cfg.apply_chat_template_kwargs),
                                              data_cfg.add_special_tokens)
        ids, mask = p_ids + r_ids, [0] * len(p_ids) + [1] * len(r_ids)
    ids, mask = fit_length(ids, mask, data_cfg.max_length, data_cfg.truncation, where)
    example = SFTExample(input_ids=ids, labels=shifted_labels(ids, mask))
    if example.num_loss_tokens == 0:
        raise DataError(f"{where}: no response token is left to learn from (after data.truncation="
                        f"{data_cfg.truncation!r} to data.max_length={data_cfg.max_length})")
    return example


def load_sft_examples(files: Sequence[str], data_cfg, tokenizer, max_samples: int = -1,
                      which: str = "train", seed: int = 42, processor=None) -> list[SFTExample]:
    """Read and tokenize every row of `files` (see the module docstring); `DataError` names file and row.
    `which` = train | val picks data.train_probs / data.train_split or data.val_split (`tiller.data.sources`);
    `seed` seeds a probability blend (OpenRLHF blends with its --seed: pass trainer.seed)."""
    if data_cfg.format not in FORMATS:
        raise DataError(f"data.format={data_cfg.format!r} is not one of: {', '.join(FORMATS)}")
    if not files:
        raise DataError("no training rows in (no files: set data.train_files)")
    probs = data_cfg.train_probs if which == "train" else None
    split = data_cfg.train_split if which == "train" else data_cfg.val_split
    rows = load_sources([str(f) for f in files], split, probs, seed, max_per_source=max_samples)
    fmt = detect_format([r for _, r in rows[:1]], data_cfg, str(files[0]))
    examples: list[SFTExample] = []
    for where, row in rows:
        examples.append(encode_row(row, fmt, data_cfg, tokenizer, where, processor))
        if 0 < max_samples <= len(examples):
            return examples
    if not examples:
        raise DataError(f"no training rows in {', '.join(map(str, files))}")
    return examples

