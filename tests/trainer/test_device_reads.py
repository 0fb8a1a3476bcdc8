"""No host sync per micro-batch in the update (the static decode loop's: tests/rollout/test_graphed_decode.py).

On a GPU each read of a device value (`float(loss)`, `.tolist()`, boolean indexing, ...) and each blocking copy of a
host tensor to the device makes the host wait for the device's queue, and then the device for the host: once per
metric per micro-batch, the update stalls between one micro-batch's backward and the next one's forward. These tests
run the real code on a CPU under `tests.device_reads.DeviceReads`, which tells "device" tensors (made on `cpu:0`)
from the host's, and count what the host reads back."""

from __future__ import annotations

import collections

import pytest
import torch

from tests.device_reads import DEVICE, DeviceReads
from tests.trainer.test_dynamic_batches import _batch, _cfg

METRICS_READ = ("tolist", "workers/common.py:read_metrics")


def test_the_harness_sees_reads_of_device_values_only():
    host = torch.arange(6.0)
    with DeviceReads() as reads:
        float(host.sum()), host[host > 2], host.to(DEVICE, non_blocking=True)  # host work, and an async copy
        assert not reads.reads
        dev = host.to(DEVICE)  # a blocking copy: the stream waits
        y = (dev * 2).sum()
        float(y), dev[dev > 2], dev.tolist(), bool(dev.any())
        host.copy_(dev, non_blocking=True)  # an async copy back: no read
        float(host.sum())
        z = torch.zeros(3, device=DEVICE)
        z[torch.tensor([0, 2]).to(DEVICE, non_blocking=True)] = 1.0  # index by a device long tensor: no read
        buf = torch.empty(2, device=y.device)  # (`cpu` here: a host tensor until device values are written in)
        buf[:1] = y
        buf.tolist()
    kinds = collections.Counter(k for k, _ in reads.reads.elements())
    assert kinds == {"blocking copy to the device": 1, "__float__": 1, "__getitem__": 1, "tolist": 2, "__bool__": 1}


def _reads(worker, call: str, batch, micro_batches: int) -> collections.Counter:
    """tiller's own reads of one call; transformers' (its SDPA mask check, when a forward's prompts are padded: the
    mask is passed as None when none is) at most two a micro-batch."""
    worker.device = DEVICE
    with DeviceReads(worker.model) as reads:
        getattr(worker, call)(batch)
    theirs = sum(v for k, v in reads.reads.items() if k[1].endswith("(in transformers)"))
    assert theirs <= 2 * micro_batches, reads.reads
    return collections.Counter({k: v for k, v in reads.reads.items() if not k[1].endswith("(in transformers)")})


@pytest.mark.parametrize("packed", [False, True, "fused"])
def test_the_update_reads_its_metrics_once_per_mini_batch(tiny_model_dir, packed):
    """Actor and critic, one micro-batch or four: the host reads the device once per mini-batch (its metrics and
    gradient norm, together), whatever the micro-batch count; the batch's tensors reach the device without a
    blocking copy, the packing / trimming reads the host's copy; the log-prob and value passes read their result
    once. ("fused": packed, the LM head run with the log-probs, model.use_fused_kernels.)"""
    from tiller.workers.actor import ActorRolloutRefWorker
    from tiller.workers.critic import CriticWorker

    extra = ["actor_rollout_ref.model.use_remove_padding=True", "critic.model.use_remove_padding=True"] if packed \
        else []
    extra += ["actor_rollout_ref.model.use_fused_kernels=True"] if packed == "fused" else []
    batch = _batch()
    for micro in (8, 2):
        cfg = _cfg(tiny_model_dir, f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
                   f"critic.ppo_micro_batch_size_per_gpu={micro}", *extra)
        actor = ActorRolloutRefWorker(cfg, total_training_steps=1, need_ref=True)
        batch["ref_log_prob"] = actor.compute_ref_log_prob(batch)["ref_log_prob"]
        metrics = actor.update_actor(batch)
        assert _reads(actor, "update_actor", batch, 8 // micro) == {METRICS_READ: 1}, micro
        assert metrics["actor/pg_loss"] != 0 and metrics["actor/grad_norm"] > 0
        logp_read = {("cpu", "workers/actor.py:_batch_logp"): 1}
        assert _reads(actor, "compute_log_prob", batch, 8 // micro) == logp_read, micro
        critic = CriticWorker(cfg, total_training_steps=1)
        assert _reads(critic, "update_critic", batch, 8 // micro) == {METRICS_READ: 1}, micro
        values_read = {("cpu", "workers/critic.py:compute_values"): 1}
        assert _reads(critic, "compute_values", batch, 8 // micro) == values_read, micro


@pytest.mark.parametrize("packing", [False, True])
def test_an_sft_step_reads_its_metrics_once(tiny_model_dir, tmp_path, packing):
    """The SFT / reward-model / DPO / KTO loop (`tiller.trainer.loop`): one read a step (its metrics and gradient
    norm together), with one micro-batch or four; the run on `cpu:0` learns the same as on the host."""
    from tests.sft.conftest import MEMO, job_overrides, write_jsonl
    from tiller.config import load_config
    from tiller.config.jobs import SFTConfig, validate_job
    from tiller.trainer.sft import train_sft

    data = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": p, "response": r} for p, r in MEMO])
    losses = []
    for micro, device in ((8, "cpu"), (8, "cpu:0"), (2, "cpu:0")):
        cfg = load_config(job_overrides(tiny_model_dir, data, tmp_path / f"run-{micro}-{device}", **{
            "data.train_batch_size": 8, "data.micro_batch_size_per_gpu": micro, "data.packing": packing,
            "trainer.total_training_steps": 2, "trainer.device": device, "trainer.save_freq": 0,
            "trainer.export_hf": False}), schema=SFTConfig, validate=validate_job)
        with DeviceReads() as reads:
            losses.append(train_sft(cfg)["train/loss"])
        if device == "cpu:0":
            mine = {k: v for k, v in reads.reads.items() if not k[1].endswith("(in transformers)")}
            assert mine == {METRICS_READ: 2}, (micro, mine)
    assert losses[1] == pytest.approx(losses[0], rel=1e-6) and losses[2] == pytest.approx(losses[0], rel=1e-5)
