"""actor.use_torch_compile: each decoder layer compiled on its own (`tiller.models.compile`). The layers give the
eager forward's logprobs and gradients (packed and padded), one compiled graph serves every layer, the reference is
compiled by its own key, copies are eager, and a compile that fails warns and runs eagerly.

Traced with the "aot_eager" backend (Dynamo and AOTAutograd without code generation: the graph breaks, guards and
recompiles are the real ones; Inductor's code here would only add compile time, and its CPU cache is not safe across
the AVX2 subset's ATEN_CPU_CAPABILITY switch). Inductor's kernels are checked on CUDA by scripts/gpu_check.py's
packed_update, and on this CPU by the slow test at the end."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo as dynamo

from tests.rollout.conftest import load
from tests.trainer.test_packed_forward import _logp_and_grads, micro_batch
from tiller.models import compile as compile_module
from tiller.models.compile import compile_layers
from tiller.workers.common import response_forward
from tiller.workers.packed import packed_response_forward


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    monkeypatch.setattr(compile_module, "BACKEND", "aot_eager")
    dynamo.reset()
    yield
    dynamo.reset()


def _close_grads(got: dict, want: dict, rel: float) -> None:
    for name, grad in want.items():
        if grad is not None:
            assert float((got[name] - grad).abs().max()) <= rel * float(grad.abs().max()) + 1e-9, name


def _graphs() -> int:
    return dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("forward", ["packed", "padded"])
def test_compiled_layers_equal_eager_and_one_graph_serves_every_layer(tiny_model_dir, forward):
    fwd = packed_response_forward if forward == "packed" else (lambda *a: response_forward(*a, logits_to_keep=True))
    model, _ = load(tiny_model_dir, sharpen=0.1)
    batches = [micro_batch([7, 3, 5, 1, 6], [9, 2, 5, 7, 1]), micro_batch([4, 3, 8, 2], [5, 9, 3, 7], seed=1)]
    want = [_logp_and_grads(model, fwd, *b) for b in batches]
    state = compile_layers(model, "k")
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    dynamo.utils.counters.clear()
    got = [_logp_and_grads(model, fwd, *b) for b in batches[:1]]
    first = _graphs()
    got.append(_logp_and_grads(model, fwd, *batches[1]))
    assert _graphs() == first > 0  # another micro-batch length: no recompile (dynamic shapes)
    for (lp, grads), (lp_want, grads_want) in zip(got, want):
        torch.testing.assert_close(lp, lp_want, atol=1e-6, rtol=0)
        _close_grads(grads, grads_want, 1e-6)
    assert state.error is None

    # the same model cut to one layer compiles as many graphs: the layers share them (none compiled per layer)
    dynamo.reset()
    one, _ = load(tiny_model_dir, sharpen=0.1)
    assert len(one.model.layers) >= 3
    one.model.layers = one.model.layers[:1]
    one.config.num_hidden_layers = 1
    compile_layers(one, "k")
    dynamo.utils.counters.clear()
    _logp_and_grads(one, fwd, *batches[0])
    assert _graphs() == first

    # a deep copy (the rollout's cast copy, the reference) is eager: nn.Module drops the compiled call
    assert copy.deepcopy(model).model.layers[0]._compiled_call_impl is None


@pytest.mark.parametrize("part", ["forward", "backward"])
def test_a_failing_compile_warns_once_and_runs_eagerly(tiny_model_dir, monkeypatch, part):
    """A compile that fails, in the forward or in the backward (compiled with the forward, so the failure is caught
    there and not in loss.backward()), warns once; the layers run eagerly with the eager numbers."""
    from torch._dynamo.backends.common import aot_autograd

    def fails(gm, inputs):
        raise RuntimeError("no backend here")

    works = lambda gm, inputs: gm  # noqa: E731
    broken = aot_autograd(fw_compiler=fails if part == "forward" else works,
                          bw_compiler=fails if part == "backward" else works)
    monkeypatch.setattr(compile_module, "BACKEND", broken)
    model, _ = load(tiny_model_dir, sharpen=0.1)
    batch = micro_batch([7, 3, 5], [9, 2, 5])
    lp_want, grads_want = _logp_and_grads(model, packed_response_forward, *batch)
    state = compile_layers(model, "actor_rollout_ref.actor.use_torch_compile")
    with pytest.warns(UserWarning, match="use_torch_compile: compiling the decoder layers failed.*no backend here"):
        lp, grads = _logp_and_grads(model, packed_response_forward, *batch)
    assert "no backend here" in state.error
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    torch.testing.assert_close(lp, lp_want, atol=0, rtol=0)
    _close_grads(grads, grads_want, 0.0)


def test_a_model_without_repeated_layers_is_refused():
    from tiller.errors import ConfigError

    with pytest.raises(ConfigError, match="use_torch_compile=true: Linear names no repeated decoder layers"):
        compile_layers(torch.nn.Linear(2, 2), "actor_rollout_ref.actor.use_torch_compile")


def test_actor_honours_use_torch_compile_and_ref_follows(tiny_model_dir):
    """The worker's old / ref logprobs and update gradient with compiled layers equal the eager worker's; its state
    dict keeps the model's names; ref.use_torch_compile null follows the actor, false keeps the reference eager."""
    import tiller.workers.actor as actor_module
    from tests.trainer.test_dynamic_batches import _batch, _cfg, _grads

    batch = _batch()
    out = []
    for extra in ([], ["actor_rollout_ref.actor.use_torch_compile=true"],
                  ["actor_rollout_ref.actor.use_torch_compile=true", "actor_rollout_ref.ref.use_torch_compile=false"]):
        w = actor_module.ActorRolloutRefWorker(
            _cfg(tiny_model_dir, "actor_rollout_ref.model.use_remove_padding=true", *extra), total_training_steps=1,
            need_ref=True)
        batch["ref_log_prob"] = w.compute_ref_log_prob(batch)["ref_log_prob"]
        logp = w.compute_log_prob(batch)["old_log_probs"]
        out.append((w, batch["ref_log_prob"].clone(), logp, _grads(w, "update_actor", batch)))
    eager, compiled, ref_eager = out
    layers = lambda m: m.model.layers  # noqa: E731
    assert eager[0].compiled is None and all(l._compiled_call_impl is None for l in layers(eager[0].ref_module))
    assert compiled[0].compiled.error is None
    assert all(l._compiled_call_impl is not None for l in layers(compiled[0].ref_module))
    assert all(l._compiled_call_impl is None for l in layers(ref_eager[0].ref_module))
    assert all(l._compiled_call_impl is not None for l in layers(ref_eager[0].module))
    assert list(compiled[0].model.state_dict()) == list(eager[0].model.state_dict())  # no _orig_mod. prefix
    mask = batch["response_mask"].bool()
    for w, ref_lp, logp, grads in (compiled, ref_eager):
        torch.testing.assert_close(ref_lp[mask], eager[1][mask], atol=1e-6, rtol=0)
        torch.testing.assert_close(logp[mask], eager[2][mask], atol=1e-6, rtol=0)
        _close_grads(grads, eager[3], 1e-5)


def test_actor_compiles_a_lora_policys_layers(tiny_model_dir):
    """With LoRA adapters (peft's layers inside each decoder layer): the compiled worker's logprobs and adapter
    gradients equal the eager worker's."""
    import tiller.workers.actor as actor_module
    from tests.trainer.test_dynamic_batches import _batch, _cfg, _grads

    batch = _batch()
    batch["ref_log_prob"] = batch["old_log_probs"].clone()  # (the config's KL loss reads it)
    out = []
    for flag in ("false", "true"):
        w = actor_module.ActorRolloutRefWorker(
            _cfg(tiny_model_dir, "actor_rollout_ref.model.use_remove_padding=true",
                 "actor_rollout_ref.model.lora_rank=4", f"actor_rollout_ref.actor.use_torch_compile={flag}"),
            total_training_steps=1)
        out.append((w, w.compute_log_prob(batch)["old_log_probs"], _grads(w, "update_actor", batch)))
    (_, lp, grads), (compiled, lp_c, grads_c) = out
    assert compiled.compiled.error is None and len(compiled.compiled.layers) >= 3
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(lp_c[mask], lp[mask], atol=1e-6, rtol=0)
    assert grads and all("lora_" in name for name in grads)
    _close_grads(grads_c, grads, 1e-5)


@pytest.mark.slow
def test_inductor_layers_equal_eager_on_this_cpu(tiny_model_dir, monkeypatch):
    """Inductor's C++ kernels for the compiled layers (~40 s of compiling here): logprobs and gradients within
    summation-order noise of the eager forward's."""
    monkeypatch.setattr(compile_module, "BACKEND", "inductor")
    model, _ = load(tiny_model_dir, sharpen=0.1)
    batch = micro_batch([7, 3, 5, 1, 6], [9, 2, 5, 7, 1])
    lp_want, grads_want = _logp_and_grads(model, packed_response_forward, *batch)
    state = compile_layers(model, "k")
    lp, grads = _logp_and_grads(model, packed_response_forward, *batch)
    assert state.error is None
    torch.testing.assert_close(lp, lp_want, atol=1e-4, rtol=0)
    _close_grads(grads, grads_want, 1e-4)
