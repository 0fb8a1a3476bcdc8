"""Tiny vision-language kit: a randomly initialised Qwen2-VL (or Qwen3-VL) saved like a hub checkpoint, for tests
and demos.

`make_tiny_vlm(out)` (also `python -m tiller.models.tiny_vlm --out DIR [--model-type qwen3_vl]`) writes one
directory that `Qwen2VLForConditionalGeneration` / `AutoModelForImageTextToText.from_pretrained` and
`tiller.models.vision.load_processor` (`AutoProcessor` where torchvision is installed) load like
`Qwen/Qwen2-VL-2B-Instruct`:

- the tokenizer of `tiller.models.tiny.train_tokenizer` plus Qwen2-VL's vision special tokens
  (`<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>`, `<|video_pad|>`) and Qwen2-VL's chat template
  (image content parts render as `<|vision_start|><|image_pad|><|vision_end|>`; `{% generation %}` marks
  assistant text for SFT masks);
- the image processor config (`preprocessor_config.json`, Qwen2-VL's processor with `patch_size` 8 rather
  than 14 and `min_pixels = max_pixels = image_size**2`, so every image is resized to about image_size**2 pixels,
  aspect ratio kept, sides multiples of 16: a square image gives (image_size / 8)**2 patches, a quarter of that
  after the 2 x 2 merge; 64 px -> 16 image tokens);
- a `Qwen2VLConfig` (M-RoPE sections sized to the head dim) with a vision tower of `vision_depth` blocks of
  width `vision_dim` and a language model of `hidden_size` x `num_layers`, initialised under `seed`.

Default shape: LM hidden 128 x 4 layers (4 heads of 32, MLP 384), vision 64 x 2 blocks: ~1.0M parameters.

`model_type="qwen3_vl"` writes a Qwen3-VL instead (~1.3M parameters): Qwen3's language model (q / k RMSNorm per
head, 2 kv heads, interleaved M-RoPE), a vision tower with learned position embeddings and deepstack mergers after
both blocks (their features are added to the image tokens after LM layers 0 and 1), and the hub model's patch 16,
so its default `image_size` is 128: the same 16 image tokens per square image as the tiny Qwen2-VL at 64 px.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tiller.models.checkpoint import save_pretrained_atomic
from tiller.models.tiny import ENDOFTEXT, train_tokenizer
from tiller.models.vision import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, VISION_TOKENS

# Qwen2-VL's chat template (ChatML; image / video parts become vision placeholders) with generation markers.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# GLM-4.1V's chat template (`[gMASK]<sop>`, role tokens; image parts become
# `<|begin_of_image|><|image|><|end_of_image|>`), an assistant turn closed by the eos token, with generation markers.
GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|endoftext|>' }}{% endgeneration %}"
    "{% else %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}{{ '<|begin_of_image|><|image|><|end_of_image|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|begin_of_video|><|video|><|end_of_video|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
GLM_VISION_TOKENS = ["<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>",
                     "<|video|>"]
GLM_ROLE_TOKENS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]

PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH = 8, 2, 2
PATCH_SIZES = {"qwen2_vl": PATCH_SIZE, "qwen3_vl": 16, "qwen3_vl_moe": 16, "qwen3_5": 16, "qwen3_5_moe": 16,
               "glm4v": 14, "glm4v_moe": 14}
"""Vision patch size per model type (Qwen3-VL's and Qwen3.5's hub models, MoE ones too, use 16; GLM-4.1V and GLM-4.5V
14)."""
FAMILIES = {"qwen2_vl": "Qwen2-VL", "qwen3_vl": "Qwen3-VL", "qwen3_vl_moe": "Qwen3-VL-MoE", "qwen3_5": "Qwen3.5",
            "qwen3_5_moe": "Qwen3.5-MoE", "glm4v": "GLM-4.1V", "glm4v_moe": "GLM-4.5V"}
GLM = ("glm4v", "glm4v_moe")
"""GLM's vision-language models: GLM's tokens, chat template and image processor."""
MODEL_TYPES = tuple(PATCH_SIZES)
VISION_INIT_STD = 0.1
"""Std of the random vision tower's weight matrices. At transformers' 0.02 the image tokens' features vary
~0.006 across images (text embeddings: 0.02) and a supervised warm-up on the shapes task sat at chance for
600+ steps (lr 2e-3 and 1e-2); at 0.1 (lr 3e-3) its loss starts falling after ~250 steps."""


def vl_tokenizer(corpus=None, vocab_size: int = 512, model_type: str = "qwen2_vl"):
    """`train_tokenizer` plus the vision special tokens and the VL chat template (`glm4v` / `glm4v_moe`: GLM-4.1V's
    vision and role tokens, its template, `<|endoftext|>` as eos as the hub tokenizer's)."""
    tok = train_tokenizer(corpus=corpus, vocab_size=vocab_size)
    if model_type in GLM:
        tok.add_tokens(GLM_VISION_TOKENS + GLM_ROLE_TOKENS, special_tokens=True)
        tok.eos_token = ENDOFTEXT
        tok.chat_template = GLM_CHAT_TEMPLATE
        return tok
    tok.add_tokens(VISION_TOKENS, special_tokens=True)
    tok.chat_template = VL_CHAT_TEMPLATE
    return tok


def image_processor(image_size: int = 64, patch_size: int = PATCH_SIZE, model_type: str = "qwen2_vl"):
    """Qwen2-VL's image processor (PIL backend; Qwen3-VL uses it too; `glm4v`: GLM-4.1V's, whose pixel bounds
    count both temporal frames) resizing every image to about `image_size`**2 pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    step = patch_size * MERGE_SIZE
    if image_size % step:
        raise ValueError(f"image_size must be a multiple of {step}, got {image_size}")
    if model_type in GLM:
        from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

        pixels = TEMPORAL_PATCH * image_size * image_size
        return Glm4vImageProcessorPil(patch_size=patch_size, merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH,
                                      size={"shortest_edge": pixels, "longest_edge": pixels})
    return Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH,
                                    min_pixels=image_size * image_size, max_pixels=image_size * image_size)


def build_vlm_config(tokenizer, hidden_size: int = 128, num_layers: int = 4, vision_dim: int = 64,
                     vision_depth: int = 2, max_position_embeddings: int = 2048, model_type: str = "qwen2_vl"):
    from transformers import Qwen2VLConfig

    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {list(MODEL_TYPES)}, got {model_type!r}")
    if model_type in GLM:
        return _glm4v_config(tokenizer, hidden_size, num_layers, vision_dim, vision_depth, max_position_embeddings,
                             moe=model_type == "glm4v_moe")
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        return _qwen3_5_config(tokenizer, hidden_size, num_layers, vision_dim, vision_depth, max_position_embeddings,
                               moe=model_type == "qwen3_5_moe")
    if model_type in ("qwen3_vl", "qwen3_vl_moe"):
        return _qwen3_vl_config(tokenizer, hidden_size, num_layers, vision_dim, vision_depth, max_position_embeddings,
                                moe=model_type == "qwen3_vl_moe")
    head_dim = 32
    heads = max(1, hidden_size // head_dim)
    half = head_dim // 2  # mrope sections split the head's rotary half into (t, h, w)
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
                num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=3 * hidden_size,
                max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT))
    vision = dict(depth=vision_depth, embed_dim=vision_dim, hidden_size=hidden_size,
                  num_heads=max(1, vision_dim // 32), mlp_ratio=2, patch_size=PATCH_SIZE,
                  spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH)
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                         image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
                         vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)


def _qwen3_vl_config(tokenizer, hidden_size, num_layers, vision_dim, vision_depth, max_position_embeddings,
                     moe: bool = False):
    """A `Qwen3VLConfig`: Qwen3 language model (2 kv heads, interleaved M-RoPE sections sized as the hub model's
    [24, 20, 20] of 64), vision tower with deepstack mergers after its first two blocks. `moe`: a
    `Qwen3VLMoeConfig` (Qwen3-VL-30B-A3B's layout: every layer's MLP a mixture of 4 experts, 2 per token, each expert
    a quarter of the dense MLP, the router load-balancing coefficient of the hub model)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    head_dim = 32
    heads = max(1, hidden_size // head_dim)
    half = head_dim // 2
    section = [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers, head_dim=head_dim,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), intermediate_size=3 * hidden_size,
                max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section,
                                 "mrope_interleaved": True},
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT))
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=3 * hidden_size // 4,
                    decoder_sparse_step=1, router_aux_loss_coef=0.001)
    vision = dict(depth=vision_depth, hidden_size=vision_dim, intermediate_size=2 * vision_dim,
                  num_heads=max(1, vision_dim // 32), patch_size=PATCH_SIZES["qwen3_vl"], spatial_merge_size=MERGE_SIZE,
                  temporal_patch_size=TEMPORAL_PATCH, out_hidden_size=hidden_size, num_position_embeddings=64,
                  deepstack_visual_indexes=list(range(min(2, vision_depth))))
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(text_config=text, vision_config=vision, tie_word_embeddings=True,
                         image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
                         vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END])


def _qwen3_5_config(tokenizer, hidden_size, num_layers, vision_dim, vision_depth, max_position_embeddings,
                    moe: bool = False):
    """A `Qwen3_5Config` (the hub's Qwen3.5 dense line is this vision-language model): a hybrid language model whose
    layers alternate Gated DeltaNet (linear attention with a recurrent state) and gated full attention (the hub's
    3:1 pattern at 2:1 here, so 4 layers hold both kinds twice), interleaved M-RoPE on a quarter of each attention
    head as the hub's (`partial_rotary_factor` 0.25, sections [11, 11, 10] of 32 scaled to [2, 1, 1] of 4), and
    Qwen3-VL's vision tower without deepstack. `moe`: a `qwen3_5_moe` config (Qwen3.5-35B-A3B's layout: every layer's
    MLP a mixture of 4 experts, 2 per token, plus a shared expert, each a quarter of the dense MLP; the hub model's
    router load-balancing coefficient)."""
    from transformers import AutoConfig

    head_dim = 32
    heads = max(1, hidden_size // head_dim)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers, head_dim=head_dim,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), intermediate_size=3 * hidden_size,
                linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads, linear_key_head_dim=head_dim,
                linear_value_head_dim=head_dim, linear_conv_kernel_dim=4,
                layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
                max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True, "partial_rotary_factor": 0.25},
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT))
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=3 * hidden_size // 4,
                    shared_expert_intermediate_size=3 * hidden_size // 4, router_aux_loss_coef=0.001)
    vision = dict(depth=vision_depth, hidden_size=vision_dim, intermediate_size=2 * vision_dim,
                  num_heads=max(1, vision_dim // 32), patch_size=PATCH_SIZES["qwen3_5"], spatial_merge_size=MERGE_SIZE,
                  temporal_patch_size=TEMPORAL_PATCH, out_hidden_size=hidden_size, num_position_embeddings=64)
    return AutoConfig.for_model("qwen3_5_moe" if moe else "qwen3_5", text_config=text, vision_config=vision,
                                tie_word_embeddings=True,
                                image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
                                vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END])


def _glm4v_config(tokenizer, hidden_size, num_layers, vision_dim, vision_depth, max_position_embeddings,
                  moe: bool = False):
    """A `Glm4vConfig` in GLM-4.1V-9B's layout: GLM-4's language model (2 kv heads, q / k / v biases, extra norms after
    attention and MLP, M-RoPE on half of each head with interleaved pairs, sections [8, 12, 12] of 32 scaled to
    [2, 3, 3] of 8), an untied LM head, and its vision tower (learned position embeddings interpolated to each image's
    grid, a 2 x 2 convolution merging patches, patch 14). `moe`: a `Glm4vMoeConfig` in GLM-4.5V's layout, the same
    vision tower before GLM-4.5-Air's language model (no norms after attention or MLP, M-RoPE on half of each head in
    halves, a dense first layer, then 4 routed experts of a third of the width, top-2, sigmoid routing, one shared
    expert)."""
    from transformers import Glm4vConfig, Glm4vMoeConfig

    head_dim = 32
    heads = max(1, hidden_size // head_dim)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GLM_VISION_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), intermediate_size=3 * hidden_size,
                max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "partial_rotary_factor": 0.5},
                pad_token_id=tokenizer.pad_token_id)
    if moe:
        text.update(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size, n_shared_experts=1,
                    first_k_dense_replace=1)
    vision = dict(depth=vision_depth, hidden_size=vision_dim, intermediate_size=2 * hidden_size,
                  num_heads=max(1, vision_dim // 32), patch_size=PATCH_SIZES["glm4v"], image_size=112,
                  spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH, out_hidden_size=hidden_size)
    return (Glm4vMoeConfig if moe else Glm4vConfig)(text_config=text, vision_config=vision, tie_word_embeddings=False,
                       image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
                       image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
                       video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"])


def build_vlm(tokenizer, seed: int = 0, **shape):
    """A randomly initialised `Qwen2VLForConditionalGeneration` (`model_type="qwen3_vl"`:
    `Qwen3VLForConditionalGeneration`); same seed, same weights; caller's RNG kept.
    The vision tower's weight matrices are drawn with std `VISION_INIT_STD` (the language model keeps 0.02)."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    config = build_vlm_config(tokenizer, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
        with torch.no_grad():  # see VISION_INIT_STD
            for p in model.model.visual.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, VISION_INIT_STD)
    eos = tokenizer.eos_token_id
    if config.model_type in GLM:  # the hub model's stops: end of text, or the next user / tool turn
        eos = [eos] + tokenizer.convert_tokens_to_ids(["<|user|>", "<|observation|>"])
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
                                               bos_token_id=getattr(config.text_config, "bos_token_id", None))
    return model.eval()


def make_tiny_vlm(out_dir: str | os.PathLike, seed: int = 0, image_size: int | None = None, corpus=None,
                  vocab_size: int = 512, model_type: str = "qwen2_vl", **shape) -> Path:
    """Tokenizer + image processor config + random Qwen2-VL (or Qwen3-VL), saved atomically to `out_dir`; returns
    the path. `image_size` (default: 64 for Qwen2-VL's patch 8, 128 for Qwen3-VL's patch 16)."""
    tok = vl_tokenizer(corpus=corpus, vocab_size=vocab_size, model_type=model_type)
    model = build_vlm(tok, seed=seed, model_type=model_type, **shape)
    patch = PATCH_SIZES[model_type]
    proc = image_processor(image_size or 64 * patch // PATCH_SIZE, patch_size=patch, model_type=model_type)
    out = Path(out_dir)
    save_pretrained_atomic(out, model, tok, files={"preprocessor_config.json": proc.to_json_string()})
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m tiller.models.tiny_vlm --out DIR [--seed 0 --image-size 64 --model-type qwen2_vl]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tiller.models.tiny_vlm",
                                     description="Build a tiny random-init Qwen2-VL (or Qwen3-VL) + tokenizer + "
                                                 "image processor.")
    parser.add_argument("--out", required=True, help="output directory (Hugging Face format)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=None,
                        help="images are resized to about this squared (default 64; 128 for qwen3_vl / qwen3_vl_moe)")
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="qwen2_vl")
    args = parser.parse_args(argv)
    path = make_tiny_vlm(args.out, seed=args.seed, image_size=args.image_size, model_type=args.model_type)
    print(f"wrote tiny {FAMILIES[args.model_type]} to {path}")
    return 0


if __name__ == "__main__":
    from tiller.entry import run_main

    run_main(main)
