"""Preference datasets: paired (prompt, chosen, rejected) for RM / DPO, unpaired (prompt, completion, label) for KTO.

Rows (parquet or JSONL), TRL's column names by default:
- paired: `prompt` (string or chat messages), `chosen`, `rejected` (strings, or TRL's conversational
  form: a list holding one assistant message), optional `margin` (`data.margin_key`, RM) and optional
  precomputed reference log-prob sums (`data.ref_chosen_logps_key` / `data.ref_rejected_logps_key`, DPO).
- unpaired (KTO): `prompt`, `completion`, `label` (bool: desirable).

For DPO / KTO each sequence is tokenized as SFT's prompt / response
(`tiller.data.sft.encode_prompt_response`: the prompt through the chat template as the RL trainer
renders it, the completion followed by eos), so the policy learns on what it generates in RL. For a
reward model (`kind="rm"`) the pair is rendered as the RL reward-model scorer
(`tiller.rewards.reward_model`) renders it: the whole conversation `[user: prompt, assistant:
completion]` through the chat template, so training and scoring read the same last token.
OpenRLHF's prompt-less layout (`data.prompt_key=null`): `chosen` / `rejected` are whole conversations (lists of
chat messages ending with the assistant turn), or whole strings. DPO takes the prompt from `chosen[:-1]` and
the two last assistant turns as the completions (OpenRLHF); a reward model scores the whole conversations;
prompt-less strings are completions of an empty prompt (the loss covers the whole text). A string prompt
without a chat template goes through `data.input_template` when set (OpenRLHF's `--input_template`).
Over `data.max_length`:
`truncation=error` raises a `DataError` naming file and row; `left` drops the prompt's start;
`right` drops the completion's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from tiller.data.sft import encode_prompt_response, fit_length, IGNORE, SFTExample, shifted_labels
from tiller.data.sources import apply_template, load_sources
from tiller.errors import DataError


@dataclass
class PairExample:
    """A prompt with a chosen and a rejected completion (each a full `SFTExample` sequence)."""

    chosen: SFTExample
    rejected: SFTExample
    margin: float = 0.0
    ref_chosen_logp: float | None = None
    ref_rejected_logp: float | None = None


@dataclass
class UnpairedExample:
    """KTO: one prompt + completion, desirable or not; prompt / completion ids kept for the KL pairs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    desirable: bool


def completion_text(value: Any, what: str, where: str) -> str:
    """A completion given as a string or as TRL's `[{"role": "assistant", "content": ...}]`."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if len(value) != 1 or not isinstance(value[0], dict) or "content" not in value[0]:
            raise DataError(f"{where}: {what} as messages must be a list of exactly one assistant message")
        value = value[0]["content"]
    if not isinstance(value, str):
        raise DataError(f"{where}: {what} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: {what} is empty")
    return value


def make_sequence(prompt_ids: list[int], completion_ids: list[int], max_length: int, truncation: str,
                  where: str) -> SFTExample:
    """prompt + completion as an `SFTExample` with loss (log-prob) on the completion only."""
    ids = prompt_ids + completion_ids
    mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
    ids, mask = fit_length(ids, mask, max_length, truncation, where)
    example = SFTExample(ids, shifted_labels(ids, mask))
    if example.num_loss_tokens == 0:
        raise DataError(f"{where}: no completion token is left after truncation to data.max_length={max_length}")
    return example


def _require(row: dict, key: str | None, name: str, where: str) -> Any:
    if key not in row:
        raise DataError(f"{where}: missing key {key!r} ({name}); row has {sorted(row)}")
    return row[key]


def _float(value: Any, name: str, where: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise DataError(f"{where}: {name} must be a number, got {value!r}") from None
    if not np.isfinite(out):
        raise DataError(f"{where}: {name} must be finite, got {value!r}")
    return out


def _messages(value: Any) -> list | None:
    """`value` as a list of chat messages, or None when it is not one."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) and "content" in m for m in value):
        return [dict(m) for m in value]
    return None


def split_conversation(value: Any, key: str, where: str) -> tuple[list | None, str]:
    """Prompt-less layout: (prompt messages = all but the last turn, last assistant turn's text); a string is
    (None, the string)."""
    messages = _messages(value)
    if messages is None:
        if isinstance(value, str) and value.strip():
            return None, value
        raise DataError(f"{where}: {key} must be a conversation (list of chat messages) or a non-empty string "
                        "when data.prompt_key is null")
    if len(messages) < 2 or messages[-1].get("role") != "assistant":
        raise DataError(f"{where}: {key} must end with an assistant turn after at least one prompt turn "
                        "(data.prompt_key is null: the prompt is the conversation without its last turn)")
    return messages[:-1], completion_text(messages[-1]["content"], key, where)


def _promptless_pair(row: dict, data_cfg, tokenizer, where: str) -> list[SFTExample]:
    seqs, prompts = [], []
    for key, name in ((data_cfg.chosen_key, "data.chosen_key"), (data_cfg.rejected_key, "data.rejected_key")):
        prompt, text = split_conversation(_require(row, key, name, where), key, where)
        prompts.append(prompt)
        if prompt is None:  # a whole string: completion of an empty prompt
            p_ids = []
            c_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if tokenizer.eos_token_id is not None:
                c_ids.append(tokenizer.eos_token_id)
        else:
            p_ids, c_ids = encode_prompt_response(prompt, text, tokenizer, data_cfg.apply_chat_template, where)
        seqs.append(make_sequence(p_ids, c_ids, data_cfg.max_length, data_cfg.truncation, where))
    if (prompts[0] is None) != (prompts[1] is None):
        raise DataError(f"{where}: {data_cfg.chosen_key} and {data_cfg.rejected_key} must both be conversations or "
                        "both strings")
    return seqs


def encode_pair(row: dict, data_cfg, tokenizer, where: str) -> PairExample:
    if data_cfg.prompt_key is None:
        seqs = _promptless_pair(row, data_cfg, tokenizer, where)
    else:
        prompt = _require(row, data_cfg.prompt_key, "data.prompt_key", where)
        seqs = []
        for key, name in ((data_cfg.chosen_key, "data.chosen_key"), (data_cfg.rejected_key, "data.rejected_key")):
            text = completion_text(_require(row, key, name, where), key, where)
            p_ids, c_ids = encode_prompt_response(prompt, text, tokenizer, data_cfg.apply_chat_template, where,
                                                  data_cfg.input_template,
                                                  add_special_tokens=data_cfg.add_special_tokens)
            seqs.append(make_sequence(p_ids, c_ids, data_cfg.max_length, data_cfg.truncation, where))
    out = PairExample(seqs[0], seqs[1])
    if data_cfg.margin_key:
        out.margin = _float(_require(row, data_cfg.margin_key, "data.margin_key", where), data_cfg.margin_key, where)
    if data_cfg.ref_chosen_logps_key:
        out.ref_chosen_logp = _float(_require(row, data_cfg.ref_chosen_logps_key, "data.ref_chosen_logps_key", where),
                                     data_cfg.ref_chosen_logps_key, where)
        out.ref_rejected_logp = _float(
            _require(row, data_cfg.ref_rejected_logps_key, "data.ref_rejected_logps_key", where),
            data_cfg.ref_rejected_logps_key, where)
    return out


def render_conversation(prompt: Any, completion: str, tokenizer, apply_chat_template: bool) -> str:
    """Text of `[user: prompt, assistant: completion]` exactly as the RL reward-model scorer renders it."""
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    messages = list(prompt) if isinstance(prompt, (list, tuple)) else [{"role": "user", "content": str(prompt)}]
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": completion}], tokenize=False)
    return "".join(str(m["content"]) for m in messages) + completion


def whole_conversation(value: Any, key: str, tokenizer, apply_chat_template: bool, where: str) -> str:
    """Text of a whole conversation (chat template when on and present, else the contents joined) or string."""
    messages = _messages(value)
    if messages is None:
        if isinstance(value, str) and value.strip():
            return value
        raise DataError(f"{where}: {key} must be a conversation or a non-empty string when data.prompt_key is null")
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "".join(str(m["content"]) for m in messages)


def encode_rm_pair(row: dict, data_cfg, tokenizer, where: str) -> PairExample:
    """A pair for reward-model training: whole conversations, no loss mask (the score reads the last token)."""
    prompt = _require(row, data_cfg.prompt_key, "data.prompt_key", where) if data_cfg.prompt_key is not None else None
    seqs = []
    for key, name in ((data_cfg.chosen_key, "data.chosen_key"), (data_cfg.rejected_key, "data.rejected_key")):
        value = _require(row, key, name, where)
        templated = data_cfg.apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
        if prompt is None:  # prompt-less layout: the whole conversation (or string) is scored
            text = whole_conversation(value, key, tokenizer, data_cfg.apply_chat_template, where)
            templated = templated and _messages(value) is not None
        else:
            if data_cfg.input_template and isinstance(prompt, str) and not (
                    data_cfg.apply_chat_template and getattr(tokenizer, "chat_template", None)):
                prompt = apply_template(data_cfg.input_template, prompt)
            text = render_conversation(prompt, completion_text(value, key, where), tokenizer,
                                       data_cfg.apply_chat_template)
        ids = list(tokenizer(text, add_special_tokens=data_cfg.add_special_tokens and not templated)["input_ids"])
        ids, _ = fit_length(ids, [0] * len(ids), data_cfg.max_length, data_cfg.truncation, where)
        seqs.append(SFTExample(ids, [IGNORE] * len(ids)))
    out = PairExample(seqs[0], seqs[1])
    if data_cfg.margin_key:
        out.margin = _float(_require(row, data_cfg.margin_key, "data.margin_key", where), data_cfg.margin_key, where)
    return out


def _label(value: Any, key: str, where: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise DataError(f"{where}: {key} must be a boolean (desirable), got {value!r}")


def encode_unpaired(row: dict, data_cfg, tokenizer, where: str) -> UnpairedExample:
    prompt = _require(row, data_cfg.prompt_key, "data.prompt_key", where)
    text = completion_text(_require(row, data_cfg.completion_key, "data.completion_key", where),
                           data_cfg.completion_key, where)
    p_ids, c_ids = encode_prompt_response(prompt, text, tokenizer, data_cfg.apply_chat_template, where,
                                          data_cfg.input_template, add_special_tokens=data_cfg.add_special_tokens)
    make_sequence(p_ids, c_ids, data_cfg.max_length, data_cfg.truncation, where)  # length check only
    desirable = _label(_require(row, data_cfg.label_key, "data.label_key", where), data_cfg.label_key, where)
    return UnpairedExample(p_ids, c_ids, desirable)


IMAGE_COLUMNS = ("images", "image")
"""verl's / TRL's image columns: preference rows carrying them are refused (text-only jobs)."""


def refuse_images(row: dict, where: str) -> None:
    """A preference row with images: the reward-model / DPO / KTO / SPIN jobs train on text only, so the images
    would be silently dropped; refuse the row instead."""
    for key in IMAGE_COLUMNS:
        value = row.get(key)
        if value is not None and not (hasattr(value, "__len__") and len(value) == 0):
            raise DataError(f"{where}: the row has images (column {key!r}); tiller's rm, dpo, kto and spin jobs "
                            "train on text only (image preference data is not supported yet): drop the column")


def load_preference_examples(files: Sequence[str], data_cfg, tokenizer, kind: str = "paired",
                             max_samples: int = -1, which: str = "train", seed: int = 42) -> list:
    """Tokenize every row of `files`: kind "paired" (DPO) or "rm" -> `PairExample`, "unpaired" (KTO) ->
    `UnpairedExample`.
    `which` / `seed`: the sources' split, blend and seed (`tiller.data.sources`, as `load_sft_examples`)."""
    encode = {"paired": encode_pair, "rm": encode_rm_pair, "unpaired": encode_unpaired}[kind]
    if kind == "unpaired" and data_cfg.prompt_key is None:
        raise DataError("KTO needs data.prompt_key (a prompt column)")
    if not files:
        raise DataError("no training rows in (no files: set data.train_files)")
    probs = data_cfg.train_probs if which == "train" else None
    split = data_cfg.train_split if which == "train" else data_cfg.val_split
    examples: list = []
    for where, row in load_sources([str(f) for f in files], split, probs, seed, max_per_source=max_samples):
        refuse_images(row, where)
        examples.append(encode(row, data_cfg, tokenizer, where))
        if 0 < max_samples <= len(examples):
            return examples
    if not examples:
        raise DataError(f"no training rows in {', '.join(map(str, files))}")
    return examples
