"""`tiller trl COMMAND [TRL's flags]`: TRL's command line parsed as TRL parses it (against the Python config and, when
trl is installed, against TRL's own TrlParser), its errors (exit 2, one line naming the flag), and two runs end to end
through the installed entry points (sft, grpo with a built-in and a dotted-path reward)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiller.cli import main as tiller_main
from tiller.trl import GRPOConfig, ModelConfig
from tiller.trl.cli import parse
from tiller.trl.common import classify, field_table
from tiller.trl.fields import SCRIPT_FIELDS

ROOT = Path(__file__).resolve().parents[2]
GRPO_LINE = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o",
             "--reward_funcs", "accuracy_reward", "think_format_reward",  # a list: several values
             "--num_generations=4",  # --flag=value
             "--bf16", "false",  # an optional bool takes a value
             "--log_completions",  # a bool flag alone is True
             "--no_gradient_checkpointing",  # --no_<flag> for a bool that defaults to True
             "--max_completion_length", "none",  # TRL's parser: none for an optional number
             "--lr_scheduler_kwargs", '{"num_cycles": 1}',  # a dict field as JSON
             "--use_peft", "--lora_target_modules", "q_proj", "v_proj", "--use_cpu"]


def test_a_command_line_gives_the_python_config():
    script, args, model, mixture = parse("grpo", GRPO_LINE)
    assert dataclasses.asdict(args) == dataclasses.asdict(GRPOConfig(
        output_dir="o", num_generations=4, bf16=False, log_completions=True, gradient_checkpointing=False,
        max_completion_length=None, lr_scheduler_kwargs={"num_cycles": 1}, use_cpu=True))
    assert script.reward_funcs == ["accuracy_reward", "think_format_reward"] and script.dataset_name == "d"
    assert (model.model_name_or_path, model.use_peft, model.lora_target_modules) == ("m", True, ["q_proj", "v_proj"])
    assert dataclasses.asdict(model) == dataclasses.asdict(ModelConfig(
        model_name_or_path="m", use_peft=True, lora_target_modules=["q_proj", "v_proj"]))
    assert mixture.datasets == [] and type(args).__name__ == "GRPOConfig"


def test_an_empty_command_line_is_trls_defaults():
    """Fields left alone keep TRL's declared defaults (no notice), though HfArgumentParser converts some (debug "" ->
    None, include_num_input_tokens_seen "no" -> False) that TRL's post-init converts back."""
    import tiller.trl
    from tiller.trl.cli import COMMANDS

    for command, (config, script, _) in COMMANDS.items():
        objects = parse(command, ["--output_dir", "o"])
        for obj, name in zip(objects, (script, config, "ModelConfig", "DatasetMixtureConfig")):
            expected = getattr(tiller.trl, name)(**({"output_dir": "o"} if name == config else {}))
            assert dataclasses.asdict(obj) == dataclasses.asdict(expected), (command, name)
            assert classify(obj)[1] == [], (command, name)


def test_config_file_gives_defaults_the_command_line_overrides(tmp_path, monkeypatch):
    monkeypatch.delenv("TILLER_TRL_CLI_TEST", raising=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("env:\n  TILLER_TRL_CLI_TEST: '7'\nlearning_rate: 3.0e-6\nnum_generations: 8\n"
                      "reward_funcs: [think_format_reward]\ndatasets:\n  - path: a\n    split: dev\n")
    script, args, _, mixture = parse("grpo", ["--config", str(recipe), "--num_generations", "2", "--output_dir", "o"])
    assert (args.learning_rate, args.num_generations, script.reward_funcs) == (3e-6, 2, ["think_format_reward"])
    assert os.environ["TILLER_TRL_CLI_TEST"] == "7" and mixture.datasets == [{"path": "a", "split": "dev"}]
    # packing is SFT's field, not GRPO's: TRL's script ignores such a key, tiller refuses it
    sft_recipe = tmp_path / "sft.yaml"
    sft_recipe.write_text("packing: true\nmax_length: 64\n")
    with pytest.raises(Exception, match=r"--config .*sft.yaml: key --packing: not a flag of `tiller trl grpo`$"):
        parse("grpo", ["--config", str(sft_recipe)])
    _, sft_args, _, _ = parse("sft", ["--config", str(sft_recipe), "--packing", "false"])
    assert (sft_args.packing, sft_args.max_length) == (False, 64)


def test_same_objects_as_trls_own_parser(tmp_path):
    trl = pytest.importorskip("trl")
    from trl.scripts.grpo import GRPOScriptArguments

    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 3.0e-6\nmax_steps: 5\nbeta: 0.04\n")
    line = [*GRPO_LINE, "--config", str(recipe), "--max_steps", "7", "--lora_target_modules", "q_proj"]
    theirs = trl.TrlParser((GRPOScriptArguments, trl.GRPOConfig, trl.ModelConfig, trl.DatasetMixtureConfig)) \
        .parse_args_and_config(line)
    ours = parse("grpo", line)
    assert dataclasses.asdict(ours[0]) == dataclasses.asdict(theirs[0])
    assert dataclasses.asdict(ours[2]) == dataclasses.asdict(theirs[2])
    assert ours[2].lora_target_modules == "q_proj"  # TRL's post-init: a one-module list is its name
    # transformers' conversions tiller does not read (as test_trl_grpo_translate's comparison)
    skip = {"report_to", "debug", "accelerator_config", "dataloader_pin_memory", "pad_to_multiple_of", "disable_tqdm"}
    diff = {f: (getattr(theirs[1], f), getattr(ours[1], f)) for f in dataclasses.asdict(ours[1])
            if f not in skip and getattr(theirs[1], f) != getattr(ours[1], f)}
    assert diff == {} and (ours[1].learning_rate, ours[1].max_steps, ours[1].beta) == (3e-6, 7, 0.04)


def test_script_classes_fields_and_tables():
    import tiller.trl

    for name, fields in SCRIPT_FIELDS.items():
        cls = getattr(tiller.trl, name)
        assert set(cls.RULES) == set(fields), name
        table = field_table(name, cls.RULES)
        assert table.count("\n") == len(fields) + 2 and "| `" in table
    assert SCRIPT_FIELDS["ModelConfig"]["dtype"] == "float32"
    assert SCRIPT_FIELDS["ScriptArguments"]["dataset_test_split"] == "test"
    section = (ROOT / "docs" / "trl.md").read_text().split("## The `trl` command line")[1]
    for name in ("GRPOScriptArguments", "ModelConfig", "DatasetMixtureConfig"):
        assert f"### {name} fields\n\n" + field_table(name, getattr(tiller.trl, name).RULES) in section, name


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Count to {i % 5 + 2}:", "solution": str(i % 5 + 2)}) + "\n"
                            for i in range(8)))
    return path


@pytest.mark.parametrize("line, message", [
    (["--max_stpes", "2"], "--max_stpes: not a flag of `tiller trl grpo`; did you mean --max_steps?"),
    (["--max_steps", "two"], "argument --max_steps/--max-steps: invalid int value: 'two'"),
    (["--load_in_8bit"], "load_in_8bit=True: refused: tiller's QLoRA takes 4-bit bases"),
    (["--load_in_4bit"], "quantization_config (load_in_4bit): QLoRA trains adapters on the frozen 4-bit base: pass "
                         "a peft_config (TRL's scripts: --use_peft)"),
    (["--dataset_name", "no/such/dir"], "--dataset_name 'no/such/dir': no such local dataset dir or data file"),
    (["--reward_funcs", "accuracy"], "--reward_funcs 'accuracy': not a built-in reward function; did you mean "
                                     "'accuracy_reward'?"),
    (["--reward_funcs", "no_such_module.score"], "--reward_funcs 'no_such_module.score': cannot import"),
    (["--dataset_streaming"], "dataset_streaming=True: refused"),
    (["--push_to_hub"], "push_to_hub=True: refused: tiller does not upload"),
    (["--reward_model_name_or_path", "org/rm"], "--reward_model_name_or_path 'org/rm': not a local model dir"),
    (["--dataset_train_split", "dev"], "--dataset_train_split 'dev': 'PROMPTS' has the splits train"),
])
def test_bad_input_exits_2_naming_the_flag(line, message, tiny_model_dir, prompts_file, tmp_path, capsys):
    base = ["trl", "grpo", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(prompts_file),
            "--output_dir", str(tmp_path / "run"), "--reward_funcs", "think_format_reward"]
    assert tiller_main(base + line) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("tiller trl: error: ")
    assert message.replace("PROMPTS", str(prompts_file)) in err
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_a_hub_model_name_is_an_error_naming_it(prompts_file, capsys):
    assert tiller_main(["trl", "sft", "--model_name_or_path", "Qwen/Qwen2-0.5B-Instruct", "--dataset_name",
                        str(prompts_file)]) == 2
    assert "--model_name_or_path 'Qwen/Qwen2-0.5B-Instruct': not a local model dir" in capsys.readouterr().err


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow  # ~15-30 s; the README runs `tiller trl dpo` end to end in the fast lane
def test_sft_command_line_end_to_end(tiny_model_dir, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{a} + {a} =", "completion": f" {2 * a}"}) + "\n"
                                              for a in range(8)))
    out = tmp_path / "sft-run"
    proc = _run(["-m", "tiller.cli", "trl", "sft", "--model_name_or_path", str(tiny_model_dir), "--dataset_name",
                 str(data), "--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "4",
                 "--bf16", "false", "--report_to", "none", "--learning_rate", "1e-3"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [row for row in _steps(out) if "train/loss" in row]
    assert len(steps) == 2 and all(row["train/loss"] > 0 for row in steps)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert f"Model saved to {out}." in proc.stdout


def test_grpo_command_line_end_to_end(tiny_model_dir, prompts_file, tmp_path):
    (tmp_path / "my_rewards.py").write_text(  # a dotted-path reward, imported from the current dir as TRL's script
        "def chars(completions, solution, **kwargs):\n"
        "    assert len(solution) == len(completions)\n"
        "    return [float(len(c)) for c in completions]\n")
    out = tmp_path / "grpo-run"
    proc = _run(["-m", "tiller.trl", "grpo", "--model_name_or_path", str(tiny_model_dir), "--dataset_name",
                 str(prompts_file), "--output_dir", str(out), "--reward_funcs", "think_format_reward",
                 "my_rewards.chars", "--num_generations", "4", "--per_device_train_batch_size", "8",
                 "--max_completion_length", "4", "--max_steps", "2", "--bf16", "false", "--gradient_checkpointing",
                 "false", "--report_to", "none", "--seed", "0"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = _steps(out)
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:  # both functions scored every completion: TRL's metric names
        assert row["rewards/think_format_reward/mean"] == 0.0 and row["rewards/chars/mean"] > 0
        assert row["reward"] == pytest.approx(row["rewards/chars/mean"])
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert f"Model saved to {out}." in proc.stdout


def test_datasets_mixture_eval_split_and_lora(tmp_path, tiny_model_dir):
    pytest.importorskip("datasets")
    from tiller.trl.cli_data import load_splits, peft_config
    from tiller.trl.script_args import DatasetMixtureConfig, ModelConfig, ScriptArguments

    data = tmp_path / "d"
    data.mkdir()
    for split, n in (("train", 6), ("test", 2)):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": f"{split} {i}", "x": i}) + "\n"
                                                     for i in range(n)))
    args = GRPOConfig(output_dir="o")  # eval_strategy "no": no eval dataset, as TRL's scripts
    train, evaluation = load_splits(ScriptArguments(dataset_name=str(data)), DatasetMixtureConfig(), args)
    assert (len(train), evaluation) == (6, None)
    args = GRPOConfig(output_dir="o", eval_strategy="steps", eval_steps=1)
    train, evaluation = load_splits(ScriptArguments(dataset_name=str(data)), DatasetMixtureConfig(), args)
    assert (len(train), list(evaluation["prompt"])) == (6, ["test 0", "test 1"])
    # TRL's get_dataset: fractions 2:1 of (6, 2 rows) -> total min(6 / (2/3), 2 / (1/3)) = 6 -> 4 + 2 rows; columns
    mixture = DatasetMixtureConfig(datasets=[
        {"path": str(data), "split": "train", "fraction": 2.0, "columns": ["prompt"]},
        {"path": "json", "data_files": str(data / "test.jsonl"), "fraction": 1.0, "columns": ["prompt"]}],
        test_split_size=0.5)
    splits = [load_splits(ScriptArguments(), mixture, GRPOConfig(output_dir="o", eval_strategy="epoch", seed=s))
              for s in (0, 0, 1)]
    train, evaluation = splits[0]
    assert (len(train), len(evaluation), train.column_names) == (3, 3, ["prompt"])
    assert sorted(list(train["prompt"]) + list(evaluation["prompt"])) == sorted([f"train {i}" for i in range(4)] + ["test 0", "test 1"])
    assert list(splits[1][0]["prompt"]) == list(train["prompt"])  # the split is seeded (TRL's is not)
    assert list(splits[2][0]["prompt"]) != list(train["prompt"])
    # --use_peft: TRL's get_peft_config -> tiller's LoRA settings; lora_* without it is a notice
    model = ModelConfig(model_name_or_path=str(tiny_model_dir), use_peft=True, lora_r=4, lora_dropout=0.0,
                        lora_target_modules=["q_proj", "v_proj"], use_rslora=True, lora_modules_to_save=["lm_head"],
                        lora_target_parameters=["mlp.experts.down_proj"])
    from tiller.trl.base import lora_settings

    assert lora_settings(peft_config(model, "grpo"), str(tiny_model_dir)) == {
        "lora_rank": 4, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0,
        "use_rslora": True, "modules_to_save": ["lm_head"], "target_parameters": ["mlp.experts.down_proj"]}
    assert classify(ModelConfig(lora_r=4))[1] == ["lora_r=4: no effect without use_peft (as in TRL)"]


def test_without_datasets_installed_the_error_says_pip_install(monkeypatch, tmp_path):
    from tiller.errors import UserError
    from tiller.trl.cli_data import load_splits
    from tiller.trl.script_args import DatasetMixtureConfig, ScriptArguments

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(UserError, match="pip install datasets"):
        load_splits(ScriptArguments(dataset_name=str(tmp_path)), DatasetMixtureConfig(), GRPOConfig(output_dir="o"))


def test_reward_functions_by_name_model_first(tiny_model_dir, tmp_path, monkeypatch):
    from tiller.trl.cli_data import reward_functions
    from tiller.trl.reward_funcs import think_format_reward
    from tiller.trl.script_args import GRPOScriptArguments

    (tmp_path / "pkg_rewards.py").write_text("def score(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)  # a dotted path is imported with the current dir on sys.path, as TRL's script
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "pkg_rewards", raising=False)
    funcs = reward_functions(GRPOScriptArguments(
        reward_model_name_or_path=str(tiny_model_dir),
        reward_funcs=["pkg_rewards.score", "think_format_reward", "get_soft_overlong_punishment"]))
    assert funcs[0] == str(tiny_model_dir) and funcs[1].__module__ == "pkg_rewards" and funcs[2] is think_format_reward
    assert (funcs[3].max_completion_len, funcs[3].soft_punish_cache) == (1280, 256)
