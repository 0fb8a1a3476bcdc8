"""tiller.distributed.context on a real 2-process gloo group (torch.multiprocessing, no Ray):
collectives, and an FSDP2 checkpoint round trip (full model + full optimizer state) that resumes the
exact trajectory."""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, out: dict) -> None:
    import torch

    from tiller.distributed import context
    from tiller.distributed.testing import MLPRegressionWorker
    from tiller.protocol import Batch

    torch.set_num_threads(1)
    context.init_distributed(rank, 2, "127.0.0.1", port, backend="gloo", timeout_s=60)
    try:
        res = {"rank": context.rank(), "world": context.world_size(),
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
