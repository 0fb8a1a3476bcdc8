"""Models: loading Hugging Face causal LMs and the tiny-model kit (`tiller.models.tiny`)."""

import logging

from tiller.models.loading import load_causal_lm, load_tokenizer, resolve_dtype

# peft imports bitsandbytes when it is installed; on an AVX-512-BF16 CPU its CPU backend then logs a warning about the
# optional `kernels` package on every run (used only by the inference repacking tiller turns off: tiller.models.quant)
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

__all__ = ["load_causal_lm", "load_tokenizer", "resolve_dtype"]
