"""SFT on image conversations through tiller.trl on the tiny Qwen2-VL: the token ids, pixels and loss tokens of
tiller's image SFT equal TRL's own `DataCollatorForVisionLanguageModeling` with the real `Qwen2VLProcessor` (where
TRL is installed), a step trains, and what does not map is refused."""

from __future__ import annotations

import math

import pytest
import torch

from tiller.errors import ConfigError, DataError
from tiller.trl import SFTConfig, SFTTrainer

COLOURS = [(255, 0, 0), (0, 160, 0), (0, 0, 255)]


def _image(i: int, size: int = 64):
    from PIL import Image

    return Image.new("RGB", (size, size), COLOURS[i % len(COLOURS)])


def _rows():
    """TRL's layouts: string contents (the image parts go in front of the first user text) and parts given."""
    return [
        {"messages": [{"role": "user", "content": "What colour is it?"}, {"role": "assistant", "content": "red"},
                      {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "yes"}],
         "images": [_image(0)]},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                                   {"type": "text", "text": " and "}, {"type": "image"}]},
                      {"role": "assistant", "content": "green, blue"}],
         "images": [_image(1), _image(2)]},
    ]


def _args(run_dir, **kw):
    base = dict(output_dir=str(run_dir), per_device_train_batch_size=2, max_steps=1, learning_rate=1e-3,
                bf16=False, report_to="none", save_strategy="no")
    return SFTConfig(**{**base, **kw})


def _tiller_examples(trainer):
    from tiller.config import load_config
    from tiller.config.jobs import SFTConfig as JobConfig, validate_job
    from tiller.data.sft import load_sft_examples
    from tiller.models.loading import load_tokenizer
    from tiller.models.vision import load_processor
    from tiller.trl.common import overrides

    cfg = load_config(overrides(trainer.tiller_keys()), schema=JobConfig, validate=validate_job)
    tokenizer = load_tokenizer(cfg.model.partial_pretrain)
    processor = load_processor(cfg.model.partial_pretrain, tokenizer=tokenizer)
    return load_sft_examples(cfg.data.train_files, cfg.data, tokenizer, processor=processor)


@pytest.mark.parametrize("assistant_only_loss", [False, True])
def test_ids_pixels_and_loss_tokens_equal_trls_vision_collator(tmp_path, tiny_vlm_dir, trl_processor,
                                                               assistant_only_loss):
    pytest.importorskip("trl")
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    trainer = SFTTrainer(model=str(tiny_vlm_dir), args=_args(tmp_path / "run", assistant_only_loss=assistant_only_loss),
                         train_dataset=_rows())
    ours = _tiller_examples(trainer)
    collator = DataCollatorForVisionLanguageModeling(trl_processor, max_length=None,
                                                     assistant_only_loss=assistant_only_loss)
    for example, row in zip(ours, _rows()):
        want = collator([row])  # one row: no padding
        assert example.input_ids == want["input_ids"][0].tolist()
        assert torch.equal(example.multi_modal["pixel_values"], want["pixel_values"])
        assert torch.equal(example.multi_modal["image_grid_thw"], want["image_grid_thw"])
        # TRL's labels sit on the token itself, tiller's on the position before it (the next-token target)
        assert example.labels == want["labels"][0].tolist()[1:] + [-100]
    loss_tokens = [sum(t != -100 for t in e.labels) for e in ours]
    if assistant_only_loss:
        assert loss_tokens[0] < 10  # "red<|im_end|>" and "yes<|im_end|>": no image token
    else:
        assert loss_tokens[1] > 2 * 16  # the two images' 16 tokens each are targets too, as in TRL


def test_an_image_sft_step_trains(tmp_path, tiny_vlm_dir):
    trainer = SFTTrainer(model=str(tiny_vlm_dir), args=_args(tmp_path / "run", assistant_only_loss=True),
                         train_dataset=_rows())
    trainer.train()
    keys = trainer.tiller_keys()
    assert keys["data.image_key"] == "images" and keys["data.train_files"][0].endswith("data/train.parquet")
    assert trainer.state.global_step == 1 and math.isfinite(trainer.state.log_history[-1]["loss"])
    from transformers import AutoModelForImageTextToText

    trainer.save_model()
    saved = AutoModelForImageTextToText.from_pretrained(tmp_path / "run")
    start = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
    assert any(not torch.equal(a, b) for a, b in zip(saved.state_dict().values(), start.state_dict().values()))


def test_image_sft_refusals(tmp_path, tiny_model_dir, tiny_vlm_dir):
    with pytest.raises(ConfigError, match="train_dataset: an 'images' column .* not a vision-language model"):
        SFTTrainer(model=str(tiny_model_dir), args=_args(tmp_path / "a"), train_dataset=_rows())
    pairs = [{"prompt": [{"role": "user", "content": "Colour?"}],
              "completion": [{"role": "assistant", "content": "red"}], "image": _image(0)}]
    with pytest.raises(DataError, match="train_dataset: an 'image' column .* image SFT takes a 'messages' column"):
        SFTTrainer(model=str(tiny_vlm_dir), args=_args(tmp_path / "b"), train_dataset=pairs).tiller_keys()
    with pytest.raises(ConfigError, match="formatting_func with an 'images' column"):
        SFTTrainer(model=str(tiny_vlm_dir), args=_args(tmp_path / "c"), train_dataset=_rows(),
                   formatting_func=lambda row: "x").tiller_keys()
