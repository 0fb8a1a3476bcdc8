"""`tiller sft|kto` under `torchrun --nproc_per_node 2` (gloo, CPU): the same loss curve as one process (1e-5),
with FSDP2 and DDP (each case ~18 s: the DDP and KTO ones are marked slow), an odd number of micro-batches per step (one rank runs a zero-weight padding copy), a checkpoint
and the exported model written once by rank 0."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sft.conftest import MEMO, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(job: str, overrides: list[str], nproc: int, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if nproc == 1:
        cmd = [sys.executable, "-m", "tiller.cli", job, *overrides]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={_free_port()}", "-m", "tiller.cli", job, *overrides]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["train/loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _base(model_dir, train, run_dir, *extra) -> list[str]:
    return [f"model.partial_pretrain={model_dir}", f"data.train_files=[{train}]", f"trainer.default_local_dir={run_dir}",
            "trainer.logger=[jsonl]", "optim.lr=3e-3", "optim.lr_scheduler=constant", "data.train_batch_size=6",
            "data.micro_batch_size_per_gpu=2", "trainer.total_training_steps=3", "trainer.num_threads=1", *extra]


@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("ddp", marks=pytest.mark.slow)])
def test_sft_two_ranks_match_one_process(tmp_path, tiny_model_dir, strategy):
    train = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": p, "response": r} for p, r in MEMO])
    _run("sft", _base(tiny_model_dir, train, tmp_path / "one"), 1, tmp_path)
    _run("sft", _base(tiny_model_dir, train, tmp_path / "two", f"trainer.strategy={strategy}"), 2, tmp_path)
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(one) == len(two) == 3 and one[0] != one[-1]  # it trains, so the curves say something
    assert two == pytest.approx(one, abs=1e-5, rel=1e-5)
    assert (tmp_path / "two" / "hf_model" / "config.json").exists()
    assert len(list((tmp_path / "two" / "checkpoints").glob("global_step_*"))) == 1


@pytest.mark.slow  # ~19 s: three process starts
def test_kto_two_ranks_match_one_process(tmp_path, tiny_model_dir):
    rows = [{"prompt": p, "completion": c, "label": ok} for p, r in MEMO
            for c, ok in ((r, True), (str(int(r) + 1), False))]
    train = write_jsonl(tmp_path / "kto.jsonl", rows)
    extra = ["algorithm.beta=0.5", "data.train_batch_size=6", "data.micro_batch_size_per_gpu=2"]
    _run("kto", _base(tiny_model_dir, train, tmp_path / "one", *extra), 1, tmp_path)
    _run("kto", _base(tiny_model_dir, train, tmp_path / "two", *extra, "trainer.strategy=fsdp"), 2, tmp_path)
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert one[0] != one[-1] and two == pytest.approx(one, abs=1e-5, rel=1e-5)


@pytest.mark.slow  # ~25 s: three process starts
def test_fsdp_checkpoint_resumes_on_the_same_curve(tmp_path, tiny_model_dir):
    train = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": p, "response": r} for p, r in MEMO])
    two = tmp_path / "two"
    _run("sft", _base(tiny_model_dir, train, two, "trainer.total_training_steps=2", "trainer.save_freq=1"), 2, tmp_path)
    _run("sft", _base(tiny_model_dir, train, two, "trainer.total_training_steps=3", "trainer.save_freq=1"), 2, tmp_path)
    _run("sft", _base(tiny_model_dir, train, tmp_path / "one"), 1, tmp_path)
    assert _losses(two) == pytest.approx(_losses(tmp_path / "one"), abs=1e-5, rel=1e-5)


@pytest.mark.slow  # ~25 s each: two torchrun starts (the split itself: tests/distributed/test_ulysses.py, fast)
@pytest.mark.parametrize("packing", ["true", "false"])
def test_sft_sequence_parallel_two_ranks_match_one_process(tmp_path, tiny_even_heads_dir, packing):
    """ulysses_sequence_parallel_size=2 on 2 ranks (FSDP2, 4 attention heads: 2 per rank): one data-parallel
    replica whose two ranks run half of every micro-batch's tokens (packed rows, or padded ones)."""
    train = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": p, "response": r} for p, r in MEMO])
    one, sp, stderr = _one_vs_split("sft", tmp_path, tiny_even_heads_dir, train, f"data.packing={packing}")
    assert "2 ranks = 1 data-parallel x 2 sequence-parallel" in stderr
    assert len(one) == len(sp) == 3 and one[0] != one[-1]
    assert sp == pytest.approx(one, abs=1e-5, rel=1e-5)


def _one_vs_split(job: str, tmp_path: Path, model_dir, train: Path, *extra: str):
    """`job` in one process and on 2 ranks with ulysses_sequence_parallel_size=2 (FSDP2): (the one process's loss
    curve, the split run's, the split run's stderr)."""
    extra = (*extra, "trainer.strategy=fsdp")
    _run(job, _base(model_dir, train, tmp_path / "one", *extra), 1, tmp_path)
    proc = _run(job, _base(model_dir, train, tmp_path / "sp", *extra, "ulysses_sequence_parallel_size=2"), 2,
                tmp_path)
    return _losses(tmp_path / "one"), _losses(tmp_path / "sp"), proc.stderr


def _curves(tmp_path: Path, key: str) -> tuple[list[float], list[float]]:
    """Metric `key` per step of the one-process run and of the split run (`_one_vs_split`)."""
    one, sp = ([json.loads(line)[key] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
               for run in ("one", "sp"))
    return one, sp


PAIRS = [{"prompt": p, "chosen": r, "rejected": str(int(r) + 1)} for p, r in MEMO]
SPLIT = "2 ranks = 1 data-parallel x 2 sequence-parallel"


def _split_run(job: str, tmp_path: Path, model_dir, rows: list[dict], metric: str, *extra: str):
    """`_one_vs_split` on `rows`: (one process's loss curve, the split run's, its stderr, (`metric` per step of
    each run))."""
    train = write_jsonl(tmp_path / f"{job}.jsonl", rows)
    one, sp, stderr = _one_vs_split(job, tmp_path, model_dir, train, *extra)
    return one, sp, stderr, _curves(tmp_path, metric)


@pytest.mark.slow  # ~20 s each: two torchrun starts (the split itself: tests/distributed/test_ulysses.py, fast)
@pytest.mark.parametrize("loss", ["dpo", "ipo"])
def test_dpo_sequence_parallel_two_ranks_match_one_process(tmp_path, tiny_even_heads_dir, loss):
    """tiller dpo ulysses_sequence_parallel_size=2 on 2 ranks: the policy's and the reference's forwards split, the
    per-token log-probs gathered; loss curve and reward margins are the one process's."""
    one, sp, stderr, (m_one, m_sp) = _split_run("dpo", tmp_path, tiny_even_heads_dir, PAIRS, "train/rewards/margins",
                                                f"algorithm.loss={loss}", "algorithm.beta=0.5")
    assert SPLIT in stderr and len(one) == len(sp) == 3 and one[0] != one[-1]
    assert sp == pytest.approx(one, abs=1e-5, rel=1e-5)
    assert m_sp == pytest.approx(m_one, abs=1e-5, rel=1e-4)  # metrics counted once, not per rank


@pytest.mark.slow  # ~35 s: two torchrun starts (the split itself: tests/distributed/test_ulysses.py, fast)
def test_rm_sequence_parallel_two_ranks_match_one_process(tmp_path, tiny_even_heads_dir):
    """tiller rm ulysses_sequence_parallel_size=2 on 2 ranks: each rank runs half of the pairs' tokens, the score
    head's per-token outputs are gathered and each sequence's last token read; the loss curve and the score gaps are
    the one process's (a score read at the wrong token, or counted on both ranks, would move them)."""
    one, sp, stderr, (gap_one, gap_sp) = _split_run("rm", tmp_path, tiny_even_heads_dir, PAIRS, "train/score_gap")
    assert SPLIT in stderr and len(one) == len(sp) == 3 and one[0] != one[-1]
    assert sp == pytest.approx(one, abs=1e-5, rel=1e-5)
    assert gap_sp == pytest.approx(gap_one, abs=1e-5, rel=1e-4)  # metrics counted once, not per rank


@pytest.mark.slow  # ~25 s: two torchrun starts (the split itself: tests/distributed/test_ulysses.py, fast)
def test_kto_sequence_parallel_two_ranks_match_one_process(tmp_path, tiny_even_heads_dir):
    """tiller kto ulysses_sequence_parallel_size=2 on 2 ranks: the policy's, the reference's and the KL pairs'
    forwards split; the loss curve and the KL baseline are the one process's (counted once, not per rank)."""
    rows = [{"prompt": p, "completion": c, "label": ok} for p, r in MEMO
            for c, ok in ((r, True), (str(int(r) + 1), False))]
    one, sp, stderr, (kl_one, kl_sp) = _split_run("kto", tmp_path, tiny_even_heads_dir, rows, "train/kl",
                                                  "algorithm.beta=0.5")
    assert SPLIT in stderr and len(one) == len(sp) == 3 and one[0] != one[-1]
    assert sp == pytest.approx(one, abs=1e-5, rel=1e-5)
    assert kl_sp == pytest.approx(kl_one, abs=1e-6, rel=1e-4) and any(k != 0 for k in kl_one[1:])
