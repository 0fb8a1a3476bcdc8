"""The hf engine on image prompts (Qwen2-VL and Qwen3-VL): greedy equals HF `generate` with the pixels; n samples
share the vision pass."""

import pytest
import torch
from PIL import Image

from tiller.models.loading import load_causal_lm
from tiller.models.vision import encode_image_prompt, load_processor
from tiller.rollout import build_rollout_engine, SamplingParams
from tiller.rollout.hf import vision_token_ids
from tests.vision.slots import for_model

PROMPTS = [("a<|vision_start|><|image_pad|><|vision_end|>how many?", (255, 0, 0)),
           ("<|vision_start|><|image_pad|><|vision_end|>", (0, 90, 255)),
           ("count <|vision_start|><|image_pad|><|vision_end|> now", (20, 200, 20))]


@pytest.fixture(scope="module")
def setup(any_vlm_dir):
    model = load_causal_lm(any_vlm_dir).eval()
    proc = load_processor(any_vlm_dir)
    prompts = [encode_image_prompt(proc, for_model(proc, t), [Image.new("RGB", (64, 48), c)]) for t, c in PROMPTS]
    return model, proc, prompts


def _mm(prompts):
    return [{"pixel_values": p.pixel_values, "image_grid_thw": p.image_grid_thw} for p in prompts]


def test_greedy_equals_hf_generate_per_prompt(setup):
    model, proc, prompts = setup
    engine = build_rollout_engine("hf", model, proc.tokenizer)
    out = engine.generate([p.prompt_ids for p in prompts], SamplingParams(do_sample=False, max_new_tokens=6,
                                                                          ignore_eos=True), multi_modal=_mm(prompts))
    for i, p in enumerate(prompts):
        ids = torch.tensor([p.prompt_ids])
        with torch.no_grad():
            ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=p.pixel_values,
                                 image_grid_thw=p.image_grid_thw,
                                 mm_token_type_ids=(ids == model.config.image_token_id).int(), max_new_tokens=6,
                                 do_sample=False, eos_token_id=[10**9], pad_token_id=0, output_scores=True,
                                 suppress_tokens=vision_token_ids(model),
                                 return_dict_in_generate=True)
        tokens = ref.sequences[0, ids.shape[1]:].tolist()
        ref_lp = torch.stack(ref.scores, 1)[0].log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        assert out.response_ids[i] == tokens
        torch.testing.assert_close(torch.tensor(out.logprobs[i]), ref_lp, atol=1e-5, rtol=0)


def test_the_pixels_reach_the_model(setup):
    model, proc, prompts = setup
    engine = build_rollout_engine("hf", model, proc.tokenizer)
    greedy = SamplingParams(do_sample=False, max_new_tokens=1, ignore_eos=True)
    ids = [prompts[0].prompt_ids]
    red = engine.generate(ids, greedy, multi_modal=_mm(prompts[:1])).logprobs[0]
    other = dict(_mm(prompts[:1])[0], pixel_values=prompts[1].pixel_values)  # same grid, other pixels
    blue = engine.generate(ids, greedy, multi_modal=[other]).logprobs[0]
    assert abs(red[0] - blue[0]) > 1e-6


def test_n_samples_share_the_vision_pass(setup):
    model, proc, prompts = setup
    engine = build_rollout_engine("hf", model, proc.tokenizer)
    seen = []
    handle = model.model.visual.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
    try:
        out = engine.generate([p.prompt_ids for p in prompts], SamplingParams(n=4, max_new_tokens=4, seed=3),
                              multi_modal=_mm(prompts))
    finally:
        handle.remove()
    assert len(out) == 12 and out.prompt_ids[5] == prompts[1].prompt_ids
    vision_ids = set(vision_token_ids(model))
    # Qwen: vision start / end, image and video pads; GLM-4.1V: image and video tokens, begin / end of each
    assert len(vision_ids) == (6 if model.config.model_type in ("glm4v", "glm4v_moe") else 4)
    assert not any(vision_ids & set(r) for r in out.response_ids)
    # one vision pass over the 3 prompts' patches (6 x 8 patches each), not 12 copies
    assert seen == [sum(p.pixel_values.shape[0] for p in prompts)]
    # seeded: the same call gives the same samples
    again = engine.generate([p.prompt_ids for p in prompts], SamplingParams(n=4, max_new_tokens=4, seed=3),
                            multi_modal=_mm(prompts))
    assert again.response_ids == out.response_ids
