"""The dataclasses TRL's command-line scripts parse besides the config class (`trl/scripts/*.py`): ScriptArguments
(GRPO's and RLOO's add `reward_model_name_or_path` and `reward_funcs`), ModelConfig and DatasetMixtureConfig, with
TRL's fields and defaults, each field mapped / noop / refused as the config classes' fields are (`tiller.trl.common`).
`tiller trl COMMAND` (`tiller.trl.cli`) reads the mapped ones; `classify` gives the notices and refusals."""

from __future__ import annotations

from typing import Any

from tiller.errors import ConfigError
from tiller.trl.common import NOTICE, Rule, make_config_class, mapped, noop, refused
from tiller.trl.fields import SCRIPT_FIELDS

_READ = lambda value, args: {}  # noqa: E731 - a mapped field `tiller.trl.cli` reads itself

SCRIPT_RULES: dict[str, Rule] = {
    "dataset_name": mapped("a local dataset dir (datasets.load_dataset) or data file (.jsonl / .json / .parquet / "
                           ".csv); nothing is downloaded", _READ),
    "dataset_config": mapped("load_dataset's name (the dataset's builder config)", _READ),
    "dataset_train_split": mapped("the split trained on", _READ),
    "dataset_test_split": mapped("the eval_dataset split, read when eval_strategy is not 'no' (as TRL's scripts)",
                                 _READ),
    "dataset_streaming": refused("tiller needs the whole dataset (a streaming dataset is iterable only)"),
    "ignore_bias_buffers": noop("a DDP workaround for bool buffers; tiller trains in one process per run"),
}

REWARD_SCRIPT_RULES: dict[str, Rule] = {
    **SCRIPT_RULES,
    "reward_model_name_or_path": mapped("a local sequence-classification model dir, the first reward function (as "
                                        "TRL's script)", _READ),
    "reward_funcs": mapped("accuracy_reward | reasoning_accuracy_reward | think_format_reward | "
                           "get_soft_overlong_punishment (tiller.trl.reward_funcs, TRL's semantics) or a dotted "
                           "import path (the current dir on sys.path)", _READ),
}

_LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
                "lora_modules_to_save", "use_rslora", "use_dora")


def _use_peft(value: Any, args: Any) -> dict:
    if value:
        return {}
    changed = [f"{name}={getattr(args, name)!r}" for name in _LORA_FIELDS
               if getattr(args, name) != SCRIPT_FIELDS["ModelConfig"][name]]
    return {NOTICE: [f"{', '.join(changed)}: no effect without use_peft (as in TRL)"]} if changed else {}


MODEL_RULES: dict[str, Rule] = {
    "model_name_or_path": mapped("the model: a local Hugging Face model dir (tiller loads no hub models)", _READ),
    "model_revision": refused("a hub revision: tiller loads a local dir (check the revision out there)"),
    "dtype": mapped("model_init_kwargs' dtype, as TRL's scripts pass it: tiller keeps float32 master weights and "
                    "computes in bf16's dtype (another dtype: a notice)", _READ),
    "attn_implementation": mapped("model_init_kwargs' attn_implementation (as TRL's scripts pass it)", _READ),
    "use_peft": mapped("LoRA from lora_r, lora_alpha, lora_dropout, lora_target_modules (TRL's get_peft_config); "
                       "without it those are a notice", _use_peft),
    "lora_r": mapped("LoRA rank (with use_peft)", _READ),
    "lora_alpha": mapped("LoRA alpha (with use_peft)", _READ),
    "lora_dropout": mapped("LoRA dropout (with use_peft; grpo / rloo: in the update's forward, as TRL's train-mode "
                           "model applies it)", _READ),
    "lora_target_modules": mapped("LoRA target modules (with use_peft; None: peft's default for the model type)",
                                  _READ),
    "lora_target_parameters": mapped("parameters adapted besides the modules, a mixture-of-experts model's experts "
                                     "(with use_peft: model.target_parameters / "
                                     "actor_rollout_ref.model.target_parameters)", _READ),
    "lora_modules_to_save": mapped("modules trained in full beside the adapters and saved with them (with use_peft: "
                                   "model.modules_to_save / actor_rollout_ref.model.modules_to_save)", _READ),
    "lora_task_type": noop("tiller picks the head by the command (a sequence-classification head for `reward`)"),
    "use_rslora": mapped("rank-stabilised LoRA, scale lora_alpha / sqrt(r) (with use_peft: model.use_rslora)", _READ),
    "use_dora": mapped("DoRA adapters (with use_peft: model.use_dora)", _READ),
    "load_in_8bit": refused("tiller's QLoRA takes 4-bit bases (load_in_4bit); LLM.int8 quantizes the activations "
                            "too, so no merge gives the trained model"),
    "load_in_4bit": mapped("QLoRA (with use_peft): quantization_config in model_init_kwargs as TRL's "
                           "get_quantization_config builds it -> model.load_in_4bit / "
                           "actor_rollout_ref.model.load_in_4bit (bitsandbytes)", _READ),
    "bnb_4bit_quant_type": mapped("with load_in_4bit: nf4 | fp4 (-> bnb_4bit_quant_type)", _READ),
    "use_bnb_nested_quant": mapped("with load_in_4bit: the block scales quantized too (-> "
                                   "bnb_4bit_use_double_quant)", _READ),
    "bnb_4bit_quant_storage": mapped("with load_in_4bit: uint8 (TRL's default); others refused (a storage dtype for "
                                     "sharding 4-bit weights, which tiller does not do)", _READ),
}

DATASET_KEYS = ("path", "name", "data_dir", "data_files", "split", "columns", "fraction")  # TRL's DatasetConfig

MIXTURE_RULES: dict[str, Rule] = {
    "datasets": mapped("each entry (path, name, data_dir, data_files, split, columns, fraction; a local path or a "
                       "builder such as json with data_files) loaded with load_dataset, concatenated as TRL's "
                       "get_dataset; used in place of dataset_name", _READ),
    "streaming": refused("tiller needs the whole dataset (a streaming dataset is iterable only)"),
    "test_split_size": mapped("the mixture split into train / test (datasets' train_test_split, seeded with seed: "
                              "TRL's split is unseeded)", _READ),
}


def _model_post_init(self: Any) -> None:  # TRL's ModelConfig.__post_init__
    if self.load_in_8bit and self.load_in_4bit:
        raise ConfigError("load_in_8bit and load_in_4bit: refused: 8 bit and 4 bit at once")
    if isinstance(self.lora_target_modules, list) and len(self.lora_target_modules) == 1:
        self.lora_target_modules = self.lora_target_modules[0]


def _mixture_post_init(self: Any) -> None:  # TRL makes a DatasetConfig of each entry: tiller keeps the dicts
    for i, entry in enumerate(self.datasets):
        if isinstance(entry, str):
            entry = self.datasets[i] = {"path": entry}
        if not isinstance(entry, dict) or "path" not in entry:
            raise ConfigError(f"datasets[{i}]: a mapping with a path (and {', '.join(DATASET_KEYS[1:])})")
        unknown = sorted(set(entry) - set(DATASET_KEYS))
        if unknown:
            raise ConfigError(f"datasets[{i}].{unknown[0]}: not a DatasetConfig field ({', '.join(DATASET_KEYS)})")


ScriptArguments = make_config_class("ScriptArguments", SCRIPT_RULES, script_class=True)
GRPOScriptArguments = make_config_class("GRPOScriptArguments", REWARD_SCRIPT_RULES, script_class=True)
RLOOScriptArguments = make_config_class("RLOOScriptArguments", REWARD_SCRIPT_RULES, script_class=True)
ModelConfig = make_config_class("ModelConfig", MODEL_RULES, _model_post_init, script_class=True)
DatasetMixtureConfig = make_config_class("DatasetMixtureConfig", MIXTURE_RULES, _mixture_post_init, script_class=True)

SCRIPT_CLASSES = {cls.__name__: cls for cls in (ScriptArguments, GRPOScriptArguments, RLOOScriptArguments,
                                                ModelConfig, DatasetMixtureConfig)}
