"""The update's forward without padding (`tiller.workers.packed`, verl's use_remove_padding): logprobs and gradients
equal the padded forward's; a packing that let rows see each other would not."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.conftest import load
from tiller.algos.entropy import logprobs_from_logits
from tiller.workers.common import response_forward
from tiller.workers.packed import pack_rows, packed_response_forward


@pytest.fixture(scope="module")
def sharp_qwen(tiny_model_dir):
    return load(tiny_model_dir, sharpen=0.1)


@pytest.fixture(scope="module")
def sharp_llama(tiny_llama_dir):
    return load(tiny_llama_dir, sharpen=0.1)


def micro_batch(prompt_lens, response_lens, seed=0):
    """Left-padded prompts, right-padded responses: input_ids / attention_mask [B, P + T], response_mask [B, T]."""
    P, T = max(prompt_lens), max(response_lens)
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(prompt_lens), P + T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rmask = torch.zeros(len(prompt_lens), T)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        ids[b, P - p : P + r] = torch.randint(5, 500, (p + r,), generator=g)
        mask[b, P - p : P + r] = 1
        rmask[b, :r] = 1
    return ids, mask, rmask, P


def test_pack_rows_worked_example():
    ids = torch.tensor([[0, 7, 8, 9], [5, 6, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    flat, pos, index = pack_rows(ids, mask)
    assert flat.tolist() == [[7, 8, 9, 5, 6]] and pos.tolist() == [[0, 1, 2, 0, 1]]
    assert index.tolist() == [[-1, 0, 1, 2], [3, 4, -1, -1]]


def _logp_and_grads(model, forward, ids, mask, rmask, P):
    model.zero_grad(set_to_none=True)
    logits, t = forward(model, ids, mask, P, rmask)
    logp = logprobs_from_logits(logits.float(), ids[:, P : P + t]) * rmask[:, :t]
    (logp.sum() + (logp * torch.linspace(0.5, 2, t)).square().sum()).backward()
    return logp.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch,impl", [("sharp_qwen", "sdpa"), ("sharp_llama", "sdpa"), ("sharp_qwen", "eager")])
def test_packed_forward_equals_padded_logprobs_and_gradients(arch, impl, request):
    model, _ = request.getfixturevalue(arch)
    model.config._attn_implementation = impl
    try:
        ids, mask, rmask, P = micro_batch([7, 3, 5, 1, 6], [9, 2, 5, 7, 1])
        padded = lambda *a: response_forward(*a, logits_to_keep=True)
        lp_pad, g_pad = _logp_and_grads(model, padded, ids, mask, rmask, P)
        lp_pack, g_pack = _logp_and_grads(model, packed_response_forward, ids, mask, rmask, P)
    finally:
        model.config._attn_implementation = "sdpa"
    torch.testing.assert_close(lp_pack, lp_pad, atol=2e-5, rtol=0)
    for name, grad in g_pad.items():  # summation order only: within 1e-5 of each gradient's largest entry
        scale = float(grad.abs().max())
        assert scale > 0, name
        assert float((g_pack[name] - grad).abs().max()) <= 1e-5 * scale, name


def test_packed_backward_cost_does_not_grow_with_rows_times_length(sharp_qwen):
    """The per-row attention's rows are one split of the packed tensors: its backward concatenates the rows'
    gradients once, instead of a zero tensor of the whole packed length per row, tensor and layer (slice backward:
    B x 3 x layers of them, what made a 128-row update on a GPU crawl)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    model, _ = sharp_qwen

    def backward_ops(prompt_lens, response_lens):
        ids, mask, rmask, P = micro_batch(prompt_lens, response_lens)
        model.zero_grad(set_to_none=True)
        logits, t = packed_response_forward(model, ids, mask, P, rmask)
        with Count() as counted:
            (logprobs_from_logits(logits.float(), ids[:, P : P + t]) * rmask[:, :t]).sum().backward()
        return counted.ops

    two, eight = backward_ops([7, 3], [9, 2]), backward_ops([7, 3, 5, 1, 6, 4, 2, 8], [9, 2, 5, 7, 1, 3, 6, 4])
    # the model's own slices (rotary halves, ...) are per layer; none per row (before: 3 x layers more per row)
    assert eight.get("slice_backward", 0) == two.get("slice_backward", 0), (two, eight)
    assert eight.get("zeros", 0) + eight.get("new_zeros", 0) == two.get("zeros", 0) + two.get("new_zeros", 0)


def test_packed_attention_runs_in_autocasts_dtype():
    """Under bf16 autocast the packed attention takes autocast's dtype for fp32 queries (as SDPA does in the padded
    forward), which is what lets CUDA's varlen kernel run for an fp32-weight model; outside autocast, the query's."""
    from tiller.models.varlen import attention_dtype

    q = torch.zeros(1, 2, 3, 4)
    assert attention_dtype(q) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention_dtype(q) == torch.bfloat16
        assert attention_dtype(q.double()) == torch.float64  # (only fp32 is cast, as autocast's own rule)
    assert attention_dtype(q.to(torch.float16)) == torch.float16


@pytest.mark.parametrize("model_type", ["mistral", "gpt_oss", "gemma2"])
def test_packed_forward_keeps_sliding_windows_sinks_and_soft_caps(layer_kind_dir, model_type):
    """The packed attention applies what the layer asks beyond causal (`tests/layer_kinds.py`, window 6): Mistral's
    window on every layer, gpt-oss's on every other layer with its attention sinks, Gemma 2's with its logit
    soft-cap. Rows of up to 16 tokens cross the window; logprobs and gradients (the sinks' too) equal the padded
    forward's. Without them the packed logprobs were off by 0.25 (Mistral) and 2.6 (Gemma 2), and gpt-oss's sinks
    got no gradient."""
    from tests.layer_kinds import attn_of
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(layer_kind_dir(model_type), attn_implementation=attn_of(model_type))
    ids, mask, rmask, P = micro_batch([7, 3, 5, 1, 6], [9, 2, 5, 7, 1])
    padded = lambda *a: response_forward(*a, logits_to_keep=True)
    lp_pad, g_pad = _logp_and_grads(model, padded, ids, mask, rmask, P)
    lp_pack, g_pack = _logp_and_grads(model, packed_response_forward, ids, mask, rmask, P)
    torch.testing.assert_close(lp_pack, lp_pad, atol=2e-5, rtol=0)
    for name, grad in g_pad.items():
        if grad is None:  # a router's unused expert, say: none in either
            assert g_pack[name] is None, name
            continue
        scale = float(grad.abs().max())
        assert float((g_pack[name] - grad).abs().max()) <= 1e-5 * max(scale, 1e-6), name


def test_recurrent_models_run_the_padded_update(layer_kind_dir, capsys):
    """use_remove_padding on a model with recurrent layers: their state would run from one packed row into the next,
    so the update runs the padded forward, said once naming the key."""
    from transformers import AutoModelForCausalLM
    from tiller.workers.packed import packs

    model = AutoModelForCausalLM.from_pretrained(layer_kind_dir("qwen3_5_text"))
    assert packs(model, "actor_rollout_ref.model.use_remove_padding", True) is False
    assert "actor_rollout_ref.model.use_remove_padding=True: qwen3_5_text's recurrent layers (linear_attention)" \
        in capsys.readouterr().err
    plain = AutoModelForCausalLM.from_pretrained(layer_kind_dir("mistral"))
    assert packs(plain, "k", True) is True and packs(model, "k", False) is False
    import types  # Llama 4's chunked attention: not cut into chunks by the packed attention, so padded too

    llama4 = types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama4_text",
                                                                layer_types=["chunked_attention", "full_attention"]))
    assert packs(llama4, "k", True) is False and "chunked-attention layers" in capsys.readouterr().err


def test_rows_that_saw_each_other_would_be_caught(sharp_qwen):
    """Negative control: the same packed sequence with position ids that do not restart (one long sequence, every
    token attending to the rows before it) gives other logprobs, so the equality above is not vacuous."""
    model, _ = sharp_qwen
    ids, mask, rmask, P = micro_batch([7, 3, 5], [9, 2, 5])
    with torch.no_grad():
        logits, t = packed_response_forward(model, ids, mask, P, rmask)
        flat, _, _ = pack_rows(ids[:, :-1], mask[:, :-1])
        leaked = model(input_ids=flat, use_cache=False).logits[0]
    good = logprobs_from_logits(logits, ids[:, P : P + t])
    # row 1's last prompt token (which predicts its first response token) follows row 0's 15 packed tokens
    last_prompt_token = int(mask[0, :-1].sum()) + 3 - 1
    leaked_lp = torch.log_softmax(leaked[last_prompt_token], -1)[ids[1, P]]
    assert abs(float(leaked_lp - good[1, 0])) > 1e-3


def test_actor_honours_use_remove_padding(tiny_model_dir, monkeypatch):
    """actor_rollout_ref.model.use_remove_padding=true: the worker's old / ref logprobs and its update's gradient
    equal the padded worker's, and the packed forward is the one that ran."""
    import tiller.workers.actor as actor_module
    from tests.trainer.test_dynamic_batches import _batch, _cfg, _grads

    calls = []
    monkeypatch.setattr(actor_module, "packed_response_forward",
                        lambda *a, **k: calls.append(1) or packed_response_forward(*a, **k))
    batch = _batch()
    logps, grads, counts = [], [], []
    for flag in ("false", "true"):
        w = actor_module.ActorRolloutRefWorker(
            _cfg(tiny_model_dir, f"actor_rollout_ref.model.use_remove_padding={flag}"), total_training_steps=1,
            need_ref=True)
        batch["ref_log_prob"] = w.compute_ref_log_prob(batch)["ref_log_prob"]
        logps.append(w.compute_log_prob(batch)["old_log_probs"])
        grads.append(_grads(w, "update_actor", batch))
        counts.append(len(calls))
    assert counts[0] == 0 and counts[1] >= 3  # padded worker: never; packed: ref, old and update forwards
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(logps[1][mask], logps[0][mask], atol=1e-5, rtol=0)
    for name, grad in grads[0].items():
        assert float((grads[1][name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()) + 1e-9, name


def test_packed_update_makes_no_padded_logits(tiny_model_dir):
    """The packed update's log-probs and entropy come from the K response tokens' logits [K, V]: no tensor over the
    vocabulary is larger (before, a zero-filled [B, t, V] copy, then its fp32 copy and the temperature's: 20 GB each
    for 128 x 256 tokens of a 152k vocabulary on a GPU)."""
    import tiller.workers.actor as actor_module
    from torch.utils._python_dispatch import TorchDispatchMode
    from tests.trainer.test_dynamic_batches import _batch, _cfg, _grads

    class Largest(TorchDispatchMode):
        def __init__(self, vocab):
            super().__init__()
            self.vocab, self.numel = vocab, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab and t.shape[0] != hidden:
                    self.numel = max(self.numel, t.numel())
            return out

    batch = _batch()
    batch["ref_log_prob"] = batch["old_log_probs"].clone()  # (the config's KL loss reads it)
    w = actor_module.ActorRolloutRefWorker(
        _cfg(tiny_model_dir, "actor_rollout_ref.model.use_remove_padding=true"), total_training_steps=1)
    vocab, hidden = w.model.get_output_embeddings().weight.shape  # (the head's weight, transposed: not logits)
    lengths = batch["response_mask"].sum(1)
    B, t = len(lengths), int(lengths.max())
    K = int((lengths + 1).clamp(max=t).sum())  # the packed positions: each row's tokens and the one after its last
    assert B * t > K  # the batch has padding to leave out
    with Largest(vocab) as seen:
        grads = _grads(w, "update_actor", batch)
    assert grads and seen.numel == K * vocab, (seen.numel, K, B * t)


def test_critic_honours_use_remove_padding(tiny_model_dir, monkeypatch):
    """critic.model.use_remove_padding=true: the value model (no logits_to_keep: its one-column head runs on every
    packed position and the response-predicting ones are taken) gives the padded critic's values and gradients,
    under gradient checkpointing too, and the packed forward is the one that ran."""
    import tiller.workers.critic as critic_module
    from tests.trainer.test_dynamic_batches import _batch, _cfg, _grads

    calls = []
    monkeypatch.setattr(critic_module, "packed_response_forward",
                        lambda *a, **k: calls.append(1) or packed_response_forward(*a, **k))
    batch = _batch()
    values, grads, counts = [], [], []
    for flag in ("false", "true", "true_ckpt"):
        extra = ["critic.model.enable_gradient_checkpointing=true"] if flag == "true_ckpt" else []
        w = critic_module.CriticWorker(_cfg(tiny_model_dir, "algorithm.adv_estimator=gae", *extra,
                                            f"critic.model.use_remove_padding={flag != 'false'}"),
                                       total_training_steps=1)
        values.append(w.compute_values(batch)["values"])
        grads.append(_grads(w, "update_critic", batch))
        counts.append(len(calls))
    assert counts[0] == 0 and counts[1] >= 2  # padded critic: never; packed: the values and the update's forwards
    mask = batch["response_mask"].bool()
    assert float(values[0][mask].abs().max()) > 1e-3
    for v in values[1:]:
        torch.testing.assert_close(v[mask], values[0][mask], atol=1e-5, rtol=0)
    for g in grads[1:]:
        for name, grad in grads[0].items():
            assert float((g[name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()) + 1e-9, name


@pytest.mark.parametrize("model_dir", ["tiny_model_dir", "tiny_vlm_dir", "tiny_qwen3vl_dir"])
def test_packed_forward_under_gradient_checkpointing(model_dir, request, monkeypatch):
    """use_remove_padding with enable_gradient_checkpointing (verl's Qwen2.5-VL script): the recompute inside
    backward() runs the packed attention again (it once ran the model's own attention over the whole packed
    sequence: torch's CheckpointError), and the gradients equal those without checkpointing."""
    import tiller.workers.packed as packed
    from tiller.models.loading import load_causal_lm

    calls = []
    attention = packed.packed_attention
    monkeypatch.setattr(packed, "packed_attention", lambda *a, **k: calls.append(1) or attention(*a, **k))
    model = load_causal_lm(request.getfixturevalue(model_dir)).train()
    ids, mask, rmask, P = micro_batch([7, 3, 5], [4, 2, 5])
    lp_plain, g_plain = _logp_and_grads(model, packed_response_forward, ids, mask, rmask, P)
    forward_calls = len(calls)
    packed.enable_checkpointing(model)
    lp_ckpt, g_ckpt = _logp_and_grads(model, packed_response_forward, ids, mask, rmask, P)
    assert forward_calls > 0 and len(calls) == 3 * forward_calls  # the checkpointed run: forward + recompute
    torch.testing.assert_close(lp_ckpt, lp_plain, atol=0, rtol=0)
    # and the packed forward is the padded one's (a VLM's text rows: Qwen2-VL's and Qwen3-VL's 1-D positions)
    lp_pad, _ = _logp_and_grads(model, lambda *a: response_forward(*a, logits_to_keep=True), ids, mask, rmask, P)
    torch.testing.assert_close(lp_plain, lp_pad, atol=2e-5, rtol=0)
    for name, grad in g_plain.items():
        if grad is None:  # the VLM's vision tower: text rows never reach it
            assert g_ckpt[name] is None, name
            continue
        assert float((g_ckpt[name] - grad).abs().max()) <= 1e-6 * float(grad.abs().max()) + 1e-12, name


def test_actor_honours_use_fused_kernels(tiny_model_dir, monkeypatch, capsys):
    """actor_rollout_ref.model.use_fused_kernels=true (with use_remove_padding): the LM head runs with the log-probs
    chunk by chunk (`head_logprobs_and_entropy`), the old / ref logprobs and the update's gradient (the tied head and
    embedding's too) equal the unfused packed worker's, and no tensor over the vocabulary is larger than a chunk's
    logits; without use_remove_padding the logits are computed whole, said once."""
    import tiller.workers.actor as actor_module
    from tests.trainer.test_dynamic_batches import _batch, _cfg, _grads
    from tiller.algos.entropy import head_logprobs_and_entropy

    calls = []
    monkeypatch.setattr(actor_module, "head_logprobs_and_entropy",
                        lambda *a, **k: calls.append(1) or head_logprobs_and_entropy(*a, **k, chunk_size=8))
    batch = _batch()
    logps, grads, counts = [], [], []
    for flag in ("false", "true"):
        w = actor_module.ActorRolloutRefWorker(
            _cfg(tiny_model_dir, "actor_rollout_ref.model.use_remove_padding=true",
                 f"actor_rollout_ref.model.use_fused_kernels={flag}"), total_training_steps=1, need_ref=True)
        batch["ref_log_prob"] = w.compute_ref_log_prob(batch)["ref_log_prob"]
        logps.append(w.compute_log_prob(batch)["old_log_probs"])
        vocab, hidden = w.model.get_output_embeddings().weight.shape
        seen = []  # (the head's weight, transposed, is [hidden, V]: not logits)
        with _Largest(lambda t: t.shape[-1] == vocab and t.dim() == 2 and t.shape[0] != hidden, seen):
            grads.append(_grads(w, "update_actor", batch))
        counts.append((len(calls), max(seen)))
    assert w.model.get_output_embeddings().weight is w.model.get_input_embeddings().weight  # (tied)
    K = int((batch["response_mask"].sum(1) + 1).clamp(max=batch["response_mask"].shape[1]).sum())
    assert counts[0] == (0, K * vocab) and counts[1][0] >= 3 and counts[1][1] <= 8 * vocab < K * vocab, counts
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(logps[1][mask], logps[0][mask], atol=1e-5, rtol=0)
    for name, grad in grads[0].items():
        assert float((grads[1][name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()) + 1e-9, name
    capsys.readouterr()
    actor_module.ActorRolloutRefWorker(_cfg(tiny_model_dir, "actor_rollout_ref.model.use_fused_kernels=true"),
                                       total_training_steps=1)
    assert "use_fused_kernels=True: the LM head runs fused" in capsys.readouterr().err


def test_fused_head_fits_causal_lms_whose_head_is_applied_as_is(layer_kind_dir, tiny_model_dir):
    """`fused_head`: a plain causal LM's (decoder, head); a model whose forward transforms the head's logits (Gemma
    2's soft-cap) or whose head is no Linear is refused with the reason."""
    from transformers import AutoModelForCausalLM

    from tiller.workers.packed import fused_head

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    decoder, head = fused_head(model)
    assert decoder is model.model and head is model.lm_head
    gemma = AutoModelForCausalLM.from_pretrained(layer_kind_dir("gemma2"))
    assert "transforms the head's logits" in fused_head(gemma)
    model.lm_head = torch.nn.Sequential(model.lm_head)
    assert "not a plain Linear" in fused_head(model)


class _Largest(torch.utils._python_dispatch.TorchDispatchMode):
    """Records into `seen` the numel of every op output `which(t)` picks."""

    def __init__(self, which, seen):
        super().__init__()
        self.which, self.seen = which, seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and self.which(t):
                self.seen.append(t.numel())
        return out
