"""Shared helpers for rollout tests: load the kit's tiny models and a teacher-forced logprob reference."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def load(path):
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, tok


@pytest.fixture(scope="module")
def qwen(tiny_model_dir):
    return load(tiny_model_dir)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load(tiny_llama_dir)


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
