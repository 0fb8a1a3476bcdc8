"""Ulysses sequence parallelism (`tiller.workers.ulysses`) on a real 2-process gloo group: each rank runs half of the
packed micro-batch's tokens; the gathered log-probs and entropies equal the one-process packed forward's, and the
two ranks' parameter gradients sum to its gradients (tiller's convention: the global gradient is the ranks' sum).
Cases: an odd token count (padding), a rank whose half holds only prompt tokens (no LM-head position of its own),
grouped-query attention with fewer key / value heads than ranks (repeated, as verl does)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.trainer.test_packed_forward import micro_batch

CASES = {  # (prompt lengths, response lengths) of a micro-batch
    "mixed": ([7, 3, 5, 1, 6], [9, 2, 5, 7, 1]),  # several rows; rows cross the ranks' boundary
    "odd": ([4, 2], [6, 4]),  # 15 input tokens: one padding token
    "prompt_only_half": ([30], [3]),  # rank 0's half is all prompt: a placeholder LM-head position
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharpened(path):
    from tests.rollout.conftest import load

    model, _ = load(path, sharpen=0.1)
    model.train()
    return model


def _loss(logp, entropy, t):
    return logp.sum() + (logp * torch.linspace(0.5, 2, t)).square().sum() + 0.3 * entropy.sum()


def _reference(path, case):
    from tiller.algos.entropy import entropy_from_logits, logprobs_from_logits
    from tiller.workers.packed import packed_response_forward

    model = _sharpened(path)
    ids, mask, rmask, P = micro_batch(*CASES[case])
    logits, t = packed_response_forward(model, ids, mask, P, rmask)
    logp = logprobs_from_logits(logits.float(), ids[:, P: P + t]) * rmask[:, :t]
    ent = entropy_from_logits(logits.float()) * rmask[:, :t]
    _loss(logp, ent, t).backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rank_main(rank: int, port: int, path: str, case: str, out: dict, checkpointing: bool = False) -> None:
    import torch

    from tiller.algos.entropy import entropy_from_logits, logprobs_from_logits
    from tiller.distributed import context
    from tiller.workers.ulysses import seq_parallel_groups, ulysses_response_forward

    torch.set_num_threads(1)
    context.init_distributed(rank, 2, "127.0.0.1", port, backend="gloo", timeout_s=60)
    try:
        sp = seq_parallel_groups(2)
        model = _sharpened(path)
        if checkpointing:  # each layer's forward (its all-to-alls too) reruns inside backward()
            from tiller.workers.packed import enable_checkpointing

            enable_checkpointing(model)
        ids, mask, rmask, P = micro_batch(*CASES[case])
        local, layout = ulysses_response_forward(model, ids, mask, P, rmask, sp)
        local = local.float()
        labels = layout.local(ids[:, P: P + layout.t_used])
        cols = torch.stack([logprobs_from_logits(local, labels), entropy_from_logits(local)], dim=-1)
        full = layout.gather(cols)
        t = layout.t_used
        logp, ent = full[..., 0] * rmask[:, :t], full[..., 1] * rmask[:, :t]
        _loss(logp, ent, t).backward()
        out[rank] = {"logp": logp.detach(), "ent": ent.detach(), "counts": layout.counts,
                     "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                     "dp_sum": float(context.all_reduce_sum(torch.tensor(1.0)))}
    finally:
        context.destroy_distributed()


@pytest.fixture(scope="module")
def mha_model_dir(tiny_even_heads_dir):
    """The tiny Qwen2 with 4 query and 4 key / value heads (2 of each per rank)."""
    return tiny_even_heads_dir


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory, tiny_model_dir):
    """4 query heads and one key / value head: fewer than the 2 ranks, so it is repeated."""
    from tests.conftest import save_tiny_variant

    return save_tiny_variant(tmp_path_factory.mktemp("ulysses") / "qwen2_kv1", tiny_model_dir, num_key_value_heads=1)


@pytest.fixture(scope="module")
def gpt_oss_model_dir(layer_kind_dir):
    """gpt-oss (`tests/layer_kinds.py`): a 6-token window on every other layer and a sink logit per query head, which
    each rank takes for its share of the heads."""
    return layer_kind_dir("gpt_oss")


@pytest.mark.parametrize("case,arch,checkpointing", [
    ("mixed", "mha_model_dir", False), ("prompt_only_half", "mha_model_dir", False), ("odd", "gqa_model_dir", False),
    ("mixed", "gpt_oss_model_dir", False),
    pytest.param("mixed", "mha_model_dir", True, marks=pytest.mark.slow)])  # gradient checkpointing: ~8 s
def test_sequence_parallel_forward_and_gradients_equal_one_process(case, arch, checkpointing, request):
    path = str(request.getfixturevalue(arch))
    ref_logp, ref_ent, ref_grads = _reference(path, case)
    out = mp.Manager().dict()
    mp.spawn(_rank_main, args=(_free_port(), path, case, out, checkpointing), nprocs=2, join=True)
    r0, r1 = out[0], out[1]
    if case == "prompt_only_half":
        assert r0["counts"][0] == 0 < r0["counts"][1]  # the placeholder path ran
    assert r0["dp_sum"] == 1.0  # the two ranks are one data-parallel replica: counts are not doubled
    for r in (r0, r1):  # every rank of the group holds the whole micro-batch's results
        torch.testing.assert_close(r["logp"], ref_logp, atol=2e-5, rtol=0)
        torch.testing.assert_close(r["ent"], ref_ent, atol=2e-5, rtol=0)
    for name, grad in ref_grads.items():
        summed = r0["grads"][name] + r1["grads"][name]
        scale = float(grad.abs().max())
        assert scale > 0, name
        assert float((summed - grad).abs().max()) <= 2e-5 * scale, name
        # each rank alone holds only part of it (the split is real)
    assert any(float((r0["grads"][n] - g).abs().max()) > 1e-3 * float(g.abs().max()) for n, g in ref_grads.items())


def _value_model(path):
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # as the critic worker: no dropout on the value head
    torch.manual_seed(0)  # the fresh value head: the same on every rank and in the reference
    model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32)
    model.train()
    return model


def _value_loss(values, rmask, t):
    return ((values - torch.linspace(-1, 1, t)) ** 2 * rmask[:, :t]).sum()


def _value_rank_main(rank: int, port: int, path: str, out: dict) -> None:
    import torch

    from tiller.distributed import context
    from tiller.workers.ulysses import seq_parallel_groups, ulysses_response_forward

    torch.set_num_threads(1)
    context.init_distributed(rank, 2, "127.0.0.1", port, backend="gloo", timeout_s=60)
    try:
        sp = seq_parallel_groups(2, key="critic.ulysses_sequence_parallel_size")
        model = _value_model(path)
        ids, mask, rmask, P = micro_batch(*CASES["mixed"])
        local, layout = ulysses_response_forward(model, ids, mask, P, rmask, sp, logits_to_keep=False)
        values = layout.gather(local.float())[..., 0]
        _value_loss(values, rmask, layout.t_used).backward()
        out[rank] = {"values": values.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    finally:
        context.destroy_distributed()


def test_sequence_parallel_value_model_equals_one_process(mha_model_dir):
    """The critic's split (critic.ulysses_sequence_parallel_size): a token-classification model's one-column head
    runs on every position of the rank's slice and the response-predicting ones are gathered; values and summed
    gradients equal the one-process packed forward's."""
    from tiller.workers.packed import packed_response_forward

    model = _value_model(str(mha_model_dir))
    ids, mask, rmask, P = micro_batch(*CASES["mixed"])
    out_ref, t = packed_response_forward(model, ids, mask, P, rmask, logits_to_keep=False)
    ref_values = out_ref[..., 0]
    _value_loss(ref_values, rmask, t).backward()
    out = mp.Manager().dict()
    mp.spawn(_value_rank_main, args=(_free_port(), str(mha_model_dir), out), nprocs=2, join=True)
    keep = torch.zeros_like(ref_values, dtype=torch.bool)
    keep[:, :t] = rmask[:, :t].bool()
    for r in (out[0], out[1]):
        torch.testing.assert_close(r["values"][keep], ref_values.detach()[keep], atol=2e-5, rtol=0)
    for name, p in model.named_parameters():
        summed = out[0]["grads"][name] + out[1]["grads"][name]
        assert float((summed - p.grad).abs().max()) <= 2e-5 * float(p.grad.abs().max()), name
