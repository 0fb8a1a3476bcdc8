"""Models: loading Hugging Face causal LMs and the tiny-model kit (`tiller.models.tiny`)."""

from tiller.models.loading import load_causal_lm, load_tokenizer, resolve_dtype

__all__ = ["load_causal_lm", "load_tokenizer", "resolve_dtype"]
