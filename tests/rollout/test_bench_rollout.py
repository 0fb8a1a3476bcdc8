"""`bench/rollout.py`'s floor for the fixed workload: worked numbers, and a real run that never beats it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiller.rollout import SamplingParams
from tiller.rollout.fused_decode import can_pack, FusedDecoder

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_rollout", ROOT / "bench" / "rollout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fixed_floor_worked_numbers(qwen):
    model, _ = qwen
    fused = FusedDecoder(model, pack=False)
    cfg = model.config
    prompts, sampling = [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4, ignore_eos=True)
    body = sum(p.numel() for n, p in model.model.layers.named_parameters() if n.endswith("proj.weight"))
    head = model.lm_head.weight.numel()
    # prefill: 5 prompt tokens through the layers, the head on each prompt's last; then 3 decode steps x 2 rows
    flops = 2 * ((5 + 2 * 3) * body + (2 + 2 * 3) * head)
    # decode steps read columns from the row's first unmasked one through the new one: 4, 5, 6 and 3, 4, 5
    columns = (4 + 5 + 6) + (3 + 4 + 5)
    per_column = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    seconds = flops / 2e9 + columns * per_column / 5e9
    floor = _bench().fixed_floor(fused, prompts, sampling, gemm_gflops=2.0, dram_gbs=5.0)
    assert floor["native_floor_tok_s"] == pytest.approx(8 / seconds, rel=1e-3)
    assert (floor["floor_gemm_gflops"], floor["floor_dram_gbs"]) == (2.0, 5.0)


def test_bench_fixed_row_reports_a_floor_above_the_measured_rate(tiny_model_dir, tmp_path, qwen):
    if not can_pack(qwen[0]):
        pytest.skip("no oneDNN prepacking in this torch build: the bench prints no floor")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "rollout.py"), "--sizes", "2M", "--dtypes", "float32",
                           "--workloads", "fixed", "--engines", "native", "--prompts", "8", "--new-tokens", "8",
                           "--repeats", "1", "--model-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert row["floor_gemm_gflops"] > 0 and row["floor_dram_gbs"] > 0
    # the engine does its matmuls and more: it never runs faster than the floor measured in the same run
    assert row["native_floor_tok_s"] > row["native_tok_s"] > 0
    assert "floor_over_vllm" not in row  # no vLLM in this run


def test_gpu_profile_script_reports_a_decode_step(tmp_path):
    """`bench/gpu_profile.py` (the next GPU session's profile) runs on a CPU: its summary counts the static step's
    eager steps and a positive rate, and torch's table is written."""
    out = tmp_path / "prof"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_profile.py"), "--device", "cpu", "--engine",
                           "native-graphs", "--rows", "3", "--new-tokens", "5", "--model-dir", str(tmp_path / "m"),
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads((out / "profile.json").read_text())
    assert info["rows"] == 3 and info["tok_s"] > 0 and info["wall_s"] > 0
    # the decode steps' share: a difference of two timings (its sign is not checked on a loaded CPU), no GPU kernels
    assert info["prefill_wall_s"] > 0 and isinstance(info["step_wall_ms"], float)
    assert info["step_kernels"] == 0 and info["step_gpu_ms"] == 0 and info["step_kernels_by_calls"] == []
    assert info["graphs"]["eager"] > 0 and info["graphs"]["captures"] == 0  # (no CUDA: the step runs uncaptured)
    assert "Self CPU" in (out / "profile.txt").read_text()
