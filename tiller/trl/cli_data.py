"""What `tiller trl COMMAND` (tiller.trl.cli) builds from the script arguments, as TRL 1.16's scripts build it: the
train / eval datasets (`--dataset_name` or a `datasets:` mixture, loaded with Hugging Face `datasets` from local
dirs and files only), the LoRA config (`--use_peft`, TRL's `get_peft_config`) and the reward functions of grpo / rloo
(`--reward_model_name_or_path` first, then `--reward_funcs`: TRL's built-ins or dotted import paths)."""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from pathlib import Path
from typing import Any, Callable

from tiller.errors import ConfigError, DataError, UserError

# a data file given as --dataset_name is read with the `datasets` builder of its extension
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text",
             ".arrow": "arrow"}
PACKAGED = ("json", "parquet", "csv", "text", "arrow")  # builders a mixture entry may name with data_files


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise UserError("the trl command line reads datasets with Hugging Face `datasets`: pip install datasets") \
            from None
    datasets.disable_progress_bars()  # a local file loads in a blink: no bar between tiller's lines
    return datasets


def _load(where: str, path: str, **kwargs: Any) -> Any:
    """`datasets.load_dataset` of a local dir or data file (a DatasetDict, or a Dataset when `split` is given)."""
    datasets = _datasets()
    local = Path(path).expanduser()
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if local.is_file() and local.suffix in _BUILDERS:
        split = kwargs.pop("split", None)
        loaded = datasets.load_dataset(_BUILDERS[local.suffix], data_files={"train": str(local)}, **kwargs)
        return loaded if split is None else loaded[split]
    if not local.exists() and not (path in PACKAGED and kwargs.get("data_files")):
        raise DataError(f"{where} {path!r}: no such local dataset dir or data file (tiller downloads no hub "
                        "datasets: download it first, e.g. `hf download --repo-type dataset`, and give its dir)")
    if local.is_file():
        raise DataError(f"{where} {path!r}: a {local.suffix or 'extensionless'} file: give a dataset dir or a "
                        f"{' / '.join(_BUILDERS)} file")
    try:
        return datasets.load_dataset(str(local) if local.exists() else path, **kwargs)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise DataError(f"{where} {path!r}: {type(exc).__name__}: {exc}") from None


def _mixture(mixture: Any, seed: int) -> dict[str, Any]:
    """TRL's get_dataset: each entry loaded (columns selected), shares by `fraction`, concatenated, then split by
    test_split_size (seeded here)."""
    datasets = _datasets()
    parts = []
    for i, entry in enumerate(mixture.datasets):
        part = _load(f"datasets[{i}].path", entry["path"], name=entry.get("name"), data_dir=entry.get("data_dir"),
                     data_files=entry.get("data_files"), split=entry.get("split", "train"))
        if entry.get("columns") is not None:
            missing = sorted(set(entry["columns"]) - set(part.column_names))
            if missing:
                raise DataError(f"datasets[{i}].columns: {missing[0]!r} is not a column of {entry['path']!r} "
                                f"({', '.join(part.column_names)})")
            part = part.select_columns(entry["columns"])
        parts.append(part)
    fractions = [entry.get("fraction") for entry in mixture.datasets]
    if any(f is not None for f in fractions):
        if any(f is None for f in fractions):
            raise ConfigError("datasets: fraction must be set for every dataset of the mixture or for none")
        weights = [f / sum(fractions) for f in fractions]
        total = min(len(part) / w for part, w in zip(parts, weights) if w > 0)
        parts = [part.select(range(round(w * total))) for part, w in zip(parts, weights)]
    combined = datasets.concatenate_datasets(parts)
    if mixture.test_split_size is not None:
        return dict(combined.train_test_split(test_size=mixture.test_split_size, seed=seed))
    return {"train": combined}


def load_splits(script: Any, mixture: Any, args: Any) -> tuple[Any, Any]:
    """(train_dataset, eval_dataset or None) as TRL's scripts choose them: the mixture when `datasets` is given
    (dataset_name is then ignored, with a notice), else `load_dataset(dataset_name, name=dataset_config)`; the eval
    split only when eval_strategy is not "no"."""
    if mixture.datasets:
        if script.dataset_name:
            print("tiller.trl: datasets and dataset_name are both given: datasets is used, dataset_name ignored "
                  "(as TRL's scripts)")
        splits = _mixture(mixture, args.seed)
        where = "the datasets mixture"
    elif script.dataset_name:
        splits = _load("--dataset_name", script.dataset_name, name=script.dataset_config)
        where = repr(script.dataset_name)
    else:
        raise UserError("--dataset_name: required (a local dataset dir or data file), or datasets: in the --config "
                        "file")

    def split(flag: str, name: str) -> Any:
        if name not in splits:
            raise DataError(f"--{flag} {name!r}: {where} has the splits {', '.join(splits)}")
        return splits[name]

    train = split("dataset_train_split", script.dataset_train_split)
    evaluation = split("dataset_test_split", script.dataset_test_split) if args.eval_strategy != "no" else None
    return train, evaluation


def peft_config(model_args: Any, command: str) -> Any:
    """TRL's get_peft_config: a peft.LoraConfig when --use_peft (tiller.trl's trainers read r, lora_alpha,
    lora_dropout, target_modules, target_parameters, modules_to_save, use_rslora, use_dora; the refused ModelConfig fields never reach
    here)."""
    if not model_args.use_peft:
        return None
    from peft import LoraConfig

    return LoraConfig(r=model_args.lora_r, lora_alpha=model_args.lora_alpha, lora_dropout=model_args.lora_dropout,
                      target_modules=model_args.lora_target_modules, bias="none",
                      modules_to_save=model_args.lora_modules_to_save,
                      target_parameters=model_args.lora_target_parameters,
                      use_rslora=bool(model_args.use_rslora), use_dora=bool(model_args.use_dora))


def reward_functions(script: Any) -> list[Any]:
    """grpo / rloo: the reward model dir (first, as TRL's script), then each --reward_funcs name: one of TRL's
    built-ins (`tiller.trl.reward_funcs.SCRIPT_REWARDS`) or `module.function` imported with the current dir on
    sys.path."""
    from tiller.trl.reward_funcs import SCRIPT_REWARDS  # import cost: torch (its math-verify worker pool)

    out: list[Any] = []
    if script.reward_model_name_or_path:
        if not Path(script.reward_model_name_or_path).expanduser().is_dir():
            raise UserError(f"--reward_model_name_or_path {script.reward_model_name_or_path!r}: not a local model dir "
                            "(tiller downloads no hub models)")
        out.append(script.reward_model_name_or_path)
    for name in script.reward_funcs or []:
        if name in SCRIPT_REWARDS:
            out.append(SCRIPT_REWARDS[name]())
        elif "." in name:
            out.append(_import_reward(name))
        else:
            close = difflib.get_close_matches(name, list(SCRIPT_REWARDS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UserError(f"--reward_funcs {name!r}: not a built-in reward function; {hint}(built-ins: "
                            f"{', '.join(SCRIPT_REWARDS)}; or a dotted import path, e.g. my_rewards.score)")
    if not out:
        raise UserError("--reward_funcs: required (or --reward_model_name_or_path): the rewards to train on")
    return out


def _import_reward(name: str) -> Callable:
    module_path, func_name = name.rsplit(".", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise UserError(f"--reward_funcs {name!r}: cannot import {module_path!r} ({exc})") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise UserError(f"--reward_funcs {name!r}: {module_path} has no function {func_name!r}")
    return func
