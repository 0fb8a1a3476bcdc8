"""`tiller data filter-difficulty` (Skywork-OR1 offline filtering) end to end on the tiny model.

The samples are real (the native engine, k per prompt); the scorer is a batch reward function that marks the
first `extra_info.solve` of each prompt's k samples right, so every prompt's pass rate is known: solve / k.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tiller.cli import main as cli
from tiller.evaluation.difficulty import in_band, parse_band, pass_rates, summarize
from tiller.errors import ConfigError
from tiller.tasks.arithmetic import make_row

K = 8
SOLVE = [0, 1, 2, 4, 7, 8, 3]  # pass rates 0, 1/8, 2/8, 4/8, 7/8, 1, 3/8
FAST = ["actor_rollout_ref.rollout.dtype=float32", "data.max_response_length=4", "data.apply_chat_template=false"]

REWARD = '''
from collections import Counter


def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    """Prompt i's first extra_info["solve"] samples are right, the rest wrong (samples arrive in order)."""
    seen, out = Counter(), []
    for info in extra_infos:
        out.append({"score": 1.0 if seen[info["index"]] < info["solve"] else 0.0})
        seen[info["index"]] += 1
    return out
'''


def _rows():
    rows = []
    for i, solve in enumerate(SOLVE):
        row = make_row(10 + i, 20 + i, "train", i)
        row["extra_info"]["solve"] = solve
        rows.append(row)
    return rows


@pytest.fixture()
def task(tmp_path):
    from tiller.data.rl_dataset import write_rows

    reward = tmp_path / "solve.py"
    reward.write_text(REWARD)
    return {"parquet": write_rows(_rows(), tmp_path / "train.parquet"),
            "jsonl": write_rows(_rows(), tmp_path / "train.jsonl"),
            "reward": ["reward_model.reward_manager=batch", f"custom_reward_function.path={reward}"]}


def _run(model, data, out, *extra, k=K):
    return cli(["data", "filter-difficulty", "--model", str(model), "--data", str(data), "--out", str(out),
                "--k", str(k), "--no-progress", *extra, *FAST])


def test_default_band_drops_never_and_all_solved_and_keeps_the_schema(tiny_model_dir, task, tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "kept" / "train_kept.parquet"
    assert _run(tiny_model_dir, task["parquet"], out, *task["reward"]) == 0
    table = pq.read_table(out)
    kept = table.to_pylist()
    # default band 0.1:0.9 keeps 1/8, 2/8, 4/8, 7/8, 3/8 (input order); drops 0/8 and 8/8
    assert [r["extra_info"]["index"] for r in kept] == [1, 2, 3, 4, 6]
    assert [r["pass_rate"] for r in kept] == [1 / 8, 2 / 8, 4 / 8, 7 / 8, 3 / 8]
    src = pq.read_table(task["parquet"])
    assert table.schema.remove(table.schema.get_field_index("pass_rate")) == src.schema  # same columns and types
    assert kept[0]["prompt"] == _rows()[1]["prompt"] and kept[0]["reward_model"] == _rows()[1]["reward_model"]

    png = out.with_name("train_kept_pass_rates.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(out.with_name("train_kept_summary.json").read_text())
    assert summary["num_prompts"] == 7 and summary["num_kept"] == 5
    assert summary["num_never_solved"] == 1 and summary["num_all_solved"] == 1
    assert summary["histogram"] == {"0/8": 1, "1/8": 1, "2/8": 1, "3/8": 1, "4/8": 1, "5/8": 0, "6/8": 0, "7/8": 1,
                                    "8/8": 1}
    assert summary["k"] == K and summary["keep"] == [0.1, 0.9] and summary["sampling"]["n"] == K
    assert summary["sampling"]["temperature"] == 1.0 and summary["num_tokens"] > 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["train_kept.parquet", "train_kept_pass_rates.png",
                                                             "train_kept_summary.json"]  # no temp files left


def test_band_edges_are_inclusive_and_jsonl_stays_jsonl(tiny_model_dir, task, tmp_path):
    out = tmp_path / "kept.jsonl"
    assert _run(tiny_model_dir, task["jsonl"], out, "--keep", "0.25:0.875", *task["reward"]) == 0
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["pass_rate"] for r in kept] == [0.25, 0.5, 0.875, 0.375]  # both edges kept
    assert _run(tiny_model_dir, task["jsonl"], out, "--keep", "0.5:0.5", *task["reward"]) == 0
    assert [json.loads(line)["extra_info"]["index"] for line in out.read_text().splitlines()] == [3]
    assert _run(tiny_model_dir, task["jsonl"], out, "--keep", "0:1", *task["reward"]) == 0
    assert len(out.read_text().splitlines()) == 7


def test_real_scorer_runs_and_pass_rates_are_multiples_of_one_over_k(tiny_model_dir, task, tmp_path):
    """The default arithmetic scorer (no custom function): the untrained model's rates are whatever they are,
    but each is solved / k, the kept rows are exactly those in the band, and the samples are k distinct draws."""
    out = tmp_path / "kept.jsonl"
    assert _run(tiny_model_dir, task["jsonl"], out, "--keep", "0:1", k=4) == 0
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(kept) == 7
    assert all(r["pass_rate"] * 4 == int(r["pass_rate"] * 4) for r in kept)
    summary = json.loads(out.with_name("kept_summary.json").read_text())
    assert summary["sampling"]["n"] == 4 and sum(summary["histogram"].values()) == 7


def test_bad_input_is_one_line_naming_the_flag_exit_2(tiny_model_dir, task, tmp_path, capsys):
    nogt = tmp_path / "nogt.jsonl"
    nogt.write_text(json.dumps({"data_source": "tiller/arithmetic", "prompt": "1+1="}) + "\n")
    cases = [
        (["--data", str(tmp_path / "nope.parquet")], "--data"),
        (["--keep", "0.9:0.1"], "--keep"),
        (["--keep", "1.5"], "--keep"),
        (["--keep", "0.2:1.5"], "--keep"),
        (["--keep", "a:b"], "--keep"),
        (["--k", "0"], "--k"),
        (["--k", "1.5"], "--k"),
        (["--model", str(tmp_path / "no_model")], "no_model"),
        (["--out", str(tmp_path / "x.jsonl")], "--out"),  # the input is parquet
        (["--data", str(nogt), "--out", str(tmp_path / "o.jsonl")], "no ground truth"),  # the rule scorer needs it
    ]
    for args, flag in cases:
        argv = ["data", "filter-difficulty", "--model", str(tiny_model_dir), "--data", str(task["parquet"]), "--out",
                str(tmp_path / "o.parquet"), *args]
        assert cli(argv) == 2, args
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if "error:" in line]  # (model loading may log above it)
        assert len(errors) == 1 and flag in errors[0] and "Traceback" not in err, (args, err)
    assert not (tmp_path / "o.parquet").exists() and not (tmp_path / "o.jsonl").exists()


def test_pure_helpers_with_worked_numbers():
    # acc of 2 prompts x 4 samples: prompt 0 solves 1 of 4, prompt 1 solves 4 of 4 (acc is thresholded at 0.5)
    rates = pass_rates(np.array([1, 0, 0, 0.2, 1, 1, 0.9, 0.6]), 4)
    assert rates.tolist() == [0.25, 1.0]
    assert in_band(np.array([0.0, 0.1, 0.5, 0.9, 1.0]), 0.1, 0.9).tolist() == [False, True, True, True, False]
    assert parse_band("0.1:0.9") == (0.1, 0.9) and parse_band("0:1") == (0.0, 1.0)
    for bad in ("0.9:0.1", "1.5", "-0.1:0.5", "0.1:0.2:0.3", "x:0.5"):
        with pytest.raises(ConfigError, match="--keep"):
            parse_band(bad)
    s = summarize(np.array([0.0, 0.25, 1.0, 0.5]), np.array([False, True, False, True]), 4, 0.1, 0.9)
    assert s["num_kept"] == 2 and s["num_below_band"] == 1 and s["num_above_band"] == 1
    assert s["histogram"] == {"0/4": 1, "1/4": 1, "2/4": 1, "3/4": 0, "4/4": 1}
    assert s["pass_rate_mean"] == pytest.approx(0.4375) and s["pass_rate_mean_kept"] == pytest.approx(0.375)
