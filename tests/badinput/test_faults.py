"""Faults of issue #40 (part A): a config interpolation to a missing key, a `defaults:` cycle, parquet files that are
empty or not parquet (every reader), `tiller report` on a damaged metrics file, `tiller export` of damaged weights,
a disk that fills while a checkpoint is written. Each exits with one error line naming the key, file or path, and
leaves no half-written output behind."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.badinput.test_bad_input import _fill, _rl, _sft
from tiller.cli import main
from tiller.models import checkpoint as ckpt_mod


def _error_line(capsys, argv, code):
    """Run the CLI once: it exits `code` without a traceback; returns its last error line."""
    got = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert got == code, f"{argv}: exit {got}, stderr:\n{err}"
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert errors, err
    return errors[-1]


@pytest.fixture(scope="module")
def fws(tmp_path_factory, tiny_model_dir):
    """Scratch files: good arithmetic data, broken parquet files, YAML files whose defaults form cycles."""
    from tiller.tasks import arithmetic

    root = tmp_path_factory.mktemp("faults")
    arithmetic.write_task(root / "arith", n_train=8, n_test=4, seed=0)
    good = (root / "arith" / "train.parquet").read_bytes()
    (root / "empty.parquet").write_bytes(b"")
    (root / "text.parquet").write_text("prompt,answer\n1+1=,2\n")
    (root / "json.parquet").write_text(json.dumps({"prompt": "1+1=", "ground_truth": "2"}) + "\n")
    (root / "cut.parquet").write_bytes(good[: len(good) // 2])
    (root / "a.yaml").write_text("defaults:\n  - b\n  - _self_\n")
    (root / "b.yaml").write_text("defaults:\n  - a\n")
    (root / "self.yaml").write_text("defaults: [self]\n")
    (root / "grp").mkdir()
    (root / "main.yaml").write_text("defaults:\n  - grp: one\n  - _self_\n")
    (root / "grp" / "one.yaml").write_text("defaults:\n  - /main\n")
    (root / "fine.yaml").write_text("defaults:\n  - fine_base\n  - _self_\ntrainer:\n  project_name: p\n")
    (root / "fine_base.yaml").write_text("trainer:\n  experiment_name: e\n")
    (root / "sft.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "response": str(i + 1)}) + "\n"
                                            for i in range(8)))
    (root / "interp.yaml").write_text("trainer:\n  project_name: ${trainer.nope}\n")
    return root


INTERPOLATION = [
    (["trainer.experiment_name=${nope.x}"], "trainer.experiment_name", "'nope.x' does not exist"),
    (["trainer.project_name=run_${data.nothing}"], "trainer.project_name", "'data.nothing' does not exist"),
    (["data.train_files=[a.parquet,${trainer.nope}]"], "data.train_files.1", "'trainer.nope' does not exist"),
    (["--config", "{ws}/interp.yaml"], "trainer.project_name", "'trainer.nope' does not exist"),
]


@pytest.mark.parametrize("extra, key, target", INTERPOLATION, ids=[f"interp-{i}" for i in range(len(INTERPOLATION))])
def test_interpolation_to_a_missing_key(capsys, fws, extra, key, target):
    argv = ["config", "show", *_fill(extra, fws, "")]
    line = _error_line(capsys, argv, 2)
    assert f"{key} = " in line and target in line, line


@pytest.mark.parametrize("name, cycle", [("a", "a.yaml -> b.yaml -> a.yaml"), ("self", "self.yaml -> self.yaml"),
                                         ("main", "main.yaml -> grp/one.yaml -> main.yaml")])
def test_defaults_cycle(capsys, fws, name, cycle):
    line = _error_line(capsys, ["config", "show", "--config", str(fws / f"{name}.yaml")], 2)
    assert f"cycle ({cycle})" in line, line


def test_defaults_without_a_cycle_still_compose(capsys, fws):
    assert main(["config", "show", "--config", str(fws / "fine.yaml")]) == 0
    out = capsys.readouterr().out
    assert "project_name: p" in out and "experiment_name: e" in out


# every command that reads prompt / training rows, with {bad} for the file
READERS = {
    "rl": [*_rl(Path("{ws}")), "actor_rollout_ref.model.path={model}", "data.train_files=[{bad}]"],
    **{job: [*_sft("{ws}", job), "model.partial_pretrain={model}", "data.train_files=[{bad}]"]
       for job in ("sft", "rm", "dpo", "kto")},
    "eval": ["eval", "actor_rollout_ref.model.path={model}", "data.val_files=[{bad}]"],
    "generate": ["generate", "--data", "{bad}", "--out", "{ws}/gen.jsonl", "--model", "{model}"],
    "filter-difficulty": ["data", "filter-difficulty", "--model", "{model}", "--data", "{bad}", "--out",
                          "{ws}/kept.parquet", "--k", "2"],
}
BAD_PARQUET = [("empty", "empty (0 bytes)"), ("text", "not a parquet file"), ("json", "name it .jsonl"),
               ("cut", "cut short")]
PARQUET_CASES = [(r, f, w) for r in READERS for f, w in BAD_PARQUET[:2]] + [("rl", f, w) for f, w in BAD_PARQUET[2:]] \
    + [("sft", "cut", "cut short"), ("generate", "json", "name it .jsonl")]


@pytest.mark.parametrize("reader, name, word", PARQUET_CASES, ids=[f"{r}-{n}" for r, n, _ in PARQUET_CASES])
def test_bad_parquet_every_reader(capsys, fws, tiny_model_dir, reader, name, word):
    bad = fws / f"{name}.parquet"
    argv = [a.replace("{bad}", str(bad)) for a in _fill(READERS[reader], fws, tiny_model_dir)]
    line = _error_line(capsys, argv, 2)
    assert str(bad) in line and word in line, line
    assert not (fws / "gen.jsonl").exists() and not (fws / "kept.parquet").exists()


def test_config_explain_counts_no_rows_of_a_bad_parquet(capsys, fws):
    """`tiller config explain` (and the batch line `tiller rl` prints first) reads only the row count: unknown."""
    assert main(["config", "explain", f"data.train_files=[{fws}/empty.parquet]"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "unknown (training files not readable)" in out


@pytest.mark.parametrize("lines, skipped", [
    ([b'{"step": 1, "a": 1.0}', b'{"step": 2, "a": \xff\xfe 2.0}', b'{"step": 3, "a": 3.0}'], 1),
    ([b'{"step": 1, "a": 1.0}', b'{"step": 2, "a": 2.0}', b'{"step": 3, "a": 3'], 1),  # cut by a kill
    ([b'\x80\x81', b'{"step": 1, "a": 1.0}', b'{"step": 2, "a": "caf\xe9"}', b'{"step": 3, "a": 3.0}', b'{"st'], 3),
])
def test_report_skips_unreadable_lines(capsys, tmp_path, lines, skipped):
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines))
    assert main(["report", str(tmp_path), "--no-plots"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and f"skipped {skipped} unreadable line" in warnings[0], err


def test_report_writes_plots_past_a_bad_line(capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1, "actor/pg_loss": 1.0}\n\xff\n{"step": 2, "actor/pg_loss": 0.5}\n')
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "plots" / "main.png").stat().st_size > 0


@pytest.fixture(scope="module")
def saved_ckpt(tmp_path_factory, tiny_model_dir):
    """A run dir with one real checkpoint of the tiny model (weights, tokenizer, config)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path_factory.mktemp("export") / "run"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ckpt_mod.save_checkpoint(run / "checkpoints", 1, model, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir))
    return run


def _damage(run, tmp_path, how):
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    model_dir = bad / "checkpoints" / "global_step_1" / "model"
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    if how == "half":
        weights.write_bytes(data[: len(data) // 2])
    elif how == "one_byte_short":
        weights.write_bytes(data[:-1])
    elif how == "header_only":
        weights.write_bytes(data[:6])
    elif how == "wider_config":
        config = json.loads((model_dir / "config.json").read_text())
        config["intermediate_size"] *= 2
        (model_dir / "config.json").write_text(json.dumps(config))
    elif how == "more_layers":
        config = json.loads((model_dir / "config.json").read_text())
        config["num_hidden_layers"] += 1
        config.pop("layer_types", None)
        (model_dir / "config.json").write_text(json.dumps(config))
    return bad


@pytest.mark.parametrize("how, word", [("half", "truncated"), ("one_byte_short", "truncated"),
                                       ("header_only", "truncated"), ("wider_config", "do not fit"),
                                       ("more_layers", "missing")])
def test_export_refuses_damaged_weights(capsys, saved_ckpt, tmp_path, how, word):
    bad = _damage(saved_ckpt, tmp_path, how)
    out = tmp_path / "exported"
    line = _error_line(capsys, ["export", str(bad), "--to", str(out)], 2)
    assert word in line and str(bad) in line, line
    assert not out.exists() and not list(tmp_path.glob(".exported*"))


def test_export_of_a_good_checkpoint_still_works(capsys, saved_ckpt, tmp_path):
    assert main(["export", str(saved_ckpt), "--to", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


def _fill_then_enospc(obj, path):
    path.write_bytes(b"partial")  # the disk took some bytes, then filled
    _enospc()


@pytest.mark.parametrize("stage", ["model", "optimizer", "state", "marker"])
def test_disk_full_while_saving_a_checkpoint(monkeypatch, tmp_path, stage):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    root = tmp_path / "checkpoints"
    ckpt_mod.save_checkpoint(root, 1, model, optimizer=optimizer)
    if stage == "model":
        monkeypatch.setattr(ckpt_mod, "_save_module", _enospc)
    elif stage == "marker":
        monkeypatch.setattr(ckpt_mod, "write_text_atomic", _enospc)
    else:
        real = ckpt_mod._torch_save
        name = f"{stage}.pt"
        monkeypatch.setattr(ckpt_mod, "_torch_save",
                            lambda obj, path: (_fill_then_enospc if path.name == name else real)(obj, path))
    with pytest.raises(OSError) as caught:
        ckpt_mod.save_checkpoint(root, 2, model, optimizer=optimizer)
    from tiller.errors import describe_os_error

    line = describe_os_error(caught.value)
    assert caught.value.errno == errno.ENOSPC
    assert "No space left on device" in line and line.endswith(str(root / "global_step_2")), line
    assert "global_step_1" in line  # the newest good checkpoint, named
    assert sorted(p.name for p in root.iterdir()) == ["global_step_1", ckpt_mod.MARKER]
    assert ckpt_mod.latest_checkpoint(root) == root / "global_step_1"


def test_disk_full_during_a_training_run(capsys, monkeypatch, fws, tiny_model_dir):
    """`tiller sft`, 2 steps saved each step; the disk fills at step 2: exit 1, one line, step 1 still the newest."""
    real = ckpt_mod._torch_save

    def writer(obj, path):
        (_fill_then_enospc if path.parent.name.startswith("global_step_2") else real)(obj, path)

    monkeypatch.setattr(ckpt_mod, "_torch_save", writer)
    run = fws / "run_enospc"
    argv = _sft(fws, "sft", f"model.partial_pretrain={tiny_model_dir}", f"data.train_files=[{fws}/sft.jsonl]",
                "trainer.total_training_steps=2",
                "trainer.save_freq=1", f"trainer.default_local_dir={run}")
    line = _error_line(capsys, argv, 1)
    assert "No space left on device" in line and str(run / "checkpoints" / "global_step_2") in line, line
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["global_step_1", ckpt_mod.MARKER]
    assert (root / ckpt_mod.MARKER).read_text().strip() == "1"


def _with_bad_ground_truth(fws, name, row, data_source, ground_truth, top_level=False):
    """The arithmetic train rows as JSONL with row `row` given `data_source` and a ground truth of another type."""
    from tiller.data.rl_dataset import read_rows

    rows = read_rows(fws / "arith" / "train.parquet")
    rows[row]["data_source"] = data_source
    if top_level:
        del rows[row]["reward_model"]
        rows[row]["ground_truth"] = ground_truth
    else:
        rows[row]["reward_model"] = {"style": "rule", "ground_truth": ground_truth}
    path = fws / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GROUND_TRUTH = [  # (name, row, data_source, ground truth, top-level field, words of the error)
    ("gt_dict", 3, "tiller/arithmetic", {"answer": "4"}, False, "row 3: field reward_model.ground_truth", "a dict"),
    ("gt_list", 0, "openai/gsm8k", ["18", "19"], True, "row 0: field ground_truth", "a list"),
    ("gt_bool", 5, "math", True, False, "row 5: field reward_model.ground_truth", "a bool"),
    ("gt_code", 7, "humaneval", 42, False, "row 7: field reward_model.ground_truth", "a test spec"),
]


@pytest.mark.parametrize("name, row, source, truth, top, where, what", GROUND_TRUTH, ids=[c[0] for c in GROUND_TRUTH])
def test_ground_truth_of_the_wrong_type(capsys, fws, tiny_model_dir, name, row, source, truth, top, where, what):
    path = _with_bad_ground_truth(fws, name, row, source, truth, top)
    argv = [*_rl(fws), f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{path}]",
            f"trainer.default_local_dir={fws}/run_{name}"]
    line = _error_line(capsys, argv, 2)
    assert f"{path} {where}: the scorer of data_source {source!r}" in line and what in line, line
    assert "reward_model.bad_ground_truth=count" in line, line


@pytest.mark.parametrize("command", ["eval", "filter-difficulty"])
def test_ground_truth_of_the_wrong_type_other_readers(capsys, fws, tiny_model_dir, command):
    path = _with_bad_ground_truth(fws, "gt_other", 2, "tiller/arithmetic", {"x": 1})
    argv = [a.replace("{bad}", str(path)).replace("kept.parquet", "kept.jsonl")
            for a in _fill(READERS[command], fws, tiny_model_dir)]
    line = _error_line(capsys, argv, 2)
    assert not (fws / "kept.jsonl").exists()
    assert f"{path} row 2: field reward_model.ground_truth" in line and "a dict" in line, line


def test_ground_truth_of_the_wrong_type_counted(capsys, fws, tiny_model_dir):
    """reward_model.bad_ground_truth=count: the run goes on, the row's 2 samples score 0 and are counted."""
    path = _with_bad_ground_truth(fws, "gt_count", 3, "tiller/arithmetic", {"answer": "4"})
    run = fws / "run_gt_count"
    argv = [*_rl(fws), f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{path}]",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "algorithm.adv_estimator=grpo",
            f"trainer.default_local_dir={run}", "reward_model.bad_ground_truth=count"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: 1 rows of data.train_files have a ground truth their scorer cannot compare" in err, err
    assert "reward/bad_ground_truth: 2 samples of this run scored 0" in err.strip().splitlines()[-1], err
    (metrics,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics["reward/bad_ground_truth"] == 2.0


@pytest.mark.parametrize("source, truth, bad", [
    ("tiller/arithmetic", "42", False), ("tiller/arithmetic", 42, False), ("tiller/arithmetic", {"a": 1}, True),
    ("openai/gsm8k", 18.5, False), ("openai/gsm8k", ["18"], True), ("math", False, True),
    ("humaneval", {"test": "", "entry_point": "f"}, False), ("humaneval", "{}", False), ("humaneval", 3, True),
    ("reasoning_gym/countdown", {"anything": 1}, False), ("unknown/source", {"x": 1}, False),
])
def test_ground_truth_problem(source, truth, bad):
    from tiller.rewards.registry import ground_truth_problem

    assert (ground_truth_problem(source, truth) is not None) == bad


def test_doctests_of_the_checks():
    import doctest

    from tiller.rewards import registry
    from tiller.trainer import rundir

    assert doctest.testmod(registry).failed == 0 and doctest.testmod(rundir).failed == 0
