"""Tiny-VLM kit: a Qwen2-VL (and a Qwen3-VL) saved like a hub checkpoint, loaded back by transformers' own classes;
image prompts."""

import io

import pytest
import torch
from PIL import Image

from tiller.errors import DataError
from tiller.models import load_causal_lm
from tests.vision.slots import for_model
from tiller.models.vision import (
    IMAGE_PAD, encode_image_prompt, image_token, is_vision_model, load_processor, mrope_position_ids,
    split_placeholders, to_pil,
)


def _png(color=(255, 0, 0), size=(64, 64)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_tiny_vlm_loads_like_a_hub_model(any_vlm_dir):
    from transformers import AutoModelForImageTextToText
    from transformers import (Glm4vForConditionalGeneration, Glm4vMoeForConditionalGeneration,
                              Qwen2VLForConditionalGeneration,
                              Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration,
                              Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration)

    model = AutoModelForImageTextToText.from_pretrained(any_vlm_dir)
    cls = {"qwen3_vl": Qwen3VLForConditionalGeneration, "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration,
           "qwen3_5": Qwen3_5ForConditionalGeneration, "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration,
           "glm4v": Glm4vForConditionalGeneration, "glm4v_moe": Glm4vMoeForConditionalGeneration}.get(model.config.model_type, Qwen2VLForConditionalGeneration)
    assert isinstance(model, cls) and is_vision_model(model)
    assert sum(p.numel() for p in model.parameters()) <= 2_000_000
    assert type(load_causal_lm(any_vlm_dir)) is cls
    proc = load_processor(any_vlm_dir)
    assert proc.tokenizer.convert_tokens_to_ids(image_token(proc)) == model.config.image_token_id
    assert proc.image_processor.patch_size == model.config.vision_config.patch_size
    if cls in (Glm4vForConditionalGeneration, Glm4vMoeForConditionalGeneration):
        # GLM-4.1V-9B's / GLM-4.5V's layout: patch 14, M-RoPE on half a head, untied head
        assert image_token(proc) == "<|image|>" and model.config.vision_config.patch_size == 14
        assert model.config.text_config.rope_parameters["partial_rotary_factor"] == 0.5
        assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
        assert proc.apply_chat_template(turn, add_generation_prompt=True, tokenize=False) == \
            "[gMASK]<sop><|user|>\n<|begin_of_image|><|image|><|end_of_image|>hi<|assistant|>\n"
        if cls is Glm4vMoeForConditionalGeneration:  # GLM-4.5-Air's language model: a dense first layer, then experts
            assert [type(layer.mlp).__name__ for layer in model.model.language_model.layers] == \
                ["Glm4vMoeTextMLP"] + ["Glm4vMoeTextMoE"] * 3
        return
    if cls is not Qwen2VLForConditionalGeneration:  # the hub model's patch, deepstack features into LM layers 0, 1
        assert model.config.vision_config.patch_size == 16
        assert model.config.text_config.rope_parameters["mrope_interleaved"] is True
    if cls in (Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration):
        assert model.config.vision_config.deepstack_visual_indexes == [0, 1]
    if cls in (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration):  # Gated DeltaNet + attention
        text = model.config.text_config
        assert text.layer_types == ["linear_attention", "full_attention"] * 2
        assert text.rope_parameters["partial_rotary_factor"] == 0.25
    if cls is Qwen3VLMoeForConditionalGeneration:  # Qwen3-VL-30B-A3B's layout: every layer's MLP a mixture
        text = model.config.text_config
        assert (text.num_experts, text.num_experts_per_tok, text.decoder_sparse_step) == (4, 2, 1)
        assert all(type(layer.mlp).__name__ == "Qwen3VLMoeTextSparseMoeBlock"
                   for layer in model.model.language_model.layers)


def test_image_prompt_expands_placeholders_per_merged_patch(any_vlm_dir):
    proc = load_processor(any_vlm_dir)
    patch = proc.image_processor.patch_size
    msgs = split_placeholders([{"role": "user", "content": "<image>count <image>"}], 2, "row 0")
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.count(image_token(proc)) == 2
    ip = encode_image_prompt(proc, text, [to_pil(_png()), to_pil({"bytes": _png(size=(64, 64))})])
    pad = proc.tokenizer.convert_tokens_to_ids(image_token(proc))
    # 64x64 px at patch 8 -> 8x8 patches -> 16 tokens after the 2x2 merge, each image (min = max pixels = 64**2);
    # Qwen3-VL: resized to 128x128 px (min = max pixels = 128**2), patch 16 -> the same grid; GLM-4.1V: 112x112 px,
    # patch 14
    assert ip.image_grid_thw.tolist() == [[1, 8, 8], [1, 8, 8]]
    assert ip.prompt_ids.count(pad) == 32
    assert ip.pixel_values.shape == (128, 3 * 2 * patch * patch)


def test_official_processor_gives_the_same_ids(tiny_vlm_dir):
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    from tiller.models.vision import ImageTextProcessor

    full, ours = AutoProcessor.from_pretrained(tiny_vlm_dir), load_processor(tiny_vlm_dir)
    ours = ImageTextProcessor(full.image_processor, full.tokenizer)
    text = "<|vision_start|><|image_pad|><|vision_end|>hi"
    a = encode_image_prompt(full, text, [to_pil(_png())])
    b = encode_image_prompt(ours, text, [to_pil(_png())])
    assert a.prompt_ids == b.prompt_ids and torch.equal(a.pixel_values, b.pixel_values)


def test_mrope_positions_follow_the_grid_and_left_padding(any_vlm_dir):
    model = load_causal_lm(any_vlm_dir)
    proc = load_processor(any_vlm_dir)
    ip = encode_image_prompt(proc, for_model(proc, "a<|vision_start|><|image_pad|><|vision_end|>b"),
                             [to_pil(_png(size=(64, 64)))])
    n = len(ip.prompt_ids)
    ids = torch.tensor([[0, 0] + ip.prompt_ids])
    mask = torch.tensor([[0, 0] + [1] * n])
    pos = mrope_position_ids(model, ids, mask, ip.image_grid_thw)
    # "a", vision_start at 0, 1; the 4x4 merged grid starts at 2: t = 2, h = 2..5, w = 2..5; vision_end at 6
    assert pos[:, 0, :4].tolist() == [[0, 0, 0, 1]] * 3
    grid = pos[:, 0, 4:20]
    assert grid[0].tolist() == [2] * 16
    assert grid[1].tolist() == [2 + i // 4 for i in range(16)] and grid[2].tolist() == [2 + i % 4 for i in range(16)]
    assert pos[:, 0, 20].tolist() == [6, 6, 6]


@pytest.mark.parametrize("image, message", [
    (b"not an image", "unreadable image"),
    ({"path": "/nonexistent/x.png"}, "image file not found"),
    ({"neither": 1}, "image entry has neither 'bytes' nor 'path'"),
])
def test_bad_images_name_the_row(image, message):
    with pytest.raises(DataError, match=f"train.parquet row 3: {message}"):
        to_pil(image, "train.parquet row 3")


def test_placeholder_count_must_match_images():
    with pytest.raises(DataError, match=r"row 7: the prompt has 1 image placeholder\(s\).*but the row has 2"):
        split_placeholders([{"role": "user", "content": "<image> how many?"}], 2, "f.parquet row 7")
