"""`bench/serve.py` end to end on a 2M model (tiller's servers only): every server row, the rounds, the ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~30-60 s: a bench script end to end (the batcher's own tests are in the fast lane)
def test_bench_serve_interleaves_rounds_and_reports_medians():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--requests", "8", "--tokens", "4",
                           "--repeats", "2", "--engines", "native,hf", "--no-vllm", "--eager"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    rows = [r for r in lines if "server" in r]
    assert sorted((r["server"], r["seeded"]) for r in rows) == [
        ("tiller serve --engine hf", False), ("tiller serve --engine hf", True),
        ("tiller serve --engine native", False), ("tiller serve --engine native", True)]
    for r in rows:
        assert len(r["tok_s_runs"]) == 2 and min(r["tok_s_runs"]) <= r["tok_s"] <= max(r["tok_s_runs"])
        assert r["stats"]["requests"] == 9  # 8 + the warm-up, counted per round
    native = [r for r in rows if r["server"].endswith("native")]
    # every request carries one prompt: after the first prefill the prompt cache serves the rest
    assert all(r["stats"]["prompt_cache_hits"] >= 7 for r in native)
    ratios = [r for r in lines if "server" not in r]
    assert len(ratios) == 2 and all(v["tiller serve --engine hf"] == 1.0
                                    for r in ratios for k, v in r.items() if k.startswith("tok_s_ratio"))
