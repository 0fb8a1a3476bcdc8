"""Shared helpers for rollout tests: load the kit's tiny models and a teacher-forced logprob reference."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def load(path, sharpen: float = 0.0):
    """Model + tokenizer from a kit dir. `sharpen` adds seeded noise of that std to every matrix: the kit's
    fresh init gives near-flat logits whose greedy output repeats one token, which would make greedy
    equality tests weak; with noise 0.1 greedy continuations vary token to token."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    if sharpen:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.add_(torch.randn(p.shape, generator=gen) * sharpen)
    return model, tok


def load_family(layer_kind_dir, model_type: str):
    """Model + tokenizer of the tiny `model_type` model of `tests/layer_kinds.py` (fp32, eval)."""
    path = layer_kind_dir(model_type)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def assert_same_rows(out, ref, atol: float) -> None:
    """Two engines' outputs: the same tokens, logprobs within `atol`."""
    assert out.response_ids == ref.response_ids
    for a, b in zip(out.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=atol, rtol=0)


@pytest.fixture(scope="module")
def qwen(tiny_model_dir):
    return load(tiny_model_dir)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load(tiny_llama_dir)


@pytest.fixture(scope="module")
def sharp_qwen(tiny_model_dir):
    return load(tiny_model_dir, sharpen=0.1)


@pytest.fixture(scope="module")
def sharp_llama(tiny_llama_dir):
    return load(tiny_llama_dir, sharpen=0.1)


PROMPTS = ["1+2=", "The cat sat on the mat and", "12*3", "hello"]


def prompt_ids(tok, texts=PROMPTS):
    return [tok(t)["input_ids"] for t in texts]


def reference_logprobs(model, prompt, response, temperature=1.0, top_k=-1):
    """Teacher-forced logprobs of `response` after `prompt`, unpadded, one sequence at a time.

    Independent of both engines: a plain forward over prompt+response, logits / T, then top-k
    filtering (keep the k largest, others -inf), then log_softmax, read at the response tokens.
    """
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    steps = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / temperature
    if top_k > 0:
        kth = torch.topk(steps, top_k, dim=-1).values[:, -1:]
        steps = steps.masked_fill(steps < kth, float("-inf"))
    logp = torch.log_softmax(steps, dim=-1)
    return logp.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)


def assert_reads_new_weights(engine, model, tok, prompts, sampling, before, reference: str) -> None:
    """Scale `model`'s weights in place (an optimizer step on a shared module): `engine`'s next output differs
    from `before` (its output on the old weights) and equals a fresh `reference` engine's ("native" / "hf")."""
    from tiller.rollout import build_rollout_engine

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.3)
    changed = engine.generate(prompts, sampling)
    assert changed.response_ids != before.response_ids
    assert changed.response_ids == build_rollout_engine(reference, model, tok).generate(prompts, sampling).response_ids


def staggered_greedy(engine, prompts, max_new: int, max_rows: int = 3, timeout: float = 60.0):
    """Submit `prompts` to a fresh `ContinuousBatcher(engine, max_rows)` 2 ms apart, prompt k asking for
    `max_new - k` greedy tokens (eos ignored), so rows join and leave at different steps; returns
    (outputs, the batcher's stats)."""
    import time

    from tiller.rollout import SamplingParams
    from tiller.rollout.continuous import ContinuousBatcher

    batcher = ContinuousBatcher(engine, max_rows=max_rows)
    try:
        futures = []
        for k, p in enumerate(prompts):
            futures.append(batcher.submit([p], SamplingParams(max_new_tokens=max_new - k, do_sample=False,
                                                              ignore_eos=True)))
            time.sleep(0.002)
        return [f.result(timeout=timeout) for f in futures], dict(batcher.stats)
    finally:
        batcher.close()
