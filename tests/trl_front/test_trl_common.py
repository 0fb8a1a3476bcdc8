"""The shared part of the TRL front end: fields, rules, config classes, schedules, datasets, LoRA settings."""

from __future__ import annotations

import dataclasses
import json
import runpy
from pathlib import Path

import pytest
import torch

from tiller.errors import ConfigError, DataError
from tiller.trl import common
from tiller.trl.common import (
    TRAINING_ARGS_RULES, classify, job_keys, lora_settings, make_config_class, resolve_schedule, rl_keys,
    to_dataset_rows, write_rows_atomic,
)
from tiller.trl.fields import FIELDS
from tiller.workers.common import lr_lambda, verl_lr_lambda

ROOT = Path(__file__).resolve().parents[2]


def test_fields_module_is_what_the_generator_prints():
    """Every field the installed TRL and transformers have, as the committed module lists them. The transformers
    version the header names is left out: a release that adds no field (5.24 -> 5.25) must not fail a user's run
    of the tests; one that adds a field does."""
    import re

    pytest.importorskip("trl")
    generator = runpy.run_path(str(ROOT / "scripts" / "gen_trl_fields.py"))  # in-process: one trl import
    unversioned = lambda text: re.sub(r"transformers [0-9][^ ]*'s", "transformers X's", text, count=1)  # noqa: E731
    assert unversioned(generator["render"]()) == unversioned((ROOT / "tiller" / "trl" / "fields.py").read_text())


def test_training_arguments_rules_cover_exactly_the_fields_every_trl_config_shares():
    experimental = ("CPOConfig", "ORPOConfig")  # trl.experimental's: TrainingArguments + model_init_kwargs, ...
    shared = set.intersection(*(set(fields) for name, fields in FIELDS.items() if name not in experimental))
    assert set(TRAINING_ARGS_RULES) == shared, (shared ^ set(TRAINING_ARGS_RULES))
    for name in experimental:  # ... without pad_to_multiple_of (make_config_class keeps a class's own fields' rules)
        assert shared - set(FIELDS[name]) == {"pad_to_multiple_of"}, name
    # transformers 5's TrainingArguments (114) + model_init_kwargs, trust_remote_code, pad_to_multiple_of
    assert len(shared) == 117
    assert {rule.kind for rule in TRAINING_ARGS_RULES.values()} == {"mapped", "noop", "refused"}
    assert all(rule.text for rule in TRAINING_ARGS_RULES.values())
    assert all((rule.apply is not None) == (rule.kind == "mapped") for rule in TRAINING_ARGS_RULES.values())


def _grpo_like():
    """A config class over GRPOConfig's fields with every non-TrainingArguments field a no-op (for these tests)."""
    own = {name: common.noop("test") for name in FIELDS["GRPOConfig"] if name not in TRAINING_ARGS_RULES}
    return make_config_class("GRPOConfig", own)


def test_config_class_has_trl_defaults_post_init_and_a_typeerror_naming_the_closest_field():
    cls = _grpo_like()
    args = cls(output_dir="runs/x", learning_rate=1e-6)
    assert args.learning_rate == 1e-6 and args.num_generations == 8 and args.logging_steps == 10
    assert args.bf16 is True  # TRL: bf16 = not fp16 when unset
    assert args.activation_checkpointing is True  # transformers 5: gradient_checkpointing is its alias
    assert cls().output_dir == "trainer_output"
    assert cls(output_dir="o").include_for_metrics == [] and cls().include_for_metrics is not cls().include_for_metrics
    assert cls("positional").output_dir == "positional"
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_generation'; did you mean 'num_generations'"):
        cls(num_generation=4)
    assert dataclasses.is_dataclass(args) and args.to_dict()["learning_rate"] == 1e-6
    assert cls(eval_strategy="steps", logging_steps=3).eval_steps == 3  # transformers: eval_steps <- logging_steps


def test_classify_maps_notices_noops_and_refuses_by_field_name():
    cls = _grpo_like()
    logical, notices = classify(cls(output_dir="o", learning_rate=3e-6, adam_beta2=0.99, max_grad_norm=0.5,
                                    warmup_steps=0.1, bf16=False, report_to=["tensorboard"]))
    assert logical["lr"] == 3e-6 and logical["betas"] == [0.9, 0.99] and logical["grad_clip"] == 0.5
    assert logical["warmup_ratio"] == 0.1 and logical["dtype"] == "float32" and logical["weight_decay"] == 0.0
    assert logical["loggers"] == ["console", "jsonl", "tensorboard"] and logical["lr_scheduler"] == "linear"
    assert notices == []
    _, notices = classify(cls(output_dir="o", logging_steps=1, dataloader_num_workers=4))
    assert [n.split(":")[0] for n in notices] == ["logging_steps=1", "dataloader_num_workers=4"]
    for field, value in (("push_to_hub", True), ("fp16", True), ("deepspeed", "ds.json"), ("optim", "lomo"),
                         ("report_to", "comet_ml"), ("lr_scheduler_type", "reduce_lr_on_plateau"),
                         ("save_strategy", "best")):
        with pytest.raises(ConfigError, match=f"^{field}="):
            classify(cls(output_dir="o", **{field: value}))


def test_schedule_and_save_eval_steps_are_counted_as_transformers_counts_them():
    cls = _grpo_like()
    logical, _ = classify(cls(output_dir="o", num_train_epochs=2.5, warmup_steps=0.1, save_steps=0.25,
                              eval_strategy="epoch"))
    out = resolve_schedule(logical, steps_per_epoch=7)
    # ceil(2.5 x 7) = 18 steps; warm-up ceil(0.1 x 18) = 2; save every ceil(0.25 x 18) = 5; eval each epoch (7)
    assert (out["total_training_steps"], out["warmup_steps"], out["save_freq"], out["test_freq"]) == (18, 2, 5, 7)
    logical, _ = classify(cls(output_dir="o", max_steps=4, warmup_steps=3, save_strategy="no"))
    out = resolve_schedule(logical, steps_per_epoch=100)
    assert (out["total_training_steps"], out["warmup_steps"], out["save_freq"], out["test_freq"]) == (4, 3, -1, -1)
    keys = rl_keys(out)
    assert keys["actor_rollout_ref.actor.optim.lr_warmup_steps"] == 3
    assert keys["actor_rollout_ref.actor.optim.warmup_style"] == "linear"
    assert keys["trainer.total_training_steps"] == 4 and keys["trainer.experiment_name"] == "o"
    assert keys["actor_rollout_ref.actor.optim.lr"] == 1e-6 and keys["actor_rollout_ref.actor.optim.weight_decay"] == 0
    jk = job_keys({**out, "micro_batch_size": 2, "grad_accum": 3})
    assert int(jk["optim.warmup_steps_ratio"] * 4) == 3 and jk["data.train_batch_size"] == 6
    assert job_keys({**out, "eps": 1e-6})["optim.eps"] == 1e-6  # (the jobs' AdamW takes TRL's adam_epsilon)


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_rl_schedules_equal_transformers_schedulers(style):
    from transformers import get_scheduler

    total, warmup = 10, 3
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    hf_name = {"constant": "constant_with_warmup"}.get(style, style)
    sched = get_scheduler(hf_name, opt, num_warmup_steps=warmup, num_training_steps=total)
    hf = []
    for _ in range(total):
        hf.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    ours = [verl_lr_lambda(s, warmup=warmup, total=total, style=style, min_lr_ratio=0.0) for s in range(total)]
    assert ours == pytest.approx(hf, abs=1e-12)
    if style == "linear":  # worked: 0, 1/3, 2/3, then (10 - s) / 7
        assert ours[:5] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 6 / 7])


def test_job_linear_schedule_decays_to_zero_as_transformers():
    # after warm-up the job loop's linear decay is transformers': (total - step) / (total - warmup)
    assert [lr_lambda(s, warmup=0, total=4, style="linear", min_lr_ratio=0.0) for s in range(5)] == \
        [1.0, 0.75, 0.5, 0.25, 0.0]


def test_datasets_lists_and_files_become_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": "a", "n": 1}, {"prompt": "b", "n": 2}])
    assert to_dataset_rows(ds, "train_dataset") == [{"prompt": "a", "n": 1}, {"prompt": "b", "n": 2}]
    assert to_dataset_rows([{"prompt": "a"}], "train_dataset") == [{"prompt": "a"}]
    path = write_rows_atomic([{"prompt": "x", "n": 3}], tmp_path / "d.jsonl")
    assert to_dataset_rows(str(path), "train_dataset") == [{"prompt": "x", "n": 3}]
    assert json.loads(path.read_text()) == {"prompt": "x", "n": 3}
    with pytest.raises(DataError, match="^train_dataset: a int is not a dataset"):
        to_dataset_rows(3, "train_dataset")
    with pytest.raises(DataError, match="^eval_dataset: row 1 is a str"):
        to_dataset_rows([{"a": 1}, "b"], "eval_dataset")
    with pytest.raises(DataError, match="DatasetDict"):
        to_dataset_rows(datasets.DatasetDict({"train": ds}), "train_dataset")
    with pytest.raises(DataError, match="^train_dataset is empty"):
        to_dataset_rows([], "train_dataset")


def test_peft_lora_config_becomes_lora_settings(tiny_model_dir):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["v_proj", "q_proj"])
    lora = lora_settings(config, tiny_model_dir)
    assert lora == {"lora_rank": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.05}
    keys = common.lora_rl_keys(lora)  # the RL actor's dropout: in its update's forward (tests/trainer)
    assert keys["actor_rollout_ref.model.lora_rank"] == 4 and keys["actor_rollout_ref.model.lora_dropout"] == 0.05
    assert "actor_rollout_ref.model.lora_dropout" not in common.lora_rl_keys({**lora, "lora_dropout": 0.0})
    # target_modules None: peft's default for the model type (qwen2: q_proj, v_proj)
    assert lora_settings(peft.LoraConfig(r=2), tiny_model_dir)["target_modules"] == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match="^peft_config.bias='all': refused"):
        lora_settings(peft.LoraConfig(r=2, bias="all"), tiny_model_dir)
    rs = lora_settings(peft.LoraConfig(r=2, use_rslora=True, use_dora=True), tiny_model_dir)
    assert rs["use_rslora"] is True and common.lora_rl_keys(rs)["actor_rollout_ref.model.use_rslora"] is True
    assert common.lora_job_keys(rs)["model.use_rslora"] is True and rs["use_dora"] is True
    assert common.lora_rl_keys(rs)["actor_rollout_ref.model.use_dora"] is True
    saved = lora_settings(peft.LoraConfig(r=2, modules_to_save=["lm_head"]), tiny_model_dir)  # trained in full
    assert saved["modules_to_save"] == ["lm_head"]
    assert common.lora_job_keys(saved)["model.modules_to_save"] == ["lm_head"]
    assert common.lora_rl_keys(saved)["actor_rollout_ref.model.modules_to_save"] == ["lm_head"]
    # a mixture-of-experts model's expert weights (peft's target_parameters; tests/test_lora_moe.py trains them)
    experts = lora_settings(peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=[
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]), tiny_model_dir)
    assert experts["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert common.lora_job_keys(experts)["model.target_parameters"] == experts["target_parameters"]
    assert common.lora_rl_keys(experts)["actor_rollout_ref.model.target_parameters"] == experts["target_parameters"]


def test_field_table_lists_every_field_once():
    cls = _grpo_like()
    table = common.field_table("GRPOConfig", cls.RULES)
    rows = [line for line in table.splitlines()[2:]]
    assert len(rows) == len(FIELDS["GRPOConfig"]) == 191
    assert "| `learning_rate` | `1e-06` | mapped |" in table
