"""`bench/fused_head.py` runs and reports what the fused LM head saves: no tensor over the vocabulary larger than a
chunk's logits, where the unfused path makes the whole [K, V]."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_fused_head_reports_both_ways():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "fused_head.py"), "--tokens", "600", "--hidden", "16",
                          "--vocab", "1000", "--repeats", "1", "--threads", "1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["unfused_largest_vocab_tensor"] == 600 * 1000
    assert row["fused_largest_vocab_tensor"] == 256 * 1000  # the eager chunk's logits (256 rows)
    assert row["unfused_s"] > 0 and row["fused_s"] > 0 and row["fused_over_unfused_time"] > 0
