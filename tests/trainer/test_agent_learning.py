"""The learning check of examples/agent_calculator.py: an agent written only against `openai.AsyncOpenAI` trains
through `tiller rl`'s endpoint, and GRPO raises held-out success well above the no-tool baseline (measured in the
same run) and above where the warm-up left it. ~10 min on 2 busy cores."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~11 min on 2 busy cores: over the suite's 600 s default
def test_grpo_through_the_openai_endpoint_beats_the_no_tool_baseline(tmp_path):
    spec = importlib.util.spec_from_file_location("agent_calculator", ROOT / "examples" / "agent_calculator.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--out", str(tmp_path), "--steps", "40", "--test-freq", "20", "--warmup-target", "0.25"])
    assert result["no_tool_baseline"] <= 0.05  # a 2M model does not learn to multiply in the warm-up
    assert result["final_success"] >= result["no_tool_baseline"] + 0.4
    assert result["final_success"] >= result["warmup_success"] + 0.2  # the gain is GRPO's, through the endpoint
