"""tiller.trl.GRPOConfig / GRPOTrainer without training: TRL's defaults and post-init, every field classified, the
batch arithmetic and loss types on verl's keys (worked numbers), the data written, refusals naming the field."""

from __future__ import annotations

import json

import pytest

from tiller.errors import ConfigError, DataError
from tiller.trl import GRPOConfig, GRPOTrainer, RLOOConfig
from tiller.trl.common import TRAINING_ARGS_RULES, classify, field_table
from tiller.trl.fields import FIELDS
from tiller.trl.grpo import GRPO_RULES

A = "actor_rollout_ref.actor"


def reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def rows(n=24, conversational=False):
    prompt = (lambda i: [{"role": "user", "content": f"q{i}"}]) if conversational else (lambda i: f"q{i} ")
    return [{"prompt": prompt(i), "answer": str(i)} for i in range(n)]


def translate(tiny_model_dir, tmp_path, data=None, **kw):
    kw.setdefault("bf16", False)
    args = GRPOConfig(output_dir=str(tmp_path / "run"), **kw)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_len, args=args,
                          train_dataset=data if data is not None else rows())
    keys, notices = trainer.translate()
    return keys, notices, trainer


def test_every_grpo_field_has_one_rule_and_the_defaults_are_trls():
    assert set(GRPOConfig.RULES) == set(FIELDS["GRPOConfig"]) and len(FIELDS["GRPOConfig"]) == 191
    assert set(GRPO_RULES) | set(TRAINING_ARGS_RULES) == set(FIELDS["GRPOConfig"])
    args = GRPOConfig(output_dir="o")
    # TRL's own defaults (GRPOConfig changes TrainingArguments' learning_rate, logging_steps, checkpointing, bf16)
    assert (args.learning_rate, args.logging_steps, args.gradient_checkpointing, args.bf16) == (1e-6, 10, True, True)
    assert (args.loss_type, args.beta, args.num_generations, args.scale_rewards) == ("dapo", 0.0, 8, "group")
    assert (args.generation_batch_size, args.steps_per_generation) == (8, 1)  # post-init: 8 x 1 process x 1
    logical, notices = classify(args)
    assert notices == [] and logical["lr_scheduler"] == "linear" and logical["dtype"] == "bfloat16"


def test_config_matches_trls_own_after_post_init():
    trl = pytest.importorskip("trl")
    kw = dict(output_dir="o", per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
              steps_per_generation=4, use_cpu=True, scale_rewards=False)
    theirs, ours = trl.GRPOConfig(**kw), GRPOConfig(**kw)
    # transformers' conversions tiller does not read: report_to "none" -> [], debug "" -> [], accelerate objects,
    # CPU-dependent dataloader / padding / tqdm settings
    skip = {"report_to", "debug", "accelerator_config", "dataloader_pin_memory", "pad_to_multiple_of", "disable_tqdm"}
    diff = {k: (getattr(theirs, k), getattr(ours, k)) for k in FIELDS["GRPOConfig"]
            if k not in skip and getattr(theirs, k) != getattr(ours, k)}
    assert diff == {}
    assert (ours.generation_batch_size, ours.scale_rewards) == (16, "none")


def test_batch_arithmetic_on_verl_keys(tiny_model_dir, tmp_path):
    # 4 completions a micro-batch, 2 per optimizer step, 4 slices a generation batch, each reused twice:
    # generation batch 4 x 4 = 16 completions = 4 prompts x 4; mini-batch 4 x 2 / 4 = 2 prompts;
    # k = 2 iterations x 4 slices / 2 = 4 optimizer steps a tiller step; 24 rows -> 6 generation batches an
    # epoch = 24 optimizer steps (transformers' count), 3 epochs = 72 = 18 tiller steps
    keys, notices, trainer = translate(tiny_model_dir, tmp_path, per_device_train_batch_size=4,
                                       gradient_accumulation_steps=2, num_generations=4, steps_per_generation=4,
                                       num_iterations=2, warmup_steps=8)
    assert keys["data.train_batch_size"] == 4 and keys["actor_rollout_ref.rollout.n"] == 4
    assert keys[f"{A}.ppo_mini_batch_size"] == 2 and keys[f"{A}.ppo_micro_batch_size_per_gpu"] == 4
    assert keys[f"{A}.ppo_epochs"] == 2 and keys["trainer.total_training_steps"] == 18
    assert keys[f"{A}.optim.lr_warmup_steps"] == 2  # 8 optimizer steps = 2 generation batches
    assert trainer.total_steps == 72 and trainer.arithmetic["k"] == 4
    assert any("once per generation batch" in n for n in notices)
    assert any(n.startswith("loss_type='dapo': TRL divides by the generation batch's tokens") for n in notices)
    # TRL's defaults written out where tiller's differ
    assert keys[f"{A}.optim.lr"] == 1e-6 and keys[f"{A}.optim.weight_decay"] == 0.0
    assert keys[f"{A}.optim.betas"] == [0.9, 0.999] and keys[f"{A}.optim.warmup_style"] == "linear"
    assert keys[f"{A}.clip_ratio_low"] == keys[f"{A}.clip_ratio_high"] == 0.2
    assert keys[f"{A}.clip_ratio_c"] == 1e9 and keys[f"{A}.use_kl_loss"] is False
    assert keys["trainer.seed"] == 42 and keys["data.seed"] == 42 and keys["trainer.save_freq"] == 125
    assert keys["actor_rollout_ref.rollout.top_k"] == -1 and keys["data.max_response_length"] == 512


def test_loss_types_map_to_policy_loss_and_aggregation(tiny_model_dir, tmp_path):
    expect = {"grpo": ("vanilla", "seq-mean-token-mean"), "bnpo": ("vanilla", "token-mean"),
              "dr_grpo": ("vanilla", "seq-mean-token-sum-norm"), "dapo": ("vanilla", "token-mean"),
              "luspo": ("vanilla", "seq-mean-token-sum"), "cispo": ("cispo", "token-mean"),
              "sapo": ("sapo", "seq-mean-token-mean"), "vespo": ("vespo", "token-mean")}
    for i, (loss_type, (mode, agg)) in enumerate(expect.items()):
        keys, _, _ = translate(tiny_model_dir, tmp_path / str(i), loss_type=loss_type, max_completion_length=7,
                               epsilon_high=5.0 if loss_type == "cispo" else None)
        assert (keys[f"{A}.policy_loss.loss_mode"], keys[f"{A}.loss_agg_mode"]) == (mode, agg), loss_type
    keys, _, _ = translate(tiny_model_dir, tmp_path / "dr", loss_type="dr_grpo", max_completion_length=7)
    assert keys[f"{A}.loss_scale_factor"] == 7  # Dr.GRPO's constant: max_completion_length
    keys, _, _ = translate(tiny_model_dir, tmp_path / "ci", loss_type="cispo", epsilon_high=5.0)
    assert (keys[f"{A}.clip_ratio_low"], keys[f"{A}.clip_ratio_high"]) == (1.0, 4.0)  # clamp(r, max=5)
    keys, _, _ = translate(tiny_model_dir, tmp_path / "gs", importance_sampling_level="sequence", beta=0.04,
                           use_bias_correction_kl=False, scale_rewards="none", delta=1.5)
    assert keys[f"{A}.policy_loss.loss_mode"] == "gspo" and keys[f"{A}.kl_loss_coef"] == 0.04
    assert keys[f"{A}.kl_loss_type"] == "low_var_kl" and keys["algorithm.norm_adv_by_std_in_grpo"] is False
    assert keys[f"{A}.clip_ratio_c"] == 1.5 and keys["algorithm.norm_adv_epsilon"] == 1e-4
    assert keys[f"{A}.kl_loss_importance_weight"] is False
    keys, _, _ = translate(tiny_model_dir, tmp_path / "bc", beta=0.04)  # TRL's default use_bias_correction_kl=True
    assert keys[f"{A}.use_kl_loss"] is True and keys[f"{A}.kl_loss_importance_weight"] is True
    keys, _, _ = translate(tiny_model_dir, tmp_path / "b0")  # beta 0: no KL term to weight
    assert keys[f"{A}.use_kl_loss"] is False and f"{A}.kl_loss_importance_weight" not in keys
    keys, _, _ = translate(tiny_model_dir, tmp_path / "ve", loss_type="vespo", vespo_k_neg=4.0, use_vllm=True,
                           vllm_importance_sampling_mode="token_mask")
    assert [keys[f"{A}.policy_loss.vespo_{k}"] for k in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")] == \
        [2.0, 3.0, 4.0, 2.0]
    assert keys["algorithm.rollout_correction.rollout_is"] == "token"  # TRL's ratio, into the sequence weight
    with pytest.raises(ConfigError, match="VESPO loss requires `vllm_importance_sampling_mode` to be either"):
        translate(tiny_model_dir, tmp_path / "vs", loss_type="vespo", use_vllm=True)  # TRL's default sequence_mask


def test_normalize_then_sum_maps_to_gdpo_over_sequences(tiny_model_dir, tmp_path):
    def reward_short(completions, **kwargs):
        return [float(len(c) < 3) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "run"), bf16=False, multi_objective_aggregation="normalize_then_sum",
                      reward_weights=[1.0, 0.5])
    keys, _ = GRPOTrainer(str(tiny_model_dir), [reward_len, reward_short], args=args, train_dataset=rows()).translate()
    assert (keys["algorithm.adv_estimator"], keys["algorithm.gdpo_reward_keys"], keys["algorithm.gdpo_reward_weights"],
            keys["algorithm.gdpo_normalization"], keys["algorithm.norm_adv_epsilon"]) == \
        ("gdpo", ["reward_len", "reward_short"], [1.0, 0.5], "sequence", 1e-4)
    with pytest.raises(ConfigError, match="^scale_rewards='none': refused: TRL's normalize_then_sum ignores"):
        translate(tiny_model_dir, tmp_path / "n", multi_objective_aggregation="normalize_then_sum",
                  scale_rewards="none")
    args = GRPOConfig(output_dir=str(tmp_path / "d"), bf16=False, multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ConfigError, match="names .'reward_len', 'reward_len'. repeat"):
        GRPOTrainer(str(tiny_model_dir), [reward_len, reward_len], args=args, train_dataset=rows()).translate()


def test_use_vllm_colocate_maps_trls_importance_sampling(tiny_model_dir, tmp_path):
    from tiller.config import load_config
    from tiller.trl.common import overrides

    rc = "algorithm.rollout_correction"
    keys, _, _ = translate(tiny_model_dir, tmp_path / "a", use_vllm=True)  # TRL's default: sequence_mask, max 3
    assert keys["actor_rollout_ref.rollout.name"] == "vllm" and keys[f"{rc}.rollout_is"] == "sequence"
    assert keys[f"{rc}.rollout_is_threshold"] == "1e-30_3.0"
    load_config(overrides(keys))  # tiller's validation takes the translated keys
    keys, _, _ = translate(tiny_model_dir, tmp_path / "b", use_vllm=True, vllm_gpu_memory_utilization=0.5,
                           vllm_importance_sampling_mode="token_truncate")
    assert (keys[f"{rc}.rollout_is"], keys[f"{rc}.rollout_is_threshold"]) == ("token", "3.0")
    assert keys["actor_rollout_ref.rollout.gpu_memory_utilization"] == 0.5
    keys, _, _ = translate(tiny_model_dir, tmp_path / "c", vllm_gpu_memory_utilization=0.5)  # read only with use_vllm
    assert "actor_rollout_ref.rollout.name" not in keys and f"{rc}.rollout_is" not in keys


def test_data_is_written_under_the_run_dir_with_the_longest_prompt(tiny_model_dir, tmp_path):
    from tiller.models.loading import load_tokenizer

    data = rows(8, conversational=True)
    data[3]["prompt"] = [{"role": "user", "content": "a much longer question than the others " * 3}]
    keys, _, _ = translate(tiny_model_dir, tmp_path, data=data, chat_template_kwargs={"x": 1})
    tok = load_tokenizer(str(tiny_model_dir))
    longest = max(len(tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)["input_ids"]) for r in data)
    assert keys["data.max_prompt_length"] == longest and keys["data.apply_chat_template"] is True
    assert keys["data.apply_chat_template_kwargs"] == {"x": 1}
    written = [json.loads(line) for line in (tmp_path / "run" / "data" / "train.jsonl").read_text().splitlines()]
    assert [r["extra_info"] for r in written] == [{"trl_row": i, "trl_split": "train"} for i in range(8)]
    assert written[3]["prompt"] == data[3]["prompt"]
    keys, _, _ = translate(tiny_model_dir, tmp_path / "s", data=rows(8))
    assert keys["data.apply_chat_template"] is False  # standard prompts: no chat template, as TRL


@pytest.mark.parametrize("field,value,match", [
    ("loss_type", "gmpo", "^loss_type='gmpo': refused"),
    ("scale_rewards", "median", "^scale_rewards='median': refused"),
    ("push_to_hub", True, "^push_to_hub=True: refused"),
    ("multi_objective_aggregation", "max", "^multi_objective_aggregation='max': refused"),
    ("steps_per_generation", 3, "^steps_per_generation=3: refused"),
    ("delta", 1.1, "^delta=1.1: refused"),
    ("neftune_noise_alpha", 5.0, "^neftune_noise_alpha=5.0: refused: NEFTune noise in the policy's training"),
    ("sync_ref_model", True, "^sync_ref_model=True: refused: with beta=0.0 no reference model is used"),
    ("entropy_coef", 0.01, "^entropy_coef=0.01: refused"),  # loss_type dapo but gradient_accumulation_steps=2
])
def test_refusals_name_the_field(tiny_model_dir, tmp_path, field, value, match):
    with pytest.raises(ConfigError, match=match):
        translate(tiny_model_dir, tmp_path, gradient_accumulation_steps=2, **{field: value})


def test_generation_kwargs_stop_strings_map_and_the_rest_is_checked(tiny_model_dir, tmp_path):
    keys, _, _ = translate(tiny_model_dir, tmp_path, generation_kwargs={
        "stop": ["</answer>", "\n\n"], "repetition_penalty": 1.0, "temperature": 1.0, "top_k": -1, "n": 1})
    assert keys["actor_rollout_ref.rollout.stop"] == ["</answer>", "\n\n"]
    keys, _, _ = translate(tiny_model_dir, tmp_path / "h", generation_kwargs={"stop_strings": "END", "do_sample": True})
    assert keys["actor_rollout_ref.rollout.stop"] == ["END"]
    assert keys["actor_rollout_ref.rollout.repetition_penalty"] == 1.0
    # the penalties: the field maps, and a generation_kwargs penalty wins over it (TRL updates the field's kwargs)
    keys, _, _ = translate(tiny_model_dir, tmp_path / "p", repetition_penalty=1.2)
    assert keys["actor_rollout_ref.rollout.repetition_penalty"] == 1.2
    keys, _, _ = translate(tiny_model_dir, tmp_path / "q", repetition_penalty=1.2, generation_kwargs={
        "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.25})
    assert {k.rsplit(".", 1)[1]: v for k, v in keys.items() if k.endswith("_penalty")} == {
        "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.25}
    # vllm_structured_outputs_regex: the rollout's regex constraint (tiller applies it on its native engine too)
    keys, _, _ = translate(tiny_model_dir, tmp_path / "r", vllm_structured_outputs_regex=r"<answer>\d+</answer>")
    assert keys["actor_rollout_ref.rollout.structured_outputs_regex"] == r"<answer>\d+</answer>"
    assert "actor_rollout_ref.rollout.structured_outputs_regex" not in translate(tiny_model_dir, tmp_path / "s")[0]
    for kwargs, needle in [({"temperature": 0.7}, "generation_kwargs\\['temperature'\\]=0.7: refused: set "
                                                  "temperature=0.7 in the config instead"),
                           ({"eos_token_id": 3}, "generation_kwargs\\['eos_token_id'\\]=3: refused")]:
        with pytest.raises(ConfigError, match=needle):
            translate(tiny_model_dir, tmp_path / "x", generation_kwargs=kwargs)


def test_token_masks_map_to_actor_keys(tiny_model_dir, tmp_path):
    keys, _, _ = translate(tiny_model_dir, tmp_path, top_entropy_quantile=0.2, off_policy_mask_threshold=0.5)
    assert keys["actor_rollout_ref.actor.top_entropy_quantile"] == 0.2
    assert keys["actor_rollout_ref.actor.off_policy_mask_threshold"] == 0.5
    keys, _, _ = translate(tiny_model_dir, tmp_path / "d")
    assert "actor_rollout_ref.actor.top_entropy_quantile" not in keys  # TRL's defaults: the masks off
    assert "actor_rollout_ref.actor.off_policy_mask_threshold" not in keys
    assert "actor_rollout_ref.model.lm_head_fp32" not in keys
    keys, _, _ = translate(tiny_model_dir, tmp_path / "h", cast_lm_head_to_fp32=True)  # ScaleRL's fp32 head
    assert keys["actor_rollout_ref.model.lm_head_fp32"] is True
    assert "actor_rollout_ref.model.use_fused_kernels" not in keys
    keys, _, _ = translate(tiny_model_dir, tmp_path / "l", use_liger_kernel=True)  # the head fused with the loss
    assert keys["actor_rollout_ref.model.use_fused_kernels"] is True
    assert keys["actor_rollout_ref.model.use_remove_padding"] is True
    with pytest.raises(ConfigError, match="load_best_model_at_end=True: refused: tiller's RL trainers keep the last"):
        translate(tiny_model_dir, tmp_path / "b", load_best_model_at_end=True)


def test_refused_arguments_and_unknown_keywords(tiny_model_dir, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"^GRPOTrainer\(optimizers=...\): refused"):
        GRPOTrainer(str(tiny_model_dir), reward_len, args=args, train_dataset=rows(), optimizers=(object(), None))
    with pytest.raises(ConfigError, match=r"^callbacks\[0\]: a object, not a transformers TrainerCallback"):
        GRPOTrainer(str(tiny_model_dir), reward_len, args=args, train_dataset=rows(), callbacks=[object()])
    with pytest.raises(ConfigError, match=r"^vllm_mode='server': refused"):
        GRPOTrainer(str(tiny_model_dir), reward_len, train_dataset=rows(),
                    args=GRPOConfig(output_dir="o", use_vllm=True, vllm_mode="server"))
    with pytest.raises(TypeError, match="did you mean 'max_completion_length'"):
        GRPOConfig(max_completion_lenght=8)
    with pytest.raises(ConfigError, match="divisible by num_generations"):
        GRPOConfig(per_device_train_batch_size=6, num_generations=4)
    with pytest.raises(DataError, match="^train_dataset: no 'prompt' column"):
        GRPOTrainer(str(tiny_model_dir), reward_len, args=args, train_dataset=[{"text": "x"}])
    with pytest.raises(ConfigError, match="^train_dataset: an 'images' column"):
        GRPOTrainer(str(tiny_model_dir), reward_len, args=args, train_dataset=[{"prompt": "x", "images": []}])


def test_field_table_in_docs_is_the_generated_one():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "trl.md").read_text()
    assert field_table("GRPOConfig", GRPOConfig.RULES) in doc
    assert field_table("RLOOConfig", RLOOConfig.RULES) in doc


def test_reward_model_paths_are_named_as_trl_names_them(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(str(tiny_model_dir), [reward_len, str(tiny_model_dir)], train_dataset=rows(8),
                          args=GRPOConfig(output_dir=str(tmp_path / "run"), reward_weights=[1.0, 0.5]))
    assert trainer.rewards.names == ["reward_len", "qwen2"]  # a model: its dir's name
    assert trainer.rewards.weights.tolist() == [1.0, 0.5]


def test_in_process_rewards_refuse_the_ray_backend(tiny_model_dir, tmp_path):
    from tiller.config import load_config
    from tiller.trainer.rl import RLTrainer
    from tiller.trl.common import overrides

    keys, _, trainer = translate(tiny_model_dir, tmp_path)
    cfg = load_config(overrides({**keys, "trainer.backend": "ray"}))
    with pytest.raises(ConfigError, match="^trainer.backend=ray with an in-process reward function"):
        RLTrainer(cfg, reward_fn=trainer.rewards)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_python_m_tiller_trl_prints_the_table(capsys):
    from tiller.trl.__main__ import main

    assert main(["RLOOConfig"]) == 0
    assert capsys.readouterr().out == field_table("RLOOConfig", RLOOConfig.RULES)
    assert main(["PPOConfig"]) == 2 and "usage: python -m tiller.trl CLASS" in capsys.readouterr().err


def test_scale_rewards_batch_divides_by_the_batch_std(tiny_model_dir, tmp_path):
    keys, _, _ = translate(tiny_model_dir, tmp_path, scale_rewards="batch")
    assert keys["algorithm.norm_adv_std_scope"] == "batch" and keys["algorithm.norm_adv_by_std_in_grpo"] is True


def test_a_loaded_model_without_tokenizer_uses_its_source_dirs_tokenizer(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trainer = GRPOTrainer(model, reward_len, train_dataset=rows(8), args=GRPOConfig(output_dir=str(tmp_path / "r")))
    assert trainer.model_path == str(tmp_path / "r" / "input_model") and trainer.tokenizer_path == str(tiny_model_dir)
    assert trainer.processing_class.pad_token == "<|pad|>"  # loaded from the model's source dir, as TRL
    assert (tmp_path / "r" / "input_model" / "model.safetensors").exists()


def test_entropy_coef_maps_where_trls_bonus_is_tillers(tiny_model_dir, tmp_path):
    # one micro-batch per optimizer step: TRL's per-micro-batch token mean = tiller's token-mean bonus, for any loss
    keys, _, _ = translate(tiny_model_dir, tmp_path, entropy_coef=0.01, loss_type="grpo")
    assert keys[f"{A}.entropy_coeff"] == 0.01 and keys[f"{A}.entropy_agg_mode"] == "token-mean"
    assert keys[f"{A}.loss_agg_mode"] == "seq-mean-token-mean"  # the policy term keeps the loss type's
    with pytest.raises(ConfigError, match="^entropy_coef=0.01: refused"):
        translate(tiny_model_dir, tmp_path / "g", entropy_coef=0.01, gradient_accumulation_steps=2)
    keys, _, _ = translate(tiny_model_dir, tmp_path / "a", use_adaptive_entropy=True, entropy_coef=0.02,
                           entropy_coef_min=0.01, entropy_target=1.5)
    ae = f"{A}.adaptive_entropy"
    assert {k: keys[f"{ae}.{k}"] for k in ("enable", "init_coeff", "target_entropy", "delta", "max_coeff",
                                            "min_coeff", "inclusive")} == \
        dict(enable=True, init_coeff=0.02, target_entropy=1.5, delta=0.005, max_coeff=1.0, min_coeff=0.01,
             inclusive=True)
    assert keys[f"{A}.entropy_coeff"] == 0.0 and keys[f"{A}.entropy_agg_mode"] == "token-mean"
    with pytest.raises(ConfigError, match="^use_adaptive_entropy=True: refused: TRL updates the coefficient every "
                                          "optimizer step"):
        translate(tiny_model_dir, tmp_path / "b", use_adaptive_entropy=True, steps_per_generation=2)
    with pytest.raises(ConfigError, match="^entropy_coef=0.5: refused: the adaptive controller's start"):
        translate(tiny_model_dir, tmp_path / "c", use_adaptive_entropy=True, entropy_coef=0.5, entropy_coef_max=0.1)


def test_lora_dropout_maps_to_the_actor_unless_dropout_is_disabled(tiny_model_dir, tmp_path):
    """TRL's peft_config.lora_dropout (its CLI default 0.05) is the actor's LoRA dropout (in the update's forward,
    tests/trainer/test_lora_dropout_rl.py); disable_dropout=True zeroes it, as TRL's disable_dropout_in_model zeroes
    peft's dropout modules."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])
    for disable, want in ((False, 0.05), (True, None)):
        args = GRPOConfig(output_dir=str(tmp_path / f"run{disable}"), bf16=False, disable_dropout=disable)
        keys, _ = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_len, args=args, train_dataset=rows(),
                              peft_config=lora).translate()
        assert keys.get("actor_rollout_ref.model.lora_dropout") == want and keys["actor_rollout_ref.model.lora_rank"] == 4


def test_torch_compile_maps_to_the_actors_compiled_layers(tiny_model_dir, tmp_path):
    """TRL's torch_compile (or a backend / mode, which turn it on in transformers) compiles the policy's decoder
    layers (actor.use_torch_compile); off by default, as TRL."""
    key = "actor_rollout_ref.actor.use_torch_compile"
    cases = [({}, False), ({"torch_compile": True}, True), ({"torch_compile_backend": "inductor"}, True),
             ({"torch_compile_mode": "default"}, True)]
    for i, (kw, want) in enumerate(cases):
        keys, _, _ = translate(tiny_model_dir, tmp_path / str(i), **kw)
        assert keys.get(key, False) is want, (kw, keys.get(key))
