"""TR-DPO's reference updates (algorithm.ref_model_sync_steps / ref_model_mixup_alpha; TRL's sync_ref_model): the
reference after optimizer step k is alpha x policy_k + (1 - alpha) x reference_(k-1) on every N-th step, kept in the
checkpoints, so a resumed run has the uninterrupted run's reference."""

from __future__ import annotations

import pytest
import torch

from tests.sft.conftest import job_overrides, write_jsonl
from tests.sft.test_sft_preference import _rows
from tiller.config import load_config
from tiller.config.jobs import DPOConfig, KTOConfig, validate_job
from tiller.errors import ConfigError
from tiller.models.ref_sync import RefSync, mix_into
from tiller.trainer.preference import train_dpo, train_kto


def _weights(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {k: v for k, v in AutoModelForCausalLM.from_pretrained(path).named_parameters()}


def _cfg(schema, tiny_model_dir, train, run, **extra):
    return load_config(job_overrides(tiny_model_dir, train, run, **{
        "data.train_batch_size": 4, "data.micro_batch_size_per_gpu": 4, "optim.lr": 1e-2,
        "trainer.total_training_steps": 3, "trainer.save_freq": 1, "trainer.export_hf": False, **extra}),
        schema=schema, validate=validate_job)


def test_mix_into_and_the_step_counter():
    ref, pol = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with torch.no_grad():
        ref.weight.fill_(1.0), pol.weight.fill_(3.0), ref.bias.zero_(), pol.bias.fill_(2.0)
    sync = RefSync(2, 0.25, "k")
    assert not sync.after_optimizer_step(ref, pol) and torch.equal(ref.weight, torch.ones(2, 2))
    assert sync.after_optimizer_step(ref, pol)  # the 2nd step: 0.25 x 3 + 0.75 x 1 = 1.5
    assert torch.allclose(ref.weight, torch.full((2, 2), 1.5)) and torch.allclose(ref.bias, torch.full((2,), 0.5))
    with pytest.raises(ConfigError, match="'weight' is \\(2, 2\\), the policy's \\(3, 2\\)"):
        mix_into(ref, torch.nn.Linear(2, 3), 0.5, "k")


def test_dpo_reference_follows_the_policy_every_n_steps_and_resumes(tiny_model_dir, tmp_path):
    train = write_jsonl(tmp_path / "d.jsonl", _rows(8))
    run = tmp_path / "sync"
    train_dpo(_cfg(DPOConfig, tiny_model_dir, train, run, **{"algorithm.ref_model_sync_steps": 2,
                                                             "algorithm.ref_model_mixup_alpha": 0.4}))
    ck = lambda step, part: run / "checkpoints" / f"global_step_{step}" / part  # noqa: E731
    start, pol2 = _weights(tiny_model_dir), _weights(ck(2, "model"))
    ref1, ref2, ref3 = _weights(ck(1, "ref")), _weights(ck(2, "ref")), _weights(ck(3, "ref"))
    for k in start:
        assert torch.equal(ref1[k], start[k])  # step 1: not an N-th step, the reference is the start
        torch.testing.assert_close(ref2[k], 0.4 * pol2[k] + 0.6 * start[k], rtol=0, atol=1e-6)
        assert torch.equal(ref3[k], ref2[k])
    assert any(not torch.equal(pol2[k], start[k]) for k in start)  # the policy moved
    # resume from step 1: the same reference and policy at step 3 as the uninterrupted run (read from checkpoint 2)
    again = tmp_path / "again"
    train_dpo(_cfg(DPOConfig, tiny_model_dir, train, again, **{
        "algorithm.ref_model_sync_steps": 2, "algorithm.ref_model_mixup_alpha": 0.4,
        "trainer.total_training_steps": 2}))
    train_dpo(_cfg(DPOConfig, tiny_model_dir, train, again, **{
        "algorithm.ref_model_sync_steps": 2, "algorithm.ref_model_mixup_alpha": 0.4}))
    for part in ("ref", "model"):
        got, want = _weights(again / "checkpoints" / "global_step_3" / part), _weights(ck(3, part))
        assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in want), part
    # and a frozen reference differs: the sync changed the run
    frozen = tmp_path / "frozen"
    train_dpo(_cfg(DPOConfig, tiny_model_dir, train, frozen))
    assert not (frozen / "checkpoints" / "global_step_3" / "ref").exists()


def test_kto_reference_follows_too_and_refusals_name_the_key(tiny_model_dir, tmp_path):
    rows = [{"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"} for r in _rows(4)
            for k in ("chosen", "rejected")]
    train = write_jsonl(tmp_path / "k.jsonl", rows)
    run = tmp_path / "kto"
    train_kto(_cfg(KTOConfig, tiny_model_dir, train, run, **{"algorithm.ref_model_sync_steps": 1,
                                                             "algorithm.ref_model_mixup_alpha": 1.0,
                                                             "trainer.total_training_steps": 1}))
    ck = run / "checkpoints" / "global_step_1"
    ref, pol = _weights(ck / "ref"), _weights(ck / "model")
    assert all(torch.equal(ref[k], pol[k]) for k in pol)  # alpha 1: the reference is the policy
    with pytest.raises(ConfigError, match="ref_model_sync_steps: refused with LoRA"):
        _cfg(DPOConfig, tiny_model_dir, train, tmp_path / "l", **{"algorithm.ref_model_sync_steps": 2,
                                                                  "model.lora_rank": 4})
    with pytest.raises(ConfigError, match="ref_model_mixup_alpha in \\(0, 1\\]"):
        _cfg(KTOConfig, tiny_model_dir, train, tmp_path / "a", **{"algorithm.ref_model_sync_steps": 2,
                                                                  "algorithm.ref_model_mixup_alpha": 0})
