"""tiller's engines on models whose layers are not all full attention (`tiller.models.layer_masks`): sliding windows
(Mistral, gpt-oss, Gemma 2) and recurrent layers (Qwen3.5's Gated DeltaNet, LFM2, Granite 4's Mamba 2, Falcon-H1).

The native engine and the continuous batcher build their masks and caches themselves, so each family is checked
against an independent reference: the logprob of every sampled token equals a teacher-forced forward of that row
alone (transformers' own masks, no cache). Every row crosses the 6-token window, with rows of several lengths,
n samples per prompt (a prefill shared by n rows) and finished rows compacted away. One mask for every layer (what
the engine did before) is off by 0.2-1.1 nats on the sliding families; before the recurrent state slots, the
engine failed on the recurrent ones (`KVBuffer` has no `get_conv_state`)."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.layer_kinds import RECURRENT, SLIDING, WINDOW, attn_of
from tiller.errors import UserError
from tiller.rollout.base import SamplingParams
from tiller.rollout.native import NativeRolloutEngine

TEXTS = ["1+2=", "hello there you are a fine one", "7", "what is 12+34? the answer is"]
# fp32: sliding families agree to ~1e-6; Gated DeltaNet's chunked (teacher-forced) and recurrent (one token) forms
# of the same recurrence differ by up to ~1e-4 in summation order
TOL = 5e-4


def _load(path, model_type):
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_of(model_type))
    return model.eval(), tok


def _worst_gap(model, outputs) -> float:
    worst = 0.0
    with torch.no_grad():
        for out in outputs:
            for p, r, lp in zip(out.prompt_ids, out.response_ids, out.logprobs):
                logits = model(input_ids=torch.tensor([list(p) + list(r)])).logits[0, len(p) - 1: -1].float()
                ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
                worst = max(worst, (ref - torch.tensor(lp)).abs().max().item())
    return worst


@pytest.mark.parametrize("model_type", [*SLIDING, *RECURRENT])
def test_native_engine_logprobs_equal_a_teacher_forced_forward(layer_kind_dir, model_type):
    model, tok = _load(layer_kind_dir(model_type), model_type)
    engine = NativeRolloutEngine(model, tok, compact_fraction=0.2)
    out = engine.generate([tok(t)["input_ids"] for t in TEXTS], SamplingParams(n=3, max_new_tokens=16, seed=3))
    assert max(len(p) + len(r) for p, r in zip(out.prompt_ids, out.response_ids)) > 3 * WINDOW
    assert _worst_gap(model, [out]) < TOL


@pytest.mark.parametrize("model_type", ["mistral", "gpt_oss", "qwen3_5_text", "falcon_h1"])
def test_continuous_batcher_logprobs_equal_a_teacher_forced_forward(layer_kind_dir, model_type):
    """Requests of several lengths join a running batch and leave it (their slots, recurrent states included, move
    to keep live rows in front)."""
    from tiller.rollout.continuous import ContinuousBatcher

    model, tok = _load(layer_kind_dir(model_type), model_type)
    batcher = ContinuousBatcher(NativeRolloutEngine(model, tok), max_rows=8)
    try:
        futures = []
        for i, text in enumerate(TEXTS):
            futures.append(batcher.submit([tok(text)["input_ids"]], SamplingParams(n=2, max_new_tokens=5 + 6 * i,
                                                                                  seed=i)))
            time.sleep(0.01)
        outs = [f.result(timeout=120) for f in futures]
    finally:
        batcher.close()
    assert sorted({len(r) for o in outs for r in o.response_ids})[-1] > 2 * WINDOW
    assert _worst_gap(model, outs) < TOL


def test_recurrent_models_get_no_prompt_cache_and_unknown_layer_kinds_are_refused(layer_kind_dir, tiny_model_dir):
    from tiller.models.layer_masks import layout_of
    from tiller.rollout.continuous import ContinuousBatcher

    model, tok = _load(layer_kind_dir("qwen3_5_text"), "qwen3_5_text")
    batcher = ContinuousBatcher(NativeRolloutEngine(model, tok), prompt_cache_mb=64)
    try:
        assert batcher.prompt_cache.max_bytes == 0  # a prompt's recurrent state is not cached
    finally:
        batcher.close()
    config = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config
    config.layer_types = ["full_attention", "compressed_sparse_attention", "full_attention"]
    with pytest.raises(UserError, match=r"compressed_sparse_attention.*rollout.name=hf"):
        layout_of(config)


def test_layout_masks_worked_example():
    """Row of 5 tokens after one pad: the sliding (window 2) mask lets query 4 see keys 3-4 only, the chunked (3) one
    positions 3-5; the recurrent layers get the padding mask; a plain model one tensor."""
    from tiller.models.layer_masks import Layout

    valid = torch.tensor([[0, 1, 1, 1, 1, 1]], dtype=torch.bool)[:, None, None, :]
    pos = torch.tensor([[0, 0, 1, 2, 3, 4]])
    padding = torch.tensor([[0, 1, 1, 1, 1, 1]])
    layout = Layout("x", ("sliding_attention", "linear_attention", "full_attention"), window=2)
    masks = layout.masks(valid, pos[:, -1:], pos, padding)
    assert masks["full_attention"][0, 0, 0].tolist() == [False, True, True, True, True, True]
    assert masks["sliding_attention"][0, 0, 0].tolist() == [False, False, False, False, True, True]
    assert masks["linear_attention"] is padding
    chunked = Layout("x", ("chunked_attention",), chunk=3).masks(valid, pos[:, -1:], pos, None)
    assert chunked["chunked_attention"][0, 0, 0].tolist() == [False, False, False, False, True, True]
    assert Layout("x", ("full_attention",)).masks(valid, pos[:, -1:], pos, None) is valid
    assert Layout("x", (), window=3).masks(valid, pos[:, -1:], pos, None)[0, 0, 0].tolist() == \
        [False, False, False, True, True, True]
