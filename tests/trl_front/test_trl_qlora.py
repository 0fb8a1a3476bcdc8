"""QLoRA through tiller.trl: TRL's `quantization_config` (a trainer argument or in model_init_kwargs, as TRL's scripts
pass get_quantization_config's BitsAndBytesConfig) and ModelConfig's load_in_4bit map to tiller's model.load_in_4bit
keys; a 4-bit SFT run trains adapters on the 4-bit base; what tiller cannot honour is refused naming the field."""

from __future__ import annotations

import math

import pytest

from tests.trl_front.test_trl_grpo_translate import reward_len, rows
from tests.trl_front.test_trl_sft import MEMO
from tiller.errors import ConfigError
from tiller.trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ROWS = [{"prompt": p + " ", "completion": c} for p, c in MEMO]
LORA = dict(r=8, lora_alpha=16, target_modules="all-linear")


def _sft(model_dir, out, quant=None, **kw):
    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=8, max_steps=6, logging_steps=1, bf16=False,
                     report_to="none", learning_rate=1e-2, save_strategy="no", **kw)
    return SFTTrainer(model=str(model_dir), args=args, train_dataset=datasets.Dataset.from_list(ROWS),
                      peft_config=peft.LoraConfig(**LORA), quantization_config=quant)


def test_quantization_config_maps_to_4bit_keys_and_trains(tiny_model_dir, tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    bnb = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype="bfloat16")
    trainer = _sft(tiny_model_dir, tmp_path / "q", bnb)
    assert "bnb_4bit_compute_dtype=bfloat16: the 4-bit matmuls run in tiller's compute dtype, float32" \
        in capsys.readouterr().out
    keys = trainer.tiller_keys()
    assert (keys["model.load_in_4bit"], keys["model.bnb_4bit_quant_type"], keys["model.bnb_4bit_use_double_quant"],
            keys["model.lora_rank"]) == (True, "nf4", True, 8)
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    plain = _sft(tiny_model_dir, tmp_path / "lora")
    plain.train()
    plain_losses = [row["loss"] for row in plain.state.log_history if "loss" in row]
    # the same adapters on the 4-bit base: another first loss than on the full-precision base, and it learns
    assert abs(losses[0] - plain_losses[0]) > 1e-3 and losses[-1] < 0.8 * losses[0]
    assert all(math.isfinite(v) for v in losses)
    # as a dict in model_init_kwargs (TRL's scripts): BitsAndBytesConfig's own default quant type, fp4
    keys = _sft(tiny_model_dir, tmp_path / "d", model_init_kwargs={
        "quantization_config": {"load_in_4bit": True}}).tiller_keys()
    assert (keys["model.load_in_4bit"], keys["model.bnb_4bit_quant_type"]) == (True, "fp4")


def test_grpo_takes_quantization_config_on_the_actor(tiny_model_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    bnb = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    args = GRPOConfig(output_dir=str(tmp_path / "run"), bf16=False, model_init_kwargs={"quantization_config": bnb})
    keys, _ = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_len, args=args, train_dataset=rows(),
                          peft_config=peft.LoraConfig(**LORA, lora_dropout=0.0)).translate()
    assert (keys["actor_rollout_ref.model.load_in_4bit"], keys["actor_rollout_ref.model.bnb_4bit_quant_type"],
            keys["actor_rollout_ref.model.lora_rank"]) == (True, "nf4", 8)
    with pytest.raises(ConfigError, match=r"QLoRA trains adapters on the frozen 4-bit base: pass a peft_config"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward_len, args=args, train_dataset=rows())


@pytest.mark.parametrize("quant, match", [
    ({"load_in_8bit": True}, r"quantization_config\.load_in_8bit=True: refused"),
    ({"load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"}, r"bnb_4bit_quant_storage='bfloat16': refused"),
    ({"load_in_4bit": True, "llm_int8_skip_modules": ["lm_head"]}, r"llm_int8_skip_modules=\['lm_head'\]: refused"),
    ({"quant_method": "gptq", "bits": 4}, r"quantization_config=gptq: tiller quantizes with bitsandbytes"),
])
def test_what_tiller_cannot_honour_is_refused(tiny_model_dir, tmp_path, quant, match):
    with pytest.raises(ConfigError, match=match):
        _sft(tiny_model_dir, tmp_path / "r", quant)


def test_both_places_and_a_loaded_quantized_model_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="given both as a trainer argument and in args.model_init_kwargs"):
        _sft(tiny_model_dir, tmp_path / "b", {"load_in_4bit": True},
             model_init_kwargs={"quantization_config": {"load_in_4bit": True}})
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.is_loaded_in_4bit = True  # what transformers marks a bitsandbytes-loaded model with
    with pytest.raises(ConfigError, match="model: a model loaded with bitsandbytes quantization: pass its dir"):
        SFTTrainer(model=model, args=SFTConfig(output_dir=str(tmp_path / "m"), bf16=False, report_to="none"),
                   processing_class=transformers.AutoTokenizer.from_pretrained(tiny_model_dir),
                   train_dataset=datasets.Dataset.from_list(ROWS), peft_config=peft.LoraConfig(**LORA))
