"""What a command writes into a log (stdout and stderr not terminals): results, tiller's lines, no noise.

No progress bars (a bar in a file is a run of carriage returns that runs into the results table), no
transformers "Loading weights" / "Writing model shards" bars, and no bf16 decision line (`tiller env` reports
it; other commands log it at DEBUG) (issue 41, item 7).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_eval_into_a_log_has_the_table_and_no_bars(tiny_model_dir, tmp_path):
    from tiller.tasks import arithmetic

    arithmetic.write_task(tmp_path, n_train=4, n_test=4, seed=0)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), HF_HUB_OFFLINE="1")
    env.pop("TQDM_DISABLE", None)
    log = tmp_path / "eval.log"
    with open(log, "w") as f:  # one file for both streams, as `tiller eval ... > eval.log 2>&1`
        proc = subprocess.run([sys.executable, "-m", "tiller.cli", "eval", "--model", str(tiny_model_dir), "--data",
                               str(tmp_path / "test.parquet"), "--out", str(tmp_path / "e.json"),
                               "data.max_response_length=2", "actor_rollout_ref.rollout.dtype=bfloat16"],
                              stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "mean@1" in text and "tiller/arithmetic" in text  # the results table
    assert "\r" not in text and "it/s" not in text and "Loading weights" not in text, text
    assert "CPU bf16 compute" not in text, text
