"""TRL's preference and unpaired-preference rows -> the rows of tiller's preference jobs (`tiller.data.preference`).

- `extract_prompt`: TRL's implicit prompt (only `chosen` / `rejected`: the longest common prefix of the two, turns
  of a conversation or characters of a string, a trailing space left to the completions) - TRL's function, rewritten
  here because tiller does not import trl.
- DPO rows: `prompt` (string or messages) + one-turn `chosen` / `rejected`; standard strings are read without a chat
  template (TRL tokenizes them as they are), a trailing eos text is dropped (tiller appends the eos token, as TRL
  appends it when missing).
- KTO rows: `prompt` / `completion` / `label`; paired rows are unpaired as TRL's `unpair_preference_dataset` does
  (per block of 1000 rows: the chosen completions labelled True, then the rejected labelled False).
- Reward-model rows: whole sequences (prompt + completion) in tiller's prompt-less layout: a conversation rendered
  by the chat template, or a string with eos appended (TRL's tokenization of both); `margin` kept.
Standard (string) rows are tokenized with the tokenizer's special tokens (`data.add_special_tokens`: e.g. Llama's
BOS), as TRL's tokenizer call adds them; conversations only get what the chat template renders.
"""

from __future__ import annotations

from typing import Any

from tiller.errors import DataError

UNPAIR_BLOCK = 1000  # datasets.map(batched=True)'s default batch size, which unpair_preference_dataset uses


def extract_prompt(example: dict) -> dict:
    """TRL's `extract_prompt`: the shared prefix of chosen and rejected becomes the prompt."""
    chosen, rejected = example["chosen"], example["rejected"]
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # remove space before the prompt
                idx -= 1
            break
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def _is_messages(value: Any) -> bool:
    if hasattr(value, "tolist"):
        value = value.tolist()
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, dict) and "role" in m
                                                                    for m in value)


def _strip_eos(text: Any, eos: str | None, where: str) -> str:
    if not isinstance(text, str):
        raise DataError(f"{where}: must be a string or a list of messages, got {type(text).__name__}")
    return text[: -len(eos)] if eos and text.endswith(eos) else text


def _one_turn(value: Any, where: str) -> list[dict]:
    turns = value.tolist() if hasattr(value, "tolist") else value
    if not _is_messages(turns) or len(turns) != 1 or turns[0].get("role") != "assistant":
        raise DataError(f"{where}: a conversational completion must be one assistant message (tiller learns one "
                        "assistant turn after the prompt); put earlier turns in the prompt")
    return [dict(turns[0])]


def _need(row: dict, key: str, where: str) -> Any:
    if key not in row:
        raise DataError(f"{where}: no {key!r} column (columns: {', '.join(sorted(row))})")
    return row[key]


def with_prompt(rows: list[dict], where: str) -> list[dict]:
    """Rows with an explicit prompt (TRL extracts the implicit one when the first row has none)."""
    if "prompt" in rows[0]:
        return rows
    out = []
    for i, row in enumerate(rows):
        at = f"{where} row {i}"
        pair = {"chosen": _need(row, "chosen", at), "rejected": _need(row, "rejected", at)}
        pair = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in pair.items()}
        out.append({**row, **extract_prompt(pair)})
    return out


def dpo_rows(rows: list[dict], eos: str | None, where: str) -> tuple[list[dict], dict[str, Any]]:
    """TRL DPO rows -> (tiller paired rows, data keys)."""
    rows = with_prompt(rows, where)
    conversational = _is_messages(rows[0]["prompt"])
    out = []
    for i, row in enumerate(rows):
        at = f"{where} row {i}"
        prompt = _need(row, "prompt", at)
        if conversational:
            if not _is_messages(prompt):
                raise DataError(f"{at}: prompt must be a list of messages like the first row's")
            item = {"prompt": list(prompt), "chosen": _one_turn(_need(row, "chosen", at), at + ": chosen"),
                    "rejected": _one_turn(_need(row, "rejected", at), at + ": rejected")}
        else:
            item = {"prompt": _strip_eos(prompt, None, at + ": prompt"),
                    "chosen": _strip_eos(_need(row, "chosen", at), eos, at + ": chosen"),
                    "rejected": _strip_eos(_need(row, "rejected", at), eos, at + ": rejected")}
        out.append(item)
    return out, {"data.prompt_key": "prompt", "data.chosen_key": "chosen", "data.rejected_key": "rejected",
                 "data.apply_chat_template": conversational, "data.add_special_tokens": not conversational}


def unpair(rows: list[dict]) -> list[dict]:
    """TRL's `unpair_preference_dataset` (batched map, blocks of 1000): chosen -> label True, rejected -> False."""
    out: list[dict] = []
    for start in range(0, len(rows), UNPAIR_BLOCK):
        block = rows[start:start + UNPAIR_BLOCK]
        for key, label in (("chosen", True), ("rejected", False)):
            for row in block:
                item = {k: v for k, v in row.items() if k not in ("chosen", "rejected")}
                out.append({**item, "completion": row[key], "label": label})
    return out


def kto_rows(rows: list[dict], eos: str | None, where: str) -> tuple[list[dict], dict[str, Any]]:
    """TRL KTO rows (unpaired, or paired preference rows unpaired as TRL does) -> (tiller rows, data keys)."""
    if "chosen" in rows[0] and "rejected" in rows[0]:
        rows = unpair(with_prompt(rows, where))
    conversational = _is_messages(_need(rows[0], "prompt", f"{where} row 0"))
    out = []
    for i, row in enumerate(rows):
        at = f"{where} row {i}"
        prompt, completion, label = _need(row, "prompt", at), _need(row, "completion", at), _need(row, "label", at)
        if conversational:
            completion = _one_turn(completion, at + ": completion")
        else:
            prompt = _strip_eos(prompt, None, at + ": prompt")
            completion = _strip_eos(completion, eos, at + ": completion")
        out.append({"prompt": list(prompt) if conversational else prompt, "completion": completion,
                    "label": label})
    return out, {"data.prompt_key": "prompt", "data.completion_key": "completion", "data.label_key": "label",
                 "data.apply_chat_template": conversational, "data.add_special_tokens": not conversational}


def reward_rows(rows: list[dict], eos: str | None, where: str) -> tuple[list[dict], dict[str, Any]]:
    """TRL reward rows -> (tiller prompt-less pairs: whole sequences, data keys); `margin` kept when present."""
    has_margin = "margin" in rows[0]
    out = []
    for i, row in enumerate(rows):
        at = f"{where} row {i}"
        prompt = row.get("prompt")
        item = {}
        for key in ("chosen", "rejected"):
            value = _need(row, key, at)
            value = value.tolist() if hasattr(value, "tolist") else value
            if _is_messages(value):
                item[key] = (list(prompt) if prompt is not None else []) + list(value)
            else:
                text = (prompt if prompt is not None else "") + _strip_eos(value, None, f"{at}: {key}")
                item[key] = text if eos is None or text.endswith(eos) else text + eos
        if has_margin:
            item["margin"] = float(_need(row, "margin", at))
        out.append(item)
    keys = {"data.prompt_key": None, "data.chosen_key": "chosen", "data.rejected_key": "rejected",
            "data.apply_chat_template": True, "data.add_special_tokens": True}  # strings: TRL's tokenizer call
    if has_margin:
        keys["data.margin_key"] = "margin"
    return out, keys
