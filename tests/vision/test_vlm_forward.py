"""Actor forwards on image prompts (Qwen2-VL and Qwen3-VL): logprobs equal a plain HF forward of each row with its
pixels, with and without the shared-prompt forward and across micro-batches; freeze_vision_tower keeps the vision
tower's weights."""

import pytest
import torch
from PIL import Image

from tiller.algos.entropy import logprobs_from_logits
from tiller.models.loading import load_causal_lm
from tiller.models.vision import encode_image_prompt, load_processor
from tiller.rollout.base import left_pad
from tiller.workers.common import response_forward
from tests.vision.slots import for_model

TEXT = "<|vision_start|><|image_pad|><|vision_end|>how many?"


@pytest.fixture(scope="module")
def rows(any_vlm_dir):
    """6 rows: prompts A (red), B (blue: same text, other image), C (other text, wider image), 2 samples each."""
    model = load_causal_lm(any_vlm_dir).eval()
    proc = load_processor(any_vlm_dir)
    text = for_model(proc, TEXT)
    prompts = [encode_image_prompt(proc, text, [Image.new("RGB", (64, 64), (255, 0, 0))]),
               encode_image_prompt(proc, text, [Image.new("RGB", (64, 64), (0, 0, 255))]),
               encode_image_prompt(proc, "say " + text, [Image.new("RGB", (96, 48), (0, 200, 0))])]
    g = torch.Generator().manual_seed(0)
    samples = []
    for p in prompts:
        for length in (3, 5):
            samples.append((p, torch.randint(0, 500, (length,), generator=g).tolist()))
    return model, samples


def _batch(samples):
    P = max(len(p.prompt_ids) for p, _ in samples)
    T = max(len(r) for _, r in samples)
    prompt, pmask = left_pad([p.prompt_ids for p, _ in samples], 0)
    prompt = torch.nn.functional.pad(prompt, (P - prompt.shape[1], 0))
    pmask = torch.nn.functional.pad(pmask, (P - pmask.shape[1], 0))
    resp = torch.zeros(len(samples), T, dtype=torch.long)
    rmask = torch.zeros(len(samples), T, dtype=torch.long)
    for i, (_, r) in enumerate(samples):
        resp[i, :len(r)], rmask[i, :len(r)] = torch.tensor(r), 1
    mm = [{"pixel_values": p.pixel_values, "image_grid_thw": p.image_grid_thw} for p, _ in samples]
    return torch.cat([prompt, resp], 1), torch.cat([pmask, rmask], 1), P, resp, rmask, mm


def _reference(model, p, response):
    """log p(response | prompt, pixels) from one plain forward of the row, no padding."""
    ids = torch.tensor([p.prompt_ids + response])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=p.pixel_values,
                       image_grid_thw=p.image_grid_thw,
                       mm_token_type_ids=(ids == model.config.image_token_id).int()).logits
    return logprobs_from_logits(logits[:, len(p.prompt_ids) - 1:-1], torch.tensor([response]))[0]


@pytest.mark.parametrize("share", [False, True])
def test_logprobs_equal_a_plain_forward_with_the_pixels(rows, share):
    model, samples = rows
    ids, mask, P, resp, rmask, mm = _batch(samples)
    with torch.no_grad():
        logits, t = response_forward(model, ids, mask, P, rmask, share_prompts=share, logits_to_keep=True,
                                     multi_modal=mm)
    logp = logprobs_from_logits(logits, resp[:, :t])
    for i, (p, r) in enumerate(samples):
        torch.testing.assert_close(logp[i, :len(r)], _reference(model, p, r), atol=2e-5, rtol=0)
    # micro-batches of 2 rows give the same numbers
    parts = []
    for rows in torch.arange(len(samples)).split(2):
        with torch.no_grad():
            lg, tt = response_forward(model, ids[rows], mask[rows], P, rmask[rows], share_prompts=share,
                                      multi_modal=[mm[i] for i in rows.tolist()])
        parts.append(torch.nn.functional.pad(logprobs_from_logits(lg, resp[rows, :tt]), (0, t - tt)))
    torch.testing.assert_close(torch.cat(parts) * rmask[:, :t], logp * rmask[:, :t], atol=2e-5, rtol=0)


def test_shared_prompt_forward_keeps_images_apart(rows):
    """A and B have the same prompt tokens: sharing them by tokens alone would give B the red image."""
    model, samples = rows
    ids, mask, P, resp, rmask, mm = _batch(samples)
    with torch.no_grad():
        logits, t = response_forward(model, ids, mask, P, rmask, share_prompts=True, multi_modal=mm)
    assert torch.equal(ids[0, :P], ids[2, :P])
    assert not torch.allclose(logits[0, 0], logits[2, 0])
