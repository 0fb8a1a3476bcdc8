"""verl's chat-template keys: `actor_rollout_ref.model.custom_chat_template` and `data.apply_chat_template_kwargs`.

- `custom_chat_template` (a Jinja string) replaces the chat template of the tokenizer, and of a vision-language
  model's processor, right after they are loaded (`set_chat_template`; verl's `HFModelConfig.__post_init__`).
  Every prompt tiller renders for the run then uses it, and the checkpoints save the tokenizer with it, so a
  trained model served from its checkpoint (or its `tiller export`) renders prompts as it was trained.
- `apply_chat_template_kwargs` (a mapping) goes to every `apply_chat_template` call that renders what the policy
  sees, as extra template variables (e.g. Qwen3's `enable_thinking=False`): the prompt set (so the length
  filter counts the same ids the rollout trains on), validation, the agent endpoint and the tool loop.

`check_chat_template_settings` runs at config validation, before any model or tokenizer is loaded: the template
must compile, and render a one-message conversation with the kwargs (special tokens given as empty strings), and
the kwargs may not name an argument tiller sets itself.
"""

from __future__ import annotations

from typing import Any, Mapping

from tiller.errors import ConfigError

#: `apply_chat_template` arguments tiller sets itself (a kwarg of the same name would clash or change the output
#: type); `chat_template` picks another template: that is custom_chat_template's job.
RESERVED_KWARGS = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                   "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                   "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")


def check_chat_template_settings(template: str | None, kwargs: Any, *, template_key: str, kwargs_key: str) -> None:
    """A `ConfigError` naming the key when `kwargs` is not a mapping of template variables, or `template` is not
    a string that Jinja compiles and renders (with `kwargs`) for a one-message conversation."""
    if not isinstance(kwargs, Mapping):
        raise ConfigError(f"{kwargs_key} must be a mapping of chat-template variables (e.g. "
                          f"+{kwargs_key}.enable_thinking=False), got {type(kwargs).__name__}: {kwargs!r}")
    for name in kwargs:
        if not isinstance(name, str):
            raise ConfigError(f"{kwargs_key}: variable names must be strings, got {name!r}")
        if name in RESERVED_KWARGS:
            use = f"; set {template_key} instead" if name == "chat_template" else ""
            raise ConfigError(f"{kwargs_key}.{name}: tiller sets this argument of apply_chat_template itself{use}")
    if template is None:
        return
    if not isinstance(template, str) or not template.strip():
        raise ConfigError(f"{template_key} must be a non-empty Jinja chat-template string, got {template!r}")
    # import cost: transformers (and Jinja) only when a run sets its own template
    from transformers.utils.chat_template_utils import render_jinja_template

    specials = {name: "" for name in _SPECIAL_TOKENS}
    try:
        render_jinja_template([[{"role": "user", "content": "Hi"}]], chat_template=template,
                              add_generation_prompt=True, **{**specials, **dict(kwargs)})
    except Exception as err:  # noqa: BLE001 - Jinja's errors, or Python's from an expression in the template
        where = f" (line {err.lineno})" if getattr(err, "lineno", None) else ""
        raise ConfigError(f"{template_key}: the chat template does not compile or render{where}: "
                          f"{type(err).__name__}: {err}") from None


def set_chat_template(tokenizer, template: str | None, processor=None) -> None:
    """Replace the chat template of `tokenizer` (and of `processor`, a VLM's, when it keeps its own) with
    `template`; None leaves them as loaded."""
    if template is None:
        return
    tokenizer.chat_template = template
    if processor is not None and processor is not tokenizer and _settable(processor):
        processor.chat_template = template


def _settable(processor) -> bool:
    """Whether `processor.chat_template` is its own attribute (a transformers processor) rather than a read-only
    view of its tokenizer's (`tiller.models.vision.ImageTextProcessor`)."""
    prop = getattr(type(processor), "chat_template", None)
    return not (isinstance(prop, property) and prop.fset is None)
