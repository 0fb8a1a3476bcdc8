"""The vllm engine's glue, against a stand-in `vllm` module (vLLM itself is an optional GPU extra).

The stand-in records what the engine asks for and answers like vLLM's offline API (RequestOutput with
CompletionOutput token ids, per-step logprob dicts, finish reasons), so the mapping of sampling knobs,
the contiguous n-samples layout, the shared stop rule, weight sync and sleep / wake are all checked.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.fake_vllm import FakeLLM as _FakeLLM
from tests.rollout.conftest import prompt_ids
from tiller.errors import UserError
from tiller.rollout import SamplingParams, build_rollout_engine


def test_missing_vllm_names_the_extra(monkeypatch, qwen):
    model, tok = qwen
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(UserError, match=r"pip install 'tiller\[vllm\]'"):
        build_rollout_engine("vllm", model, tok)


def test_generate_maps_params_and_layout(fake_vllm, qwen):
    model, tok = qwen
    engine = build_rollout_engine("vllm", model, tok, dtype="bfloat16", enable_sleep_mode=True)
    llm = _FakeLLM.instances[0]
    assert llm.logprobs_mode == "processed_logprobs" and llm.kwargs["dtype"] == "bfloat16"
    prompts = [[7, 1, 2], [20, 3]]
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4, top_k=5, seed=3, ignore_eos=True,
                                                  stop_token_ids=[19]))
    sp = llm.calls[-1]
    assert (sp.n, sp.max_tokens, sp.top_k, sp.seed, sp.ignore_eos, sp.logprobs) == (2, 4, 5, 3, True, 0)
    # prompt 0: sample 0 tokens 7,8,9,10; sample 1 tokens 17,18,19 (stop id 19 kept, cut after it)
    assert out.response_ids[:2] == [[7, 8, 9, 10], [17, 18, 19]]
    assert out.finish_reason[:2] == ["length", "stop"]
    assert out.logprobs[1] == pytest.approx([-0.1, -0.2, -0.3])
    assert out.prompt_ids == [prompts[0], prompts[0], prompts[1], prompts[1]]
    engine.generate(prompts, SamplingParams(do_sample=False, temperature=0.3, max_new_tokens=2))
    assert llm.calls[-1].temperature == 0.0  # greedy is temperature 0 in vLLM


def test_weight_sync_and_sleep_wake(fake_vllm, qwen):
    model, tok = qwen
    engine = build_rollout_engine("vllm", model, tok, enable_sleep_mode=True)
    llm = _FakeLLM.instances[0]
    engine.update_weights()  # pushes the actor's current weights
    assert set(llm.loaded[-1]) == set(model.state_dict())
    torch.testing.assert_close(llm.loaded[-1]["lm_head.weight"], model.state_dict()["lm_head.weight"])
    engine.update_weights({"model.norm.weight": torch.ones(3)})
    assert list(llm.loaded[-1]) == ["model.norm.weight"]
    engine.sleep()
    engine.sleep()  # idempotent
    engine.generate(prompt_ids(tok)[:1], SamplingParams(max_new_tokens=2))  # wakes itself first
    assert llm.calls[:2] == [("sleep", 1), "wake_up"]
