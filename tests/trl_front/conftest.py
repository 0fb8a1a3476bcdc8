"""Fixtures of the TRL front-end tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def trl_processor(tiny_vlm_dir, monkeypatch):
    """transformers' real Qwen2VLProcessor of the tiny VLM, built without its video processor (which needs
    torchvision, absent on this CPU stack): no video reaches it."""
    import transformers.processing_utils as pu
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.qwen2_vl import Qwen2VLProcessor

    check = pu.ProcessorMixin.check_argument_for_proper_class
    monkeypatch.setattr(pu.ProcessorMixin, "check_argument_for_proper_class",
                        lambda self, name, arg: None if name == "video_processor" and arg is None
                        else check(self, name, arg))
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm_dir)
    return Qwen2VLProcessor(image_processor=AutoImageProcessor.from_pretrained(tiny_vlm_dir), tokenizer=tokenizer,
                            video_processor=None, chat_template=tokenizer.chat_template)
