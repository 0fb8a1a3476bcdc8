"""Ray worker groups on CPU: 2 ranks (1 thread each) == 1 process; colocation; failures name the rank.

One Ray session for all Ray tests (tests/distributed/conftest.py; Ray start is ~5 s). Every group here is 2 actors of 1 CPU on a
2-CPU Ray cluster, so a second *split* group has no room while a *colocated* one fits.
"""

import pytest
import torch

ray = pytest.importorskip("ray")

from tiller import hostinfo  # noqa: E402
from tiller.distributed import WorkerError, create_worker_group  # noqa: E402
from tiller.distributed.testing import MLPRegressionWorker  # noqa: E402
from tiller.errors import ConfigError, UserError  # noqa: E402
from tiller.protocol import Batch  # noqa: E402

pytestmark = pytest.mark.ray


DRIVER_BF16 = "the driver's CPU bf16 decision (test_ray_groups)"


@pytest.fixture(scope="module")
def fsdp_group(ray_session):
    saved = hostinfo.bf16_decision()
    hostinfo.adopt_bf16_decision(hostinfo.Bf16Decision(saved.use_bf16, DRIVER_BF16))  # what the workers must take
    try:
        group = create_worker_group(MLPRegressionWorker, {"seed": 7, "strategy": "fsdp"}, backend="ray",
                                    world_size=2, cpus_per_worker=1, name="actor")
    finally:
        hostinfo.adopt_bf16_decision(saved)
    yield group
    group.shutdown()


def _batches(steps=3, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Batch({"x": torch.randn(n, 8, generator=g), "y": torch.randn(n, 2, generator=g)}) for _ in range(steps)]


def _run(group, batches, micro=None):
    losses = [group.execute("train_step", b, micro=micro, dispatch="dp")["loss"] for b in batches]
    return losses, group.execute("state_dict")


def _assert_same_run(a, b):
    (losses_a, state_a), (losses_b, state_b) = a, b
    assert losses_a == pytest.approx(losses_b, abs=1e-5)
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        torch.testing.assert_close(state_a[key], state_b[key], atol=1e-5, rtol=0)


def test_ranks_threads_and_process_group(fsdp_group):
    infos = fsdp_group.execute("info", dispatch="all")
    assert [i["rank"] for i in infos] == [0, 1]
    assert all(i["world_size"] == 2 and i["distributed"] and i["threads"] == 1 for i in infos)
    # the workers compute in the driver's CPU dtype: their own bf16 timing could say otherwise on a close host
    assert [i["bf16"] for i in infos] == [DRIVER_BF16] * 2
    assert len({i["pid"] for i in infos}) == 2


def test_fsdp2_two_ranks_equal_one_process(fsdp_group):
    # Losses are normalised by the all-reduced row count and FSDP2 sums gradients, so 2 x 4 rows
    # per step must give the 1 x 8-row SGD trajectory (up to float summation order).
    batches = _batches()
    local = create_worker_group(MLPRegressionWorker, {"seed": 7, "strategy": "fsdp"})
    _assert_same_run(_run(fsdp_group, batches), _run(local, batches))
    _assert_same_run(_run(fsdp_group, batches, micro=3), _run(local, batches, micro=3))
    # dp predict on 7 rows: padded to 8 over 2 ranks, merged back to 7 in order
    seven = batches[0].index(slice(0, 7))
    pred = fsdp_group.execute("predict", seven, dispatch="dp")
    torch.testing.assert_close(pred["pred"], local.execute("predict", seven)["pred"], atol=1e-6, rtol=0)
    assert pred["x"].shape == (7, 8)


def test_ddp_colocated_two_ranks_equal_one_process(fsdp_group):
    # colocated with the FSDP group: shares its 2 CPU bundles (a split group would not fit)
    ddp = create_worker_group(MLPRegressionWorker, {"seed": 11, "strategy": "ddp"}, backend="ray",
                              world_size=2, name="critic", colocate_with=fsdp_group)
    try:
        batches = _batches(seed=1)
        local = create_worker_group(MLPRegressionWorker, {"seed": 11, "strategy": "ddp"})
        _assert_same_run(_run(ddp, batches), _run(local, batches))
        # gradient accumulation (2 micro-batches of 2 rows per rank vs 4 of 2 in one process): DDP must
        # reduce once, after the last micro-batch, or the first micro-batch's gradient counts twice
        _assert_same_run(_run(ddp, batches, micro=2), _run(local, batches, micro=2))
        with pytest.raises(ConfigError, match="no room"):
            create_worker_group(MLPRegressionWorker, {}, backend="ray", world_size=2, name="reward",
                                placement_timeout_s=1.0)
    finally:
        ddp.shutdown()


def test_bf16_fsdp2_mixed_precision_close_to_fp32(fsdp_group):
    group = create_worker_group(MLPRegressionWorker, {"seed": 7, "param_dtype": torch.bfloat16}, backend="ray",
                                world_size=2, name="actor_bf16", colocate_with=fsdp_group)
    try:
        batches = _batches()
        losses, state = _run(group, batches)
        ref_losses, _ = _run(create_worker_group(MLPRegressionWorker, {"seed": 7}), batches)
        assert losses == pytest.approx(ref_losses, rel=2e-2)  # bf16 has ~3 significant digits
        assert all(v.dtype == torch.float32 for v in state.values())  # master weights stay fp32
    finally:
        group.shutdown()


def test_worker_errors_name_group_and_rank(fsdp_group):
    group = create_worker_group(MLPRegressionWorker, {}, backend="ray", world_size=2, name="actor_fail",
                                colocate_with=fsdp_group)
    try:
        # a UserError inside a worker reaches the driver as itself (the CLI exits 2)
        with pytest.raises(UserError, match="bad input on rank 1"):
            group.execute("fail", on_rank=1, how="user", peers_wait=False)
        with pytest.raises(WorkerError, match=r"'actor_fail' rank 0 \(pid .*\) raised in 'fail': ValueError"):
            group.execute("fail", on_rank=0, how="raise", peers_wait=False)
        pids = [i["pid"] for i in group.execute("info", dispatch="all")]  # still usable
        # rank 1 dies while rank 0 waits for it in a collective: the death is reported, not rank 0's
        # broken-connection error, and the group is shut down
        with pytest.raises(WorkerError, match=rf"'actor_fail' rank 1 \(pid {pids[1]} .*\) died during 'fail'") as info:
            group.execute("fail", on_rank=1, how="kill")
        assert info.value.died and info.value.rank == 1 and info.value.group == "actor_fail"
        with pytest.raises(WorkerError, match="shut down"):
            group.execute("info")
    finally:
        group.shutdown()
