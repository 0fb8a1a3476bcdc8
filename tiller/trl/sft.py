"""TRL's `SFTConfig` / `SFTTrainer` on `tiller sft` (`tiller.trainer.sft.train_sft`).

TRL's dataset formats become rows of tiller's SFT formats (`tiller.data.sft`), written to `<output_dir>/data/`:

- `text` (dataset_text_field) or formatting_func -> text format: loss on every token (+ eos appended);
- `messages` (or ShareGPT `conversations`) -> messages format: every token (assistant_only_loss: the assistant
  turns);
- `prompt` + `completion` strings -> prompt_response without a chat template: the completion + eos
  (completion_only_loss None / True); completion_only_loss=False -> text = prompt + completion: every token;
- conversational `prompt` + `completion` -> prompt_response with the prompt messages: the completion's text + eos;
  completion_only_loss=False -> messages = prompt + completion: every token.

Deviations (tiller's SFT, shared with `tiller sft`): a prompt and its completion are tokenized separately, so the
completion starts on a token boundary (what the policy generates); TRL tokenizes the joined text and splits where
the ids diverge: the same tokens whenever the prompt ends on a token boundary (a chat template's generation prompt
always does). A conversational completion's loss covers the assistant's text and the eos token that ends its turn,
not the template's text after it (ChatML's newline). TRL drops rows left without a loss token by truncation;
tiller stops naming the row. With packing, a batch is per_device_train_batch_size sequences (TRL: packed rows).

Images (an `images` / `image` column with a `messages` column, a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model): the
messages as TRL's `prepare_multimodal_messages` makes them (`tiller.trl.images`), the images' bytes in parquet,
trained by tiller's image SFT (`tiller.data.sft_vision`): the same token ids as TRL's vision collator, the loss on
every token (image tokens included) or, with assistant_only_loss, on the assistant turns. An image conversation
over max_length is an error (TRL cuts it). Prompt-completion and text rows with images are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from tiller.errors import ConfigError, DataError
from tiller.trl.fields import FIELDS
from tiller.trl.common import field_table, make_config_class, mapped, noop, refuse_value, refused
from tiller.trl.jobs import JobTrainer, write_data
from tiller.models.loading import VISION_FAMILIES, is_vision_checkpoint
from tiller.trl.images import image_column, image_entry, multimodal_row, row_images

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                   "tool": "tool"}
_HUGE = 1 << 30  # max_length=None: no truncation (tiller's data.max_length is a number)


def _max_length(value: Any, args: Any) -> dict:
    if value is None:
        if getattr(args, "packing", False):
            raise refuse_value("max_length", None, "packing needs max_length (the packed row length), as in TRL")
        return {"data.max_length": _HUGE, "data.truncation": "error"}
    if not isinstance(value, int) or value <= 0:
        raise refuse_value("max_length", value, "a positive number of tokens (or None)")
    return {"data.max_length": value}


def truncation(value: Any, args: Any) -> dict:
    if value not in ("keep_start", "keep_end"):
        raise refuse_value("truncation_mode", value, "keep_start | keep_end")
    if args.max_length is None:
        return {}
    return {"data.truncation": "right" if value == "keep_start" else "left"}


def _packing(value: Any, args: Any) -> dict:
    if not value:
        return {"data.packing": False}
    if args.packing_strategy != "bfd":
        raise refuse_value("packing_strategy", args.packing_strategy, "tiller packs whole sequences into rows of "
                           "max_length tokens, positions restarting per sequence (TRL's bfd); 'wrapped' (sequences "
                           "cut across rows) is not available")
    return {"data.packing": True, "data.pack_length": args.max_length}


def _loss_type(value: Any, args: Any) -> dict:
    if value not in ("nll", "dft"):
        raise refuse_value("loss_type", value, "nll | dft")
    return {"algorithm.loss": value}


def _label_smoothing(value: Any, args: Any) -> dict:
    if value and args.loss_type != "nll":
        raise refuse_value("label_smoothing_factor", value, "TRL's SFTTrainer smooths the nll loss only (loss_type "
                           "nll); with dft it is not applied")
    return {"algorithm.label_smoothing": float(value)} if value else {}


def chat_template(value: Any, args: Any) -> dict:
    """chat_template_path: a Jinja file, or a tokenizer dir whose chat template is used (as TRL)."""
    if value is None:
        return {}
    path = Path(value).expanduser()
    if path.is_file():
        return {"model.custom_chat_template": path.read_text(encoding="utf-8")}
    if path.is_dir():
        from transformers import AutoTokenizer

        template = AutoTokenizer.from_pretrained(path).chat_template
        if not template:
            raise refuse_value("chat_template_path", value, "the tokenizer there has no chat template")
        return {"model.custom_chat_template": template}
    raise refuse_value("chat_template_path", value, "not a local Jinja file or tokenizer dir")


COMMON_MODEL_RULES = {
    "dataset_num_proc": noop("tiller tokenizes the rows once, in this process"),
    "activation_offloading": noop("tiller keeps activations on the device (gradient_checkpointing saves memory)"),
    "pad_token": noop("tiller pads with the tokenizer's pad token and masks padding out of the loss"),
    "router_aux_loss_coef": mapped("model.router_aux_loss_coef (None: a mixture-of-experts model's config "
                                   "router_aux_loss_coef, as TRL; a dense model: off)",
                                   lambda v, a: {"_router_aux": v}),
    "max_length": mapped("data.max_length (None: no truncation)", _max_length),
}

SFT_RULES = {
    **COMMON_MODEL_RULES,
    "chat_template_path": mapped("model.custom_chat_template (a Jinja file's text, or a tokenizer dir's template)",
                                 chat_template),
    "dataset_text_field": mapped("the text column read (a language-modeling row; tiller's data.format=text)",
                                 lambda v, a: {}),
    "dataset_kwargs": refused("tiller prepares the dataset itself (give raw rows, not skip_prepare_dataset)"),
    "eos_token": mapped("the tokenizer's eos token (saved with the run's tokenizer; appended to text and "
                        "completions)", lambda v, a: {"_eos_token": v} if v is not None else {}),
    "truncation_mode": mapped("data.truncation: keep_start -> right, keep_end -> left", truncation),
    "shuffle_dataset": noop("tiller shuffles every epoch (seeded); packing is deterministic (longest first)"),
    "packing": mapped("data.packing + data.pack_length = max_length (whole sequences per row, positions "
                      "restarting: TRL's bfd)", _packing),
    "packing_strategy": mapped("bfd (read with packing); wrapped refused", lambda v, a: {}),
    "padding_free": noop("tiller pads micro-batches (or packs them with packing=True): the loss is the same"),
    "eval_packing": noop("validation uses the training rows' layout; packing does not change the loss"),
    "completion_only_loss": mapped("prompt-completion rows: loss on the completion (None / True) or on every token "
                                   "(False)", lambda v, a: {}),
    "assistant_only_loss": mapped("data.assistant_only_loss (conversations: loss on the assistant turns only)",
                                  lambda v, a: {"data.assistant_only_loss": bool(v)}),
    "use_liger_kernel": mapped("model.use_liger (the LM head run with the log-probs of the completion tokens, chunk "
                               "by chunk: the logits never whole, what Liger's fused linear cross-entropy saves)",
                               lambda v, a: {"model.use_liger": bool(v)}),
    "loss_type": mapped("algorithm.loss: nll | dft", _loss_type),
    "label_smoothing_factor": mapped("algorithm.label_smoothing (transformers' LabelSmoother, which TRL's SFTTrainer "
                                     "applies with loss_type nll; with dft refused)", _label_smoothing),
}

SFT_RULES = {k: v for k, v in SFT_RULES.items() if k in FIELDS["SFTConfig"]}  # this class's fields only
SFTConfig = make_config_class("SFTConfig", SFT_RULES)


# ------------------------------------------------------------------------------------------------ data


def _messages(value: Any) -> list[dict] | None:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        return [dict(m) for m in value]
    return None


def sharegpt_to_messages(conversation: Any, where: str) -> list[dict]:
    """TRL's `maybe_convert_to_chatml`: [{"from": "human", "value": ...}] -> [{"role": "user", "content": ...}]."""
    turns = _messages(conversation)
    if turns is None:
        raise DataError(f"{where}: conversations must be a list of {{'from', 'value'}} turns")
    out = []
    for turn in turns:
        if "role" in turn:
            out.append({"role": turn["role"], "content": turn.get("content")})
            continue
        role = _SHAREGPT_ROLES.get(str(turn.get("from")))
        if role is None:
            raise DataError(f"{where}: conversation role {turn.get('from')!r} is not one of {sorted(_SHAREGPT_ROLES)}")
        out.append({"role": role, "content": turn.get("value")})
    return out


def _completion_text(value: Any, where: str) -> str:
    turns = _messages(value)
    if turns is None or len(turns) != 1 or turns[0].get("role") != "assistant":
        raise DataError(f"{where}: a conversational completion must be one assistant message (tiller learns one "
                        "assistant turn after the prompt); put earlier turns in the prompt")
    return turns[0]["content"]


def sft_rows(rows: list[dict], args: Any, where: str,
             formatting_func: Callable[[dict], str] | None = None) -> tuple[list[dict], dict[str, Any]]:
    """TRL SFT rows -> (tiller SFT rows, data keys); the format is read from the first row, as TRL does."""
    if formatting_func is not None:
        if image_column(rows) is not None:
            raise ConfigError(f"formatting_func with an {image_column(rows)!r} column in {where}: refused: TRL's "
                              "vision collator reads the 'messages' column and never calls formatting_func")
        if args.completion_only_loss:
            raise ConfigError("formatting_func with completion_only_loss=True: refused, as in TRL (a formatted text "
                              "has no completion to mask)")
        return [{"text": _text(formatting_func(row), f"{where} row {i}: formatting_func")} for i, row in
                enumerate(rows)], {"data.format": "text", "data.text_key": "text", "data.add_special_tokens": True}
    first = rows[0]
    if image_column(rows) is not None:
        return _image_rows(rows, where)
    if "input_ids" in first:
        raise DataError(f"{where}: pre-tokenized rows (input_ids) are not read by tiller: give the text columns")
    if "messages" in first or "conversations" in first:
        key = "messages" if "messages" in first else "conversations"
        out = [{"messages": sharegpt_to_messages(_column(row, key, where, i), f"{where} row {i}")}
               for i, row in enumerate(rows)]
        return out, {"data.format": "messages", "data.messages_key": "messages"}
    if "prompt" in first and "completion" in first:
        return _prompt_completion(rows, args, where)
    field = args.dataset_text_field
    if field in first:
        return ([{"text": _text(_column(row, field, where, i), f"{where} row {i}")} for i, row in enumerate(rows)],
                {"data.format": "text", "data.text_key": "text", "data.add_special_tokens": True})
    raise DataError(f"{where}: columns {sorted(first)}: TRL's SFT formats are {field!r} (dataset_text_field), "
                    "'messages', or 'prompt' + 'completion'")


def _image_rows(rows: list[dict], where: str) -> tuple[list[dict], dict[str, Any]]:
    """Image conversations (TRL's vision collator): `messages` through TRL's `prepare_multimodal_messages` (the
    images' parts in front of the first user text unless the parts are given), the images as verl's `{"bytes"}`
    entries in the order of their parts (written as parquet); tiller's image SFT (`tiller.data.sft_vision`)."""
    column = image_column(rows)
    if "messages" not in rows[0]:
        raise DataError(f"{where}: an {column!r} column with columns {sorted(rows[0])}: image SFT takes a 'messages' "
                        "column (TRL's vision collator for prompt-completion or text rows is not mapped)")
    out = []
    for i, row in enumerate(rows):
        at = f"{where} row {i}"
        messages = _messages(_column(row, "messages", where, i))
        if messages is None:
            raise DataError(f"{at}: messages must be a non-empty list of {{'role', 'content'}} dicts")
        plain, _, images = multimodal_row(messages, row_images(row, column), at)
        out.append({"messages": plain, "images": [image_entry(img, f"{at} {column}") for img in images]})
    return out, {"data.format": "messages", "data.messages_key": "messages", "data.image_key": "images"}


def _column(row: dict, key: str, where: str, i: int) -> Any:
    if key not in row:
        raise DataError(f"{where} row {i}: no {key!r} column (columns: {', '.join(sorted(row))})")
    return row[key]


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: the text must be a string, got {type(value).__name__}")
    return value


def _prompt_completion(rows: list[dict], args: Any, where: str) -> tuple[list[dict], dict[str, Any]]:
    completion_only = args.completion_only_loss is not False  # None: True for prompt-completion rows
    conversational = _messages(rows[0]["prompt"]) is not None
    out = []
    for i, row in enumerate(rows):
        at = f"{where} row {i}"
        prompt, completion = _column(row, "prompt", where, i), _column(row, "completion", where, i)
        if conversational:
            messages = _messages(prompt)
            if messages is None:
                raise DataError(f"{at}: prompt must be a list of messages like the first row's")
            text = _completion_text(completion, at)
            out.append({"prompt": messages, "response": text} if completion_only else
                       {"messages": messages + [{"role": "assistant", "content": text}]})
        else:
            p, c = _text(prompt, at + ": prompt"), _text(completion, at + ": completion")
            out.append({"prompt": p, "response": c} if completion_only else {"text": p + c})
    if conversational:
        keys = ({"data.format": "prompt_response", "data.apply_chat_template": True} if completion_only else
                {"data.format": "messages", "data.messages_key": "messages"})
    else:
        keys = ({"data.format": "prompt_response", "data.apply_chat_template": False} if completion_only else
                {"data.format": "text", "data.text_key": "text"})
        keys["data.add_special_tokens"] = True  # standard rows: TRL's tokenizer call adds them (e.g. Llama's BOS)
    if completion_only:
        keys.update({"data.prompt_key": "prompt", "data.response_key": "response"})
    return out, keys


# --------------------------------------------------------------------------------------------- trainer


class SFTTrainer(JobTrainer):
    """TRL's SFTTrainer: `SFTTrainer(model, args=SFTConfig(...), train_dataset=..., eval_dataset=None,
    processing_class=None, peft_config=None, formatting_func=None)`; `train()`, `evaluate()`, `save_model()`,
    `state.log_history`. Runs `tiller sft` (see the module docstring)."""

    config_class = SFTConfig

    def __init__(self, model: Any, args: Any = None, data_collator: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, compute_loss_func: Any = None,
                 compute_metrics: Any = None, callbacks: Any = None, optimizers: Any = (None, None),
                 optimizer_cls_and_kwargs: Any = None, preprocess_logits_for_metrics: Any = None,
                 quantization_config: Any = None, peft_config: Any = None,
                 formatting_func: Callable[[dict], str] | None = None):
        # import cost: the config stack loads only when a run starts
        from tiller.config.jobs import SFTConfig as JobConfig
        # import cost: only the chosen job's trainer
        from tiller.trainer.sft import train_sft

        type(self).job_schema, type(self).entry = JobConfig, staticmethod(train_sft)
        self.formatting_func = formatting_func
        self._set_up_job(model, args, train_dataset, eval_dataset, processing_class, peft_config,
                         data_collator=data_collator, compute_loss_func=compute_loss_func,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                         optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                         quantization_config=quantization_config)
        for where, rows in (("train_dataset", self.train_rows), ("eval_dataset", self.eval_rows)):
            column = image_column(rows) if rows else None
            if column is not None and not is_vision_checkpoint(self.model_path):
                raise ConfigError(f"{where}: an {column!r} column (image conversations) but model "
                                  f"{self.model_path!r} is not a vision-language model tiller trains "
                                  f"({VISION_FAMILIES}); drop the column or use such a model")

    def _data(self, private: dict[str, Any]) -> dict[str, Any]:
        rows, keys = sft_rows(self.train_rows, self.args, "train_dataset", self.formatting_func)
        suffix = ".parquet" if "data.image_key" in keys else ".jsonl"  # image bytes: parquet
        keys["data.train_files"] = [write_data(self.run_dir, "train", rows, suffix)]
        if self.eval_rows is not None:
            val, val_keys = sft_rows(self.eval_rows, self.args, "eval_dataset", self.formatting_func)
            if val_keys != {k: v for k, v in keys.items() if k != "data.train_files"}:
                raise DataError("eval_dataset: its format differs from train_dataset's (tiller reads both alike)")
            keys["data.val_files"] = [write_data(self.run_dir, "eval", val, suffix)]
        if "_eos_token" in private:
            keys["model.tokenizer_path"] = self.tokenizer_with_eos(private["_eos_token"])
        return keys


def sft_field_table() -> str:
    """The markdown table of SFTConfig's fields (docs/trl.md)."""
    return field_table("SFTConfig", SFTConfig.RULES)
