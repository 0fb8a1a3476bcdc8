"""Sequence packing: bins, no cross-contamination (packed == unpacked loss and gradients), invariance."""

from __future__ import annotations

import pytest
import torch

from tiller.data.packing import collate_packed, pack_bins
from tiller.data.sft import SFTExample, shifted_labels
from tiller.models.loading import load_causal_lm
from tiller.trainer.sft import SFTJob


def test_pack_bins_first_fit_decreasing():
    # lengths 5 4 3 3 2, capacity 8: 5 -> bin0 (room 3); 4 -> bin1 (room 4); 3 -> bin0 (room 0);
    # 3 -> bin1 (room 1); 2 -> bin2
    assert pack_bins([5, 4, 3, 3, 2], 8) == [[0, 2], [1, 3], [4]]
    assert pack_bins([10, 1], 4) == [[0], [1]]  # an over-long sequence gets a bin of its own


def test_collate_packed_positions_restart_and_pad_segment():
    a = SFTExample([1, 2, 3], shifted_labels([1, 2, 3], [0, 1, 1]))
    b = SFTExample([4, 5], shifted_labels([4, 5], [0, 1]))
    batch = collate_packed([[a, b], [b]], pad_id=0)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [4, 5, 0, 0, 0]]
    # a's last token (3) must not predict b's first token (4): label -100 there
    assert batch["labels"].tolist() == [[2, 3, -100, 5, -100], [5, -100, -100, -100, -100]]


def _examples(n: int, seed: int = 0) -> list[SFTExample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(4, 14, (1,), generator=g))
        ids = torch.randint(5, 500, (length,), generator=g).tolist()
        prompt = int(torch.randint(1, length - 1, (1,), generator=g))
        out.append(SFTExample(ids, shifted_labels(ids, [0] * prompt + [1] * (length - prompt))))
    return out


def _loss_and_grads(model, job, examples):
    model.zero_grad(set_to_none=True)
    norm = job.normalizer(examples)
    total = 0.0
    for micro in job.micro_batches(examples):
        loss, _ = job.loss(model, micro, norm)
        loss.backward()
        total += loss.item()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, grads


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_llama_dir"])
def test_packed_equals_unpacked(request, fixture):
    """Same sequences: padded one per row vs packed several per row give the same loss and gradients."""
    model = load_causal_lm(request.getfixturevalue(fixture)).train()
    examples = _examples(10)
    padded = SFTJob(pad_id=0, micro_batch_size=3, packing=False)
    packed = SFTJob(pad_id=0, micro_batch_size=2, packing=True, pack_length=32)
    assert len(packed.micro_batches(examples)) < len(padded.micro_batches(examples))
    loss_a, grads_a = _loss_and_grads(model, padded, examples)
    loss_b, grads_b = _loss_and_grads(model, packed, examples)
    assert abs(loss_a - loss_b) < 1e-5
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, atol=1e-5, rtol=1e-4)


def test_packed_attention_needs_use_cache_false(tiny_model_dir):
    """Guard of the transformers behaviour `forward_logits` relies on (see tiller.data.packing)."""
    model = load_causal_lm(tiny_model_dir).eval()
    ex = _examples(2, seed=1)
    batch = collate_packed([ex], pad_id=0)
    with torch.no_grad():
        split = torch.cat([model(torch.tensor([e.input_ids]), use_cache=False).logits[0] for e in ex])
        packed = model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        leaky = model(batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
    torch.testing.assert_close(packed, split, atol=1e-5, rtol=1e-4)
    n0 = len(ex[0].input_ids)
    assert (leaky[n0:] - split[n0:]).abs().max() > 1e-2  # with a cache the 2nd sequence sees the 1st


def test_micro_batch_size_does_not_change_the_step_gradient(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir).train()
    examples = _examples(6, seed=2)
    loss_1, grads_1 = _loss_and_grads(model, SFTJob(0, micro_batch_size=1), examples)
    loss_6, grads_6 = _loss_and_grads(model, SFTJob(0, micro_batch_size=6), examples)
    assert abs(loss_1 - loss_6) < 1e-5
    for name, g in grads_6.items():
        torch.testing.assert_close(grads_1[name], g, atol=1e-5, rtol=1e-4)


def test_default_pack_length():
    from tiller.trainer.sft import default_pack_length

    # lengths 10, 20, 30: mean 20 -> 4 x 20 = 80 > longest 30; capped by max_length
    ex = [SFTExample([1] * n, [-100] * n) for n in (10, 20, 30)]
    assert default_pack_length(ex, 512) == 80
    assert default_pack_length(ex, 64) == 64
    assert default_pack_length([SFTExample([1] * 100, [-100] * 100)] + ex, 512) == 160  # mean 40 -> 160


@pytest.mark.parametrize("model_type,attn", [("gpt_oss", "eager"), ("mistral", "sdpa"), ("mistral", "eager"),
                                             ("gemma2", "eager")])
def test_packed_rows_equal_each_sequence_alone_on_sliding_window_models(layer_kind_dir, model_type, attn):
    """tiller builds the packed rows' mask itself (causal within each sequence, each layer kind's window): gpt-oss's
    forward does not pass position ids to transformers' mask functions, so transformers' own packed-sequence
    detection let its sequences see each other (logits off by 0.6 on this model)."""
    from tiller.data.packing import forward_output

    model = load_causal_lm(layer_kind_dir(model_type), attn_implementation=attn).eval()
    seqs = [torch.randint(5, 400, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 9, 14)]
    batch = {"input_ids": torch.cat(seqs)[None], "position_ids": torch.cat([torch.arange(len(s)) for s in seqs])[None]}
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
        packed = forward_output(model, batch).logits[0]
    assert float((alone - packed).abs().max()) < 2e-5


def test_packing_is_refused_for_recurrent_layers(layer_kind_dir, tmp_path, capsys):
    """Qwen3.5's Gated DeltaNet state would run from one packed sequence into the next: `tiller sft data.packing=true`
    stops before training, naming the key (exit 2)."""
    import pandas as pd

    from tiller.cli import main

    rows = [{"messages": [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i + 1)}]}
            for i in range(8)]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    code = main(["sft", f"model.partial_pretrain={layer_kind_dir('qwen3_5_text')}",
                 f"data.train_files=[{tmp_path / 'train.parquet'}]", "data.messages_key=messages", "data.packing=true",
                 "data.micro_batch_size_per_gpu=4", "data.train_batch_size=8", "trainer.total_epochs=1",
                 f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]"])
    assert code == 2
    assert "data.packing=True: model_type 'qwen3_5_text' has recurrent layers (linear_attention)" in \
        capsys.readouterr().err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.safetensors"))


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("loss_kind", ["nll", "dft"])
def test_use_liger_runs_the_head_with_the_logprobs_and_gives_the_same_step(tiny_model_dir, packing, loss_kind,
                                                                             monkeypatch, capsys):
    """model.use_liger: the LM head runs with the log-probs of the labelled tokens only (`head_logprobs_and_entropy`,
    chunks of 8 here): the step's loss and every gradient (the tied head's too) equal the logits path's, and no tensor
    over the vocabulary is larger than a chunk's logits (the logits path makes [rows, length, V]); a model it does not
    fit says so once and computes the logits whole; refused with label smoothing and in the other jobs."""
    import tiller.trainer.sft as sft_module
    from tests.trainer.test_packed_forward import _Largest
    from tiller.algos.entropy import head_logprobs_and_entropy
    from tiller.config import load_config
    from tiller.config.jobs import DPOConfig, validate_job
    from tiller.errors import ConfigError

    monkeypatch.setattr(sft_module, "head_logprobs_and_entropy",
                        lambda *a, **k: head_logprobs_and_entropy(*a, **k, chunk_size=8))
    model = load_causal_lm(tiny_model_dir).train()
    vocab, hidden = model.get_output_embeddings().weight.shape
    examples = _examples(6, seed=3)
    runs = []
    for fused in (False, True):
        job = SFTJob(0, micro_batch_size=3, packing=packing, pack_length=32, loss_kind=loss_kind, fuse_head=fused)
        seen = []
        with _Largest(lambda t: t.shape[-1] == vocab and t.shape[-2] != hidden, seen):
            runs.append((*_loss_and_grads(model, job, examples), max(seen)))
    (loss_a, grads_a, big_a), (loss_b, grads_b, big_b) = runs
    assert abs(loss_a - loss_b) < 1e-5 and big_b <= 8 * vocab < big_a
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, atol=1e-5, rtol=1e-4)
    model.lm_head = torch.nn.Sequential(model.lm_head)  # no plain Linear: the logits path, said once
    job = SFTJob(0, micro_batch_size=3, fuse_head=True)
    micro = job.micro_batches(examples)[0]
    job.loss(model, micro, 10.0)
    job.loss(model, micro, 10.0)
    assert capsys.readouterr().err.count("model.use_liger=True: its LM head is a Sequential") == 1
    with pytest.raises(ConfigError, match="label_smoothing"):
        SFTJob(0, 3, fuse_head=True, label_smoothing=0.1)
    with pytest.raises(ConfigError, match="model.use_liger=True: the LM head run with the log-probs is SFT's"):
        load_config(["model.partial_pretrain=x", "data.train_files=[y]", "model.use_liger=true"], schema=DPOConfig,
                    validate=validate_job)
