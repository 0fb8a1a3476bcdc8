"""tiller.distributed.context on a real 2-process gloo group (torch.multiprocessing, no Ray):
collectives, and an FSDP2 checkpoint round trip (full model + full optimizer state) that resumes the
exact trajectory."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, out: dict) -> None:
    import torch

    from tiller import hostinfo
    from tiller.distributed import context
    from tiller.distributed.testing import MLPRegressionWorker
    from tiller.protocol import Batch

    torch.set_num_threads(1)
    hostinfo.adopt_bf16_decision(hostinfo.Bf16Decision(rank == 0, f"rank {rank}'s timing"))  # the ranks disagree
    context.init_distributed(rank, 2, "127.0.0.1", port, backend="gloo", timeout_s=60)
    try:
        context.agree_bf16_decision()
        bf16 = hostinfo.bf16_decision()
        res = {"rank": context.rank(), "world": context.world_size(), "bf16": (bf16.use_bf16, bf16.reason),
               "sum": context.all_reduce_sum(torch.tensor([rank + 1.0, 10.0])).tolist(),
               "objs": context.all_gather_object({"r": rank})}
        g = torch.Generator().manual_seed(0)
        batches = [Batch({"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 2, generator=g)}) for _ in range(3)]
        mine = [b.chunk(2)[rank] for b in batches]

        def adam_worker(seed):
            w = MLPRegressionWorker(seed=seed, strategy="fsdp")
            w.optimizer = torch.optim.Adam(w.model.parameters(), lr=0.05)
            return w

        a = adam_worker(seed=1)
        a.train_step(mine[0], micro=2)
        res["sharded"] = context.is_sharded(a.model)
        model_sd = context.full_state_dict(a.model)
        optim_sd = context.checkpointable_optimizer(a.model, a.optimizer).state_dict()
        b = adam_worker(seed=2)  # different init: everything must come from the checkpoint
        context.load_full_state_dict(b.model, model_sd)
        context.FullOptimizerState(b.model, b.optimizer).load_state_dict(optim_sd)
        for mb in mine[1:]:
            a.train_step(mb, micro=2)
            b.train_step(mb, micro=2)
        sa, sb = a.state_dict(), b.state_dict()
        res["resume_maxdiff"] = max(float((sa[k] - sb[k]).abs().max()) for k in sa)
        res["state"] = sa
        out[rank] = res
    finally:
        context.destroy_distributed()


def test_collectives_and_fsdp2_checkpoint_round_trip_on_gloo():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_main, args=(_free_port(), out), nprocs=2, join=True)
        r0, r1 = dict(out[0]), dict(out[1])
    assert (r0["rank"], r1["rank"], r0["world"]) == (0, 1, 2)
    assert r0["sum"] == r1["sum"] == [3.0, 20.0]  # [1 + 2, 10 + 10]
    assert r0["objs"] == [{"r": 0}, {"r": 1}]
    assert r0["bf16"] == r1["bf16"] == (True, "rank 0's timing")  # one CPU bf16 decision for the group: rank 0's
    assert r0["sharded"] and r0["resume_maxdiff"] == 0.0
    for key, value in r0["state"].items():  # full_state_dict gives every rank the same full tensors
        assert torch.equal(value, r1["state"][key])
    # and the 2-rank Adam trajectory equals one process on the whole batches (summed gradients)
    from tiller.distributed.testing import MLPRegressionWorker
    from tiller.protocol import Batch

    g = torch.Generator().manual_seed(0)
    batches = [Batch({"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 2, generator=g)}) for _ in range(3)]
    one = MLPRegressionWorker(seed=1, strategy="fsdp")
    one.optimizer = torch.optim.Adam(one.model.parameters(), lr=0.05)
    for b in batches:
        one.train_step(b, micro=2)
    for key, value in one.state_dict().items():
        torch.testing.assert_close(r0["state"][key], value, atol=1e-5, rtol=0)


def _shared_forward_rank(rank: int, port: int, model_dir: str, strategy: str, out: dict) -> None:
    import torch

    from tiller.distributed import context
    from tiller.models.loading import load_causal_lm
    from tiller.workers.common import position_ids_from_mask, response_forward

    torch.set_num_threads(1)
    context.init_distributed(rank, 2, "127.0.0.1", port, backend="gloo", timeout_s=60)
    try:
        torch.manual_seed(0)
        module = load_causal_lm(model_dir).train()
        model = context.wrap_model(module, strategy=strategy)
        # rank 0: one prompt sampled 3 times (shared path); rank 1: distinct prompts and one-token
        # responses (no prompt repeats and nothing after the prompt: locally that is the plain path)
        if rank == 0:
            prompts, responses = torch.tensor([[0, 11, 12]] * 3), torch.tensor([[21, 22], [23, 0], [24, 25]])
        else:
            prompts, responses = torch.tensor([[0, 11, 12], [13, 14, 15]]), torch.tensor([[21, 0], [26, 0]])
        pmask, rmask = (prompts != 0).long(), (responses != 0).long()
        ids, attn = torch.cat([prompts, responses], 1), torch.cat([pmask, rmask], 1)
        res = {}
        for step in range(2):  # two micro-batches: the second syncs gradients
            context.set_grad_sync(model, step == 1)
            logits, t_used = response_forward(model, ids, attn, 3, rmask, logits_to_keep=True, share_prompts=True)
            (logits.log_softmax(-1)[..., 5] * rmask[:, :t_used]).sum().backward()
        with torch.no_grad():
            full = module(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
        res["t_used"] = t_used
        res["maxdiff"] = float(((logits.detach() - full[:, 2:2 + t_used]) * rmask[:, :t_used, None]).abs().max())
        res["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        out[rank] = res
    finally:
        context.destroy_distributed()


# CI time: DDP's buffer broadcasts in the fast lane, FSDP2's all-gathers (the same lockstep rule) in the slow one
@pytest.mark.parametrize("strategy", [pytest.param("fsdp", marks=pytest.mark.slow), "ddp"])
def test_shared_prompt_forward_keeps_ranks_in_lockstep(tiny_model_dir, strategy):
    # a rank with repeated prompts runs two forwards per micro-batch; a rank without must run two as well,
    # or FSDP2's all-gathers / DDP's buffer broadcasts pair up wrongly and the group hangs
    out = mp.Manager().dict()
    mp.spawn(_shared_forward_rank, args=(_free_port(), str(tiny_model_dir), strategy, out), nprocs=2, join=True)
    assert out[0]["t_used"] == 2 and out[1]["t_used"] == 1
    for rank in (0, 1):
        assert out[rank]["maxdiff"] < 1e-4, (strategy, out[rank])
    assert out[0]["grad_norm"] > 0 and abs(out[0]["grad_norm"] - out[1]["grad_norm"]) < 1e-4 * out[0]["grad_norm"]


def _compiled_layers_rank(rank: int, port: int, model_dir: str, out: dict) -> None:
    import torch

    from tests.trainer.test_packed_forward import micro_batch
    from tiller.algos.entropy import logprobs_from_logits
    from tiller.distributed import context
    from tiller.models.compile import compile_layers
    from tiller.models.loading import load_causal_lm
    from tiller.workers.packed import packed_response_forward

    torch.set_num_threads(1)
    context.init_distributed(rank, 2, "127.0.0.1", port, backend="gloo", timeout_s=120)
    try:
        ids, mask, rmask, P = micro_batch([7, 3, 5], [9, 2, 5], seed=rank)  # each rank its own rows
        for compiled in (False, True):
            torch.manual_seed(0)
            module = load_causal_lm(model_dir).train()
            # the actor's order: the layers compiled, then sharded
            state = compile_layers(module, "k", "aot_eager") if compiled else None
            model = context.wrap_model(module, strategy="fsdp")
            for _ in range(2):  # two micro-batches, gradients accumulated
                logits, t = packed_response_forward(model, ids, mask, P, rmask)
                loss = (logprobs_from_logits(logits.float(), ids[:, P:P + t]) * rmask[:, :t]).sum()
                loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
            out[(rank, compiled)] = (float(loss.detach()), grad_norm, None if state is None else state.error)
    finally:
        context.destroy_distributed()


def test_compiled_layers_under_fsdp2_equal_eager(tiny_model_dir):
    """actor.use_torch_compile under FSDP2 across two processes: the compiled layers (traced with aot_eager), sharded
    after compiling, give the eager run's loss and summed gradient norm on every rank."""
    out = mp.Manager().dict()
    mp.spawn(_compiled_layers_rank, args=(_free_port(), str(tiny_model_dir), out), nprocs=2, join=True)
    for rank in (0, 1):
        (loss, norm, _), (c_loss, c_norm, error) = out[(rank, False)], out[(rank, True)]
        assert error is None
        assert abs(c_loss - loss) <= 1e-5 * abs(loss) and abs(c_norm - norm) <= 1e-5 * norm, (rank, out)
    assert out[(0, False)][1] == out[(1, False)][1]  # (the norm of the summed gradient: the same on both ranks)
