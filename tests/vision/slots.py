"""Image prompts written in Qwen's tokens, rewritten for the model under test (GLM-4.1V's image tokens differ)."""

from tiller.models.vision import image_slot

QWEN_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"


def for_model(proc, text: str) -> str:
    """`text` with each Qwen image slot replaced by the slot of `proc`'s model."""
    return text.replace(QWEN_SLOT, image_slot(proc))
