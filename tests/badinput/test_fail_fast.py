"""A newcomer's mistakes are reported before any work and in one line (issue 41, items 3-6).

- A mistyped key is reported before anything is loaded or trained, by every command (the model path given
  here does not exist, so a command that loaded the model first would report the path instead of the key;
  `tiller demo` would start its warm-up).
- A missing model path that looks local fails at once; a hub id with no network fails after one connection
  try, with one line (no retry loop).
- serve / eval / generate given a run dir use its newest checkpoint's model; a LoRA checkpoint says to export.
- `tiller config explain` on a model path without config.json says the memory estimate was skipped.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from tiller.cli import main

NOWHERE = "/nonexistent/tiller-model"
TYPO = {"rl": "actor_rollout_ref.actor.optim.lrr=1", "sft": "optim.lrr=1"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tiller.tasks import arithmetic

    root = tmp_path_factory.mktemp("failfast")
    arithmetic.write_task(root, n_train=8, n_test=4, seed=0)
    (root / "sft.jsonl").write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
    return root


def _typo_cases(data):
    rl_typo, sft_typo = TYPO["rl"], TYPO["sft"]
    model, test, sft = f"actor_rollout_ref.model.path={NOWHERE}", data / "test.parquet", data / "sft.jsonl"
    return {
        "rl": (["rl", model, f"data.train_files=[{test}]", rl_typo], "lrr"),
        "eval": (["eval", "--model", NOWHERE, "--data", str(test), rl_typo], "lrr"),
        "generate": (["generate", "--model", NOWHERE, "--data", str(test), "--out", str(data / "g.jsonl"), rl_typo],
                     "lrr"),
        "filter-difficulty": (["data", "filter-difficulty", "--model", NOWHERE, "--data", str(test), "--out",
                               str(data / "kept.parquet"), rl_typo], "lrr"),
        "config-explain": (["config", "explain", model, rl_typo], "lrr"),
        **{job: ([job, f"model.partial_pretrain={NOWHERE}", f"data.train_files=[{sft}]", sft_typo], "lrr")
           for job in ("sft", "rm", "dpo", "kto", "spin")},
    }


@pytest.mark.parametrize("job", ["rl", "eval", "generate", "filter-difficulty", "config-explain",
                                 "sft", "rm", "dpo", "kto", "spin"])
def test_a_typo_is_reported_before_the_model_is_touched(job, data, capsys):
    argv, word = _typo_cases(data)[job]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert word in err[-1] and "Traceback" not in "\n".join(err), err


def test_demo_reports_a_typo_before_its_warm_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TILLER_CACHE", str(tmp_path / "cache"))
    assert main(["demo", "--out", str(tmp_path / "run"), "actor_rollout_ref.actor.optim.lrr=5e-5"]) == 2
    err = capsys.readouterr()
    assert "actor_rollout_ref.actor.optim.lr?" in err.err.splitlines()[-1]
    assert "warm-up" not in err.out and not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


def test_a_missing_local_model_path_fails_at_once(tmp_path, monkeypatch, capsys):
    """`runs/nope` has a parent that exists here, so it is a path, not a hub id: no network is tried."""
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def no_network(*a, **k):
        raise AssertionError("a local-looking path must not reach for the network")

    monkeypatch.setattr(socket, "create_connection", no_network)
    for path in ("runs/nope", "./nope", NOWHERE):
        assert main(["eval", "--model", path, "--data", str(tmp_path / "x.parquet")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not found" in err[0] and path.strip("./") in err[0], err


def test_a_hub_id_offline_fails_after_one_try(monkeypatch, capsys):
    from tiller.models import loading

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(loading, "_cached_on_hub", lambda repo: False)
    tries = []

    def unreachable(address, timeout=None):
        tries.append(address)
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    t0 = time.monotonic()
    with pytest.raises(loading.UserError, match="hub is unreachable") as err:
        loading.load_tokenizer("some-org/some-model-that-is-not-here")
    assert time.monotonic() - t0 < 5 and len(tries) == 1 and "\n" not in str(err.value)
    # offline by choice: no try at all
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(loading.UserError, match="HF_HUB_OFFLINE"):
        loading.load_causal_lm("some-org/some-model-that-is-not-here")
    assert len(tries) == 1


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir):
    """A run dir as `tiller rl` leaves it: metrics.jsonl and checkpoints/global_step_{1,2}/model (+ tokenizer)."""
    from transformers import AutoTokenizer

    from tiller.models.checkpoint import save_checkpoint
    from tiller.models.loading import load_causal_lm

    run = tmp_path_factory.mktemp("runs") / "demo"
    model, tok = load_causal_lm(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    for step in (1, 2):
        save_checkpoint(run / "checkpoints", step, model=model, tokenizer=tok)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


def test_serve_eval_and_generate_take_a_run_dir(run_dir, data, tmp_path, capsys):
    from tiller.serve.cli import _parser, build_served_model

    served = build_served_model(_parser().parse_args([str(run_dir), "--dtype", "float32"]))
    assert served.name == "demo"  # the run's name, not "model"
    err = capsys.readouterr().err
    assert "global_step_2" in err and "run dir" in err  # the newest checkpoint, announced
    assert main(["eval", "--model", str(run_dir), "--data", str(data / "test.parquet"), "--out",
                 str(tmp_path / "e.json"), "--no-progress", "data.max_response_length=2"]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["metrics"]
    assert main(["generate", "--model", str(run_dir), "--data", str(data / "test.parquet"), "--out",
                 str(tmp_path / "g.jsonl"), "data.max_response_length=2"]) == 0
    assert len((tmp_path / "g.jsonl").read_text().splitlines()) == 4


def test_a_run_dir_that_holds_no_full_model_says_what_to_pass(run_dir, tmp_path, capsys):
    import shutil

    lora = tmp_path / "lora_run"
    shutil.copytree(run_dir, lora)
    (lora / "checkpoints" / "global_step_2" / "model" / "config.json").unlink()
    (lora / "checkpoints" / "global_step_2" / "model" / "adapter_config.json").write_text("{}")
    empty = tmp_path / "fresh_run"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    for path, words in ((lora, ["tiller export", "--to DIR"]), (empty, ["no checkpoint"])):
        assert main(["serve", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(path) in err[0] and all(w in err[0] for w in words), err


def test_config_explain_on_a_placeholder_path_skips_the_memory_estimate(capsys):
    assert main(["config", "explain", "actor_rollout_ref.model.path=path/to/hf_model"]) == 0
    out = capsys.readouterr()
    assert "no config.json at path/to/hf_model: memory estimate skipped" in out.out
    assert "Repo id" not in out.out + out.err and "Traceback" not in out.err
