"""`tiller trl COMMAND [TRL's flags]`: TRL's command line (`trl sft|dpo|kto|reward|grpo|rloo|distillation ...`,
TRL 1.16's `trl/scripts/*.py`) on tiller, with `trl` replaced by `tiller trl`.

Flags are parsed as TRL parses them: transformers' `HfArgumentParser` over the four dataclasses each script takes
(its script arguments, the config class, ModelConfig, DatasetMixtureConfig), with the fields' TRL types from
`tiller.trl.fields` (`--flag value`, `--flag=value`, `--bool` / `--bool false` / `--no_<bool>` for those defaulting
to True, several values for a list, `none` / `null` for an optional number, JSON for a dict field) and TrlParser's
`--config FILE.yaml` (its keys become defaults, the command line overrides them, its `env:` mapping sets environment
variables). Then the script's `main` as TRL writes it: the dataset, the reward functions (grpo / rloo), the trainer
(`tiller.trl`'s), `train()`, `save_model(output_dir)`.

Differences: an unknown flag, or an unknown key in the --config file (TRL's scripts ignore those), is an error naming
it and the closest field; `--dataset_name` is a local dir or data file (nothing is downloaded). Bad input is a
`UserError`: `tiller` prints one line and exits 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import tiller.trl
from tiller.errors import ConfigError, UserError
from tiller.trl.cli_data import load_splits, peft_config, reward_functions
from tiller.trl.common import classify
from tiller.trl.fields import FIELDS, SCRIPT_FIELDS, TYPES

# command -> (config class, script arguments class, trainer module)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "sft": ("SFTConfig", "ScriptArguments", "tiller.trl.sft"),
    "dpo": ("DPOConfig", "ScriptArguments", "tiller.trl.dpo"),
    "kto": ("KTOConfig", "ScriptArguments", "tiller.trl.kto"),
    "reward": ("RewardConfig", "ScriptArguments", "tiller.trl.reward"),
    "grpo": ("GRPOConfig", "GRPOScriptArguments", "tiller.trl.grpo"),
    "rloo": ("RLOOConfig", "RLOOScriptArguments", "tiller.trl.rloo"),
    "distillation": ("DistillationConfig", "ScriptArguments", "tiller.trl.distillation"),
}
USAGE = (f"usage: tiller trl COMMAND [TRL's flags] [--config FILE.yaml]   (COMMAND: {', '.join(COMMANDS)}; "
         "`tiller trl COMMAND --help` lists the flags)")


# ------------------------------------------------------------------------------------------------ parsing


class Unsupported:
    """The type of a field HfArgumentParser cannot fill from a string (e.g. parallelism_config): any value fails."""

    def __init__(self, value: str):
        raise ValueError("not settable from the command line")


class DatasetConfig(dict):
    """TRL's DatasetConfig(value) from a `--datasets PATH ...` value: the path of one dataset of the mixture."""

    def __init__(self, value: str):
        super().__init__(path=value)


_TYPE_NAMES = {"Any": Any, "Union": Union, "Literal": Literal, "Unsupported": Unsupported,
               "DatasetConfig": DatasetConfig}


def _parse_type(text: str) -> Any:
    return eval(text, {"__builtins__": {}}, {**_TYPE_NAMES, "bool": bool, "int": int, "float": float, "str": str,
                                             "dict": dict, "list": list, "tuple": tuple, "None": None})


def _fields_of(class_name: str) -> dict[str, Any]:
    return FIELDS.get(class_name) or SCRIPT_FIELDS[class_name]


def parse_class(class_name: str) -> type:
    """A dataclass with the fields, TRL defaults and TRL type annotations of `class_name`, for HfArgumentParser."""
    specs = []
    for name, default in _fields_of(class_name).items():
        if isinstance(default, (list, dict)):
            spec = dataclasses.field(default_factory=lambda d=default: json.loads(json.dumps(d)))
        else:
            spec = dataclasses.field(default=default)
        specs.append((name, _parse_type(TYPES[class_name][name]), spec))
    return dataclasses.make_dataclass(class_name, specs)


def _accept_none(inner: Any) -> Any:
    """TRL's parser: `none` / `null` (any case) is None for an optional non-string field."""
    def parse(value: str) -> Any:
        return None if value.lower() in ("none", "null") else inner(value)

    parse.__name__ = getattr(inner, "__name__", "value")
    return parse


def _parser_class() -> type:
    # import cost: transformers' argument parser (transformers itself) loads only when a command line is parsed
    from transformers import HfArgumentParser

    class TrlArgumentParser(HfArgumentParser):
        """HfArgumentParser with TRL 1.16's additions (`none` for optional numbers) and errors as `UserError`."""

        @staticmethod
        def _parse_dataclass_field(parser: Any, field: dataclasses.Field) -> None:
            declared = field.type
            HfArgumentParser._parse_dataclass_field(parser, field)
            union = typing.get_origin(declared) in (Union, types.UnionType)
            args = typing.get_args(declared) if union else ()
            if type(None) in args and bool not in args:
                action = next(a for a in reversed(parser._actions) if a.dest == field.name)
                if action.choices is None and action.nargs is None and action.type not in (None, str):
                    action.type = _accept_none(action.type)

        def error(self, message: str) -> typing.NoReturn:
            raise UserError(message)

    return TrlArgumentParser


def _split_config(argv: list[str]) -> tuple[list[str], str | None]:
    args, path = [], None
    i = 0
    while i < len(argv):
        if argv[i] == "--config":
            if i + 1 >= len(argv):
                raise UserError("--config: expected a YAML file")
            path = argv[i + 1]
            i += 2
            continue
        if argv[i].startswith("--config="):
            path = argv[i].split("=", 1)[1]
        else:
            args.append(argv[i])
        i += 1
    return args, path


def _read_config(path: str) -> dict[str, Any]:
    import yaml

    try:
        config = yaml.safe_load(Path(path).expanduser().read_text())
    except FileNotFoundError:
        raise UserError(f"--config {path}: no such file") from None
    except yaml.YAMLError as exc:
        raise UserError(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise UserError(f"--config {path}: must contain a YAML mapping")
    env = config.pop("env", {})
    if not isinstance(env, dict):
        raise UserError(f"--config {path}: env: should be a mapping of environment variables")
    for key, value in env.items():  # as TrlParser: set before anything reads them
        os.environ[str(key)] = str(value)
    return config


def _unknown(flag: str, known: list[str], where: str, command: str) -> UserError:
    name = flag.split("=", 1)[0].lstrip("-")
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean --{close[0]}?" if close else ""
    return UserError(f"{where}{flag.split('=', 1)[0]}: not a flag of `tiller trl {command}`{hint}")


def _json_dicts(class_name: str, values: dict[str, Any]) -> None:
    """transformers / TRL read a dict field given as a JSON string (`--lr_scheduler_kwargs '{"num_cycles": 1}'`)."""
    for name, value in values.items():
        if isinstance(value, str) and value.startswith("{") and TYPES[class_name][name].startswith("Union[dict"):
            try:
                values[name] = json.loads(value)
            except json.JSONDecodeError as exc:
                raise UserError(f"--{name}: not valid JSON ({exc.msg})") from None


def parse(command: str, argv: list[str]) -> tuple[Any, Any, Any, Any]:
    """(script arguments, config, ModelConfig, DatasetMixtureConfig) of a TRL command line, as tiller.trl's objects
    (the config is `tiller.trl.GRPOConfig` etc.), parsed as TRL's TrlParser parses them."""
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, list(COMMANDS), n=1)
        raise UserError(f"unknown command {command!r}{f' (did you mean {close[0]}?)' if close else ''}; {USAGE}")
    config_name, script_name, _ = COMMANDS[command]
    names = (script_name, config_name, "ModelConfig", "DatasetMixtureConfig")
    parser_class = _parser_class()
    parser = parser_class([parse_class(n) for n in names], prog=f"tiller trl {command}")
    # what an empty command line gives: a field left at it keeps TRL's declared default (HfArgumentParser converts
    # some: a string default through the bool parser, a list field's non-list default to None; TRL's post-init
    # converts them back)
    untouched = parser_class([parse_class(n) for n in names]).parse_args_into_dataclasses(
        args=[], look_for_args_file=False)
    args, config_path = _split_config(list(argv))
    known = [name for n in names for name in _fields_of(n)]
    if config_path is not None:  # TrlParser.set_defaults_with_config: yaml keys become the parser's defaults
        config = _read_config(config_path)
        used = set()
        for action in parser._actions:
            if action.dest in config:
                action.default, action.required = config[action.dest], False
                used.add(action.dest)
        extra = [key for key in config if key not in used]
        if extra:
            raise _unknown(f"--{extra[0]}", known, f"--config {config_path}: key ", command)
    parsed = parser.parse_args_into_dataclasses(args=args, return_remaining_strings=True, look_for_args_file=False)
    *values, remaining = parsed
    if remaining:
        flag = next((r for r in remaining if r.startswith("-")), remaining[0])
        if not flag.startswith("-"):
            raise UserError(f"{flag!r}: unexpected value (flags are --name value)")
        raise _unknown(flag, known, "", command)
    out = []
    for name, value, empty in zip(names, values, untouched):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        for field, default in _fields_of(name).items():
            if fields[field] == getattr(empty, field):
                fields[field] = json.loads(json.dumps(default))
        _json_dicts(name, fields)
        try:
            out.append(getattr(tiller.trl, name)(**fields))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{name}: {exc}") from None
    return tuple(out)


# ------------------------------------------------------------------------------------------------ the run


def main(argv: list[str]) -> int:
    """TRL's script `main` for `argv[0]` (sft, dpo, kto, reward, grpo, rloo, distillation) on tiller's trainers."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command = argv[0]
    script, args, model_args, mixture = parse(command, argv[1:])

    for obj in (script, model_args, mixture):
        for line in classify(obj)[1]:
            print(f"tiller.trl: {line}")
    model = _model_path(model_args.model_name_or_path)
    args.model_init_kwargs = _model_init_kwargs(model_args, args.model_init_kwargs)
    resume = args.resume_from_checkpoint  # the script passes it to train(); the trainer does not read it
    args.resume_from_checkpoint = None
    train_dataset, eval_dataset = load_splits(script, mixture, args)
    kwargs: dict[str, Any] = {}
    if command in ("grpo", "rloo"):
        kwargs["reward_funcs"] = reward_functions(script)
    if command == "distillation":
        kwargs["teacher_model"] = _teacher(args, model_args)
    trainer_class = getattr(importlib.import_module(COMMANDS[command][2]), COMMANDS[command][0][:-6] + "Trainer")
    trainer = trainer_class(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                            peft_config=peft_config(model_args, command), **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    print("Training completed.")
    trainer.save_model(args.output_dir)
    print(f"Model saved to {args.output_dir}.")
    return 0


def _teacher(args: Any, model_args: Any) -> str:
    """TRL's distillation script: the teacher is --teacher_model_name_or_path (required), loaded with
    {revision, trust_remote_code, attn_implementation, dtype} updated by --teacher_model_init_kwargs."""
    if args.teacher_model_name_or_path is None:
        raise UserError("--teacher_model_name_or_path: required (a teacher model is required for distillation "
                        "training; a local Hugging Face model dir)")
    path = args.teacher_model_name_or_path
    if not Path(path).expanduser().is_dir():
        raise UserError(f"--teacher_model_name_or_path {path!r}: not a local model dir (tiller downloads no hub "
                        "models: download it first and give its dir)")
    kwargs: dict[str, Any] = {"revision": args.teacher_model_revision,
                              "trust_remote_code": args.trust_remote_code, "dtype": model_args.dtype}
    if model_args.attn_implementation is not None:
        kwargs["attn_implementation"] = model_args.attn_implementation
    kwargs.update(args.teacher_model_init_kwargs or {})
    args.teacher_model_init_kwargs = kwargs
    return path


def _model_path(name: str | None) -> str:
    if not name:
        raise UserError("--model_name_or_path: required (a local Hugging Face model dir)")
    if not Path(name).expanduser().is_dir():
        raise UserError(f"--model_name_or_path {name!r}: not a local model dir (tiller downloads no hub models: "
                        "download it first, e.g. `hf download`, and give its dir)")
    return name


def _model_init_kwargs(model_args: Any, given: dict | None) -> dict[str, Any]:
    """TRL's scripts: model_init_kwargs = {revision, trust_remote_code, attn_implementation, dtype} updated by the
    config's own. revision (refused unless "main") and trust_remote_code (the config's own field) are left out."""
    out: dict[str, Any] = {"dtype": model_args.dtype}
    if model_args.attn_implementation is not None:
        out["attn_implementation"] = model_args.attn_implementation
    if model_args.load_in_4bit:  # TRL's get_quantization_config (its dict: tiller.trl.base.quant_settings reads it)
        out["quantization_config"] = {
            "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_compute_dtype": model_args.dtype,
            "bnb_4bit_quant_type": model_args.bnb_4bit_quant_type,
            "bnb_4bit_use_double_quant": model_args.use_bnb_nested_quant,
            "bnb_4bit_quant_storage": model_args.bnb_4bit_quant_storage}
    out.update(given or {})
    return out


if __name__ == "__main__":
    from tiller.entry import run_main

    run_main(main, sys.argv[1:])
