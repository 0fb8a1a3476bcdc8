"""A run dir holds one run (issue #40): a second process on it refuses naming the holder (a lock file with its pid,
stale ones detected); a checkpoint of another model is a mismatch (exit 2 naming both models and the ways out),
never damage to skip while metrics.jsonl and the marker are overwritten; a resume with other sampling settings says
what changed since the checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.badinput.test_bad_input import _rl
from tiller.cli import main
from tiller.models.checkpoint import MARKER
from tiller.trainer.rundir import LOCK_NAME, acquire_run_dir, release_run_dir

REPO = Path(__file__).resolve().parents[2]


def _env():
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tiller.tasks import arithmetic

    root = tmp_path_factory.mktemp("rundir")
    arithmetic.write_task(root / "arith", n_train=8, n_test=4, seed=0)
    return root


def _argv(data, run, model, *extra):
    return [*_rl(data, "algorithm.adv_estimator=grpo", f"actor_rollout_ref.model.path={model}",
                 f"trainer.default_local_dir={run}", "trainer.save_freq=1"), *extra]


@pytest.fixture(scope="module")
def trained(data, tiny_model_dir):
    """A run dir after one real GRPO step of the tiny model, with its checkpoint."""
    run = data / "trained"
    assert main(_argv(data, run, tiny_model_dir)) == 0
    assert (run / "checkpoints" / "global_step_1").is_dir() and not (run / LOCK_NAME).exists()
    return run


@pytest.fixture(scope="module")
def wider_model(tmp_path_factory, tiny_model_dir):
    """The tiny model's tokenizer with a model twice the size: same architecture, another shape."""
    from transformers import AutoTokenizer

    from tiller.models.checkpoint import save_pretrained_atomic
    from tiller.models.tiny import build_model

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return save_pretrained_atomic(tmp_path_factory.mktemp("wide") / "m", build_model(tok, "qwen2", n_params=2_000_000),
                                  tok)


def _records(run):
    return (run / "metrics.jsonl").read_bytes(), (run / "checkpoints" / MARKER).read_bytes()


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("which", ["wider", "llama"])
def test_resume_with_another_model_is_refused(capsys, trained, data, tmp_path, request, which):
    model = request.getfixturevalue("wider_model" if which == "wider" else "tiny_llama_dir")
    run = _copy(trained, tmp_path)
    before = _records(run)
    assert main(_argv(data, run, model, "trainer.total_training_steps=2")) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and "does not load" not in err
    assert "global_step_1 holds another model, Qwen2ForCausalLM (hidden" in line, line
    assert f"model.path={model}, {'Qwen2' if which == 'wider' else 'Llama'}ForCausalLM" in line, line
    assert "trainer.overwrite=true" in line and "trainer.resume_mode=disable" in line, line
    assert _records(run) == before and not (run / LOCK_NAME).exists()


@pytest.mark.slow  # a fresh `tiller rl` process imports torch and transformers: ~10 s before it refuses
def test_resume_with_another_model_in_a_real_process(trained, data, tmp_path, wider_model):
    """The same refusal from a real `tiller rl` process: exit 2, the last stderr line names both models."""
    run = _copy(trained, tmp_path)
    before = _records(run)
    argv = [sys.executable, "-m", "tiller.cli", *_argv(data, run, wider_model, "trainer.total_training_steps=2")]
    done = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "holds another model" in line and "hidden 160" in line and str(wider_model) in line, line
    assert _records(run) == before and not (run / LOCK_NAME).exists()


def test_overwrite_is_the_way_out(capsys, trained, data, tmp_path, wider_model):
    """trainer.overwrite=true replaces the other model's records and trains the configured model from step 0."""
    run = _copy(trained, tmp_path)
    assert main(_argv(data, run, wider_model, "trainer.overwrite=true")) == 0
    out = capsys.readouterr().out
    assert "trainer.overwrite=true: removed the earlier run's checkpoints, metrics.jsonl" in out, out
    saved = json.loads((run / "checkpoints" / "global_step_1" / "model" / "config.json").read_text())
    assert saved["hidden_size"] == json.loads((wider_model / "config.json").read_text())["hidden_size"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]


def test_resume_path_to_another_models_checkpoint(capsys, trained, data, tmp_path, wider_model):
    argv = _argv(data, tmp_path / "fresh", wider_model, "trainer.resume_mode=resume_path",
                 f"trainer.resume_from_path={trained}")
    assert main(argv) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "trainer.resume_from_path: checkpoint global_step_1 holds another model" in line, line


def test_every_checkpoint_damaged_leaves_the_records(capsys, trained, data, tmp_path, tiny_model_dir):
    run = _copy(trained, tmp_path)
    (run / "checkpoints" / "global_step_1" / "state.pt").write_bytes(b"cut")
    (run / "checkpoints" / "global_step_1" / "model" / "model.safetensors").write_bytes(b"cut")
    before = _records(run)
    assert main(_argv(data, run, tiny_model_dir, "trainer.total_training_steps=2")) == 2
    out, err = capsys.readouterr()
    assert "global_step_1 does not load" in out + err
    assert "none of its checkpoints loads" in err.strip().splitlines()[-1] and "trainer.overwrite=true" in err
    assert _records(run) == before


def test_resume_with_other_sampling_says_what_changed(capsys, trained, data, tmp_path, tiny_model_dir):
    run = _copy(trained, tmp_path)
    argv = _argv(data, run, tiny_model_dir, "trainer.total_training_steps=2", "actor_rollout_ref.rollout.n=4",
                 "actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "sampling changed" in line]
    assert lines == ["resuming global_step_1 with sampling changed since that checkpoint: rollout.n 2 -> 4; "
                     "rollout.temperature 1.0 -> 0.7"], lines
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


HOLD = ("import sys, time; from tiller.trainer.rundir import acquire_run_dir; acquire_run_dir(sys.argv[1]); "
        "print('held', flush=True); time.sleep(120)")


def _holder(run):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, env=_env(), text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_run_dir_is_refused_naming_the_holder(capsys, data, tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        assert main(_argv(data, run, tiny_model_dir)) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"trainer.default_local_dir={run} is in use by another tiller process (pid {holder.pid} " in line, line
        assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_is_taken_over(capsys, tmp_path):
    run = tmp_path / "run"
    holder = _holder(run)
    os.kill(holder.pid, signal.SIGKILL)  # killed: its lock file stays, its flock goes with it
    holder.wait()
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == holder.pid
    acquire_run_dir(run)
    try:
        assert f"took over a stale lock (pid {holder.pid} " in capsys.readouterr().err
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        release_run_dir(run)
    assert not (run / LOCK_NAME).exists()


def test_the_lock_is_released_on_exit(tmp_path):
    run = tmp_path / "run"
    code = "import sys; from tiller.trainer.rundir import acquire_run_dir; acquire_run_dir(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(run)], env=_env(), check=True)
    assert run.is_dir() and not (run / LOCK_NAME).exists()
    acquire_run_dir(run)  # and free for the next process
    release_run_dir(run)


GATED_REWARD = """
import os, time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    for _ in range(6000):  # the first step's reward waits (at most 5 minutes) until the test opens the gate
        if os.path.exists(os.environ["TILLER_TEST_GATE"]):
            break
        time.sleep(0.05)
    return 0.0
"""


@pytest.mark.slow
def test_two_rl_processes_on_one_run_dir(data, tmp_path, tiny_model_dir):
    """Two real `tiller rl` processes: the first holds the run dir (its reward function waits at a gate the test
    opens only after the second finished), the second refuses naming it, then the first trains to its end."""
    run, gate = tmp_path / "run", tmp_path / "gate"
    (tmp_path / "gated.py").write_text(GATED_REWARD)
    argv = [sys.executable, "-m", "tiller.cli", *_argv(data, run, tiny_model_dir, "trainer.total_training_steps=3",
                                                       f"custom_reward_function.path={tmp_path / 'gated.py'}",
                                                       "reward_model.timeout=600")]
    env = {**_env(), "TILLER_TEST_GATE": str(gate)}
    first = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)
    while not (run / LOCK_NAME).exists() and first.poll() is None:
        time.sleep(0.1)
    second = subprocess.run(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True,
                            timeout=300)
    gate.touch()
    assert first.wait(timeout=300) == 0, first.stderr.read()
    assert second.returncode == 2, second.stderr
    assert f"is in use by another tiller process (pid {first.pid} " in second.stderr.strip().splitlines()[-1]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3] and not (run / LOCK_NAME).exists()


def test_a_run_that_refuses_to_start_leaves_no_trace(capsys, data, tmp_path, tiny_model_dir):
    """A config error found after the run dir is taken (here the reward function's file is missing): exit 2, and
    the dirs the run made are gone; a dir that was there before stays, empty as it was."""
    missing = f"custom_reward_function.path={tmp_path / 'missing_reward.py'}"
    run = tmp_path / "new" / "run"
    assert main(_argv(data, run, tiny_model_dir, missing)) == 2
    assert "missing_reward.py" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "new").exists()
    there = tmp_path / "there"
    there.mkdir()
    assert main(_argv(data, there, tiny_model_dir, missing)) == 2
    assert there.is_dir() and not any(there.iterdir())


def test_a_refused_start_keeps_an_earlier_runs_records(capsys, trained, data, tmp_path, tiny_model_dir):
    """trainer.overwrite=true replaces an earlier run's records only once start-up has passed: a run refused after
    taking the dir leaves the records, and a file of the user's, as they were."""
    run = _copy(trained, tmp_path)
    (run / "notes.txt").write_text("mine")
    before = _records(run)
    argv = _argv(data, run, tiny_model_dir, "trainer.overwrite=true", "trainer.resume_mode=disable",
                 f"custom_reward_function.path={tmp_path / 'missing_reward.py'}")
    assert main(argv) == 2
    assert "missing_reward.py" in capsys.readouterr().err.strip().splitlines()[-1]
    assert _records(run) == before and (run / "notes.txt").read_text() == "mine" and not (run / LOCK_NAME).exists()
