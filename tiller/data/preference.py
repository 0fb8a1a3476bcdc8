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
Over `data.max_length`:
`truncation=error` raises a `DataError` naming file and row; `left` drops the prompt's start;
`right` drops the completion's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from tiller.data.sft import SFTExample, encode_prompt_response, fit_length, shifted_labels
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


def encode_pair(row: dict, data_cfg, tokenizer, where: str) -> PairExample:
    prompt = _require(row, data_cfg.prompt_key, "data.prompt_key", where)
    seqs = []
    for key, name in ((data_cfg.chosen_key, "data.chosen_key"), (data_cfg.rejected_key, "data.rejected_key")):
        text = completion_text(_require(row, key, name, where), key, where)
        p_ids, c_ids = encode_prompt_response(prompt, text, tokenizer, data_cfg.apply_chat_template, where)
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


def encode_rm_pair(row: dict, data_cfg, tokenizer, where: str) -> PairExample:
    """A pair for reward-model training: whole conversations, no loss mask (the score reads the last token)."""
    from tiller.data.sft import IGNORE

    prompt = _require(row, data_cfg.prompt_key, "data.prompt_key", where)
    seqs = []
    for key, name in ((data_cfg.chosen_key, "data.chosen_key"), (data_cfg.rejected_key, "data.rejected_key")):
        text = render_conversation(prompt, completion_text(_require(row, key, name, where), key, where), tokenizer,
                                   data_cfg.apply_chat_template)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
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
    p_ids, c_ids = encode_prompt_response(prompt, text, tokenizer, data_cfg.apply_chat_template, where)
    make_sequence(p_ids, c_ids, data_cfg.max_length, data_cfg.truncation, where)  # length check only
    desirable = _label(_require(row, data_cfg.label_key, "data.label_key", where), data_cfg.label_key, where)
    return UnpairedExample(p_ids, c_ids, desirable)


def load_preference_examples(files: Sequence[str], data_cfg, tokenizer, kind: str = "paired",
                             max_samples: int = -1) -> list:
    """Tokenize every row of `files`: kind "paired" (DPO) or "rm" -> `PairExample`, "unpaired" (KTO) -> `UnpairedExample`."""
    from tiller.data.rl_dataset import read_rows

    encode = {"paired": encode_pair, "rm": encode_rm_pair, "unpaired": encode_unpaired}[kind]
    examples: list = []
    for path in files:
        for i, row in enumerate(read_rows(path)):
            examples.append(encode(row, data_cfg, tokenizer, f"{path} row {i}"))
            if 0 < max_samples <= len(examples):
                return examples
    if not examples:
        raise DataError(f"no training rows in {', '.join(map(str, files)) or '(no files: set data.train_files)'}")
    return examples
