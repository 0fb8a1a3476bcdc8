"""Tracker outputs (JSONL, TensorBoard, console, config.yaml, optional W&B / MLflow) and `tiller report`."""

import json
import math
import sys
import types

import numpy as np
import pytest
import torch
import yaml

from tiller.cli import main as cli_main
from tiller.errors import UserError
from tiller.tracking import Tracker, timer
from tiller.tracking.report import read_metrics, summary_rows


def test_jsonl_tensorboard_console_and_config(tmp_path, capsys):
    tr = Tracker(tmp_path, loggers="console,jsonl,tensorboard", config={"algorithm": {"adv_estimator": "grpo"}},
                 total_steps=3)
    tr.log({"critic/score/mean": torch.tensor(0.25), "actor/pg_loss": np.float32(-1.5), "actor/entropy": 2,
            "val-core/gsm8k/acc/mean@1": 0.5, "bad": float("nan"), "inf": float("inf"), "skip_me": [1, 2]}, step=1)
    # flushed each step: readable before close (a killed run keeps its metrics)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "critic/score/mean": 0.25, "actor/pg_loss": -1.5, "actor/entropy": 2,
                     "val-core/gsm8k/acc/mean@1": 0.5, "bad": None, "inf": None}]
    tr.log({"critic/score/mean": 0.75}, step=2)
    tr.close()
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {"algorithm": {"adv_estimator": "grpo"}}
    out = capsys.readouterr().out
    assert "step 1/3" in out and "score 0.25" in out and "pg_loss -1.5" in out and "val/gsm8k 0.5" in out

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scores = [(e.step, e.value) for e in acc.Scalars("critic/score/mean")]
    assert scores == [(1, 0.25), (2, 0.75)]


def test_resume_drops_rows_after_checkpoint(tmp_path):
    with Tracker(tmp_path, loggers=["jsonl"]) as tr:
        for step in range(1, 6):
            tr.log({"x": step}, step=step)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "x": ')  # torn write of a killed run
    with Tracker(tmp_path, loggers=["jsonl"], resume_from_step=3) as tr:
        tr.log({"x": 40}, step=4)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_verl_file_logger(tmp_path, monkeypatch):
    """trainer.logger=file: verl's FileLogger path and line format; a resume keeps the lines up to its step."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.delenv("VERL_FILE_LOGGER_ROOT", raising=False)
    with Tracker(tmp_path / "run", loggers=["file"], project="proj", experiment="exp") as tr:
        for step in (1, 2, 3):
            tr.log({"critic/score/mean": step / 4, "bad": float("nan")}, step=step)
    path = tmp_path / "proj" / "exp.jsonl"  # ./<project>/<experiment>.jsonl
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0] == {"step": 1, "data": {"critic/score/mean": 0.25, "bad": None}} and len(rows) == 3
    with Tracker(tmp_path / "run", loggers=["file"], project="proj", experiment="exp", resume_from_step=2) as tr:
        tr.log({"critic/score/mean": 9.0}, step=3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    with Tracker(tmp_path / "run", loggers="file", project="proj", experiment="exp") as tr:  # a new run: afresh
        tr.log({"x": 1.0}, step=1)
    assert len(path.read_text().splitlines()) == 1
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "logs"))
    with Tracker(tmp_path / "run", loggers="file", project="p2", experiment="e2") as tr:
        tr.log({"x": 1.0}, step=1)
    assert (tmp_path / "logs" / "p2" / "e2.jsonl").exists()
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "one.jsonl"))
    with Tracker(tmp_path / "run", loggers="file", project="p2", experiment="e2") as tr:
        tr.log({"x": 2.0}, step=5)
    assert json.loads((tmp_path / "one.jsonl").read_text()) == {"step": 5, "data": {"x": 2.0}}


def test_logger_errors_name_the_fix(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="tensorbord.*valid: console, jsonl, tensorboard, wandb, mlflow, file"):
        Tracker(tmp_path, loggers=["console", "tensorbord"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(UserError, match=r"pip install 'tiller\[wandb\]'"):
        Tracker(tmp_path, loggers=["wandb"])
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(UserError, match=r"tiller\[mlflow\]"):
        Tracker(tmp_path, loggers="mlflow")


def test_wandb_and_mlflow_receive_metrics(tmp_path, monkeypatch):
    calls = []
    run = types.SimpleNamespace(log=lambda m, step: calls.append(("wandb", m, step)),
                                finish=lambda: calls.append(("wandb-finish",)))
    fake_wandb = types.SimpleNamespace(init=lambda **kw: calls.append(("wandb-init", kw["project"], kw["config"])) or run)
    fake_mlflow = types.SimpleNamespace(
        set_tracking_uri=lambda uri: calls.append(("ml-uri", uri.startswith("file:"))),
        set_experiment=lambda name: None, start_run=lambda run_name: None,
        log_params=lambda p: calls.append(("ml-params", p)),
        log_metrics=lambda m, step: calls.append(("ml", m, step)), end_run=lambda: calls.append(("ml-end",)))
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with Tracker(tmp_path, loggers=["wandb", "mlflow"], project="p", config={"a": {"b": 1}}) as tr:
        tr.log({"val-core/x/acc/mean@4": 0.5, "note": "text"}, step=7)
    assert ("wandb-init", "p", {"a": {"b": 1}}) in calls
    assert ("wandb", {"val-core/x/acc/mean@4": 0.5}, 7) in calls
    assert ("ml-params", {"a.b": "1"}) in calls
    assert ("ml", {"val-core/x/acc/mean_4": 0.5}, 7) in calls  # "@" is not allowed in MLflow names
    assert ("ml-uri", True) in calls and ("wandb-finish",) in calls and ("ml-end",) in calls


def test_timer_adds_and_accumulates():
    metrics = {}
    with timer("gen", metrics):
        sum(range(1000))
    first = metrics["timing_s/gen"]
    with timer("gen", metrics):
        pass
    assert 0 < first <= metrics["timing_s/gen"]


def write_run(run_dir, steps=6):
    with Tracker(run_dir, loggers=["jsonl"]) as tr:
        for s in range(1, steps + 1):
            m = {"critic/score/mean": 0.1 * s, "actor/pg_loss": 1.0 / s, "actor/entropy": 3 - 0.2 * s,
                 "response_length/mean": 10 + s, "timing_s/step": 0.5}
            if s % 2 == 0:
                m["val-core/arith/acc/mean@1"] = 0.2 + 0.1 * s
            tr.log(m, step=s)


def test_report_writes_pngs_and_summary(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "critic/sc')  # killed mid-line: skipped
    assert cli_main(["report", str(run)]) == 0
    pngs = sorted(p.name for p in (run / "plots").glob("*.png"))
    assert pngs == ["actor.png", "critic.png", "main.png", "response_length.png", "timing_s.png", "val-core.png"]
    for p in (run / "plots").glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    out = capsys.readouterr().out
    assert "critic/score/mean" in out and "val-core/arith/acc/mean@1" in out and "wrote 6 plots" in out
    rows = {r["metric"]: r for r in summary_rows(read_metrics(run / "metrics.jsonl"))}
    # score = 0.1 * step for steps 1..6: first 0.1, last 0.6; val acc logged at steps 2, 4, 6: 0.4, 0.6, 0.8
    assert math.isclose(rows["critic/score/mean"]["first"], 0.1) and math.isclose(rows["critic/score/mean"]["last"], 0.6)
    assert rows["val-core/arith/acc/mean@1"]["n"] == 3 and math.isclose(rows["val-core/arith/acc/mean@1"]["max"], 0.8)
    assert math.isclose(rows["actor/pg_loss"]["min"], 1 / 6)


def test_report_user_errors(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path / "absent")]) == 2
    assert "absent" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli_main(["report", str(tmp_path / "empty")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_main_png_has_a_kl_panel_only_when_the_run_has_kl():
    from tiller.tracking.report import main_panels

    run = {"critic/score/mean": ([1, 2], [0.1, 0.2]), "actor/ppo_kl": ([1, 2], [1e-4, 2e-4]),
           "actor/pg_loss": ([1, 2], [0.0, 0.1])}
    assert [t for t, _ in main_panels(run)] == ["reward", "policy loss"]  # ppo_kl is the update's size, not KL
    with_kl = run | {"actor/kl_loss": ([1, 2], [0.01, 0.02])}
    assert ("KL", ["actor/kl_loss"]) in main_panels(with_kl)
