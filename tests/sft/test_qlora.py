"""QLoRA (`model.load_in_4bit`, `actor_rollout_ref.model.load_in_4bit`): bitsandbytes 4-bit bases under LoRA in the
SFT / DPO / RM jobs and the RL actor. What is trained is the 4-bit base plus adapters; what is merged (the export, the
rollout's copy, `tiller export`) is that base dequantized plus the adapters, so its logits equal the trained model's;
merging into the original full-precision checkpoint would not (checked, so the comparisons can fail)."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from tests.sft.conftest import job_overrides, write_jsonl
from tiller.config import load_config
from tiller.config.jobs import DPOConfig, RMConfig, SFTConfig, validate_job
from tiller.errors import ConfigError


@pytest.fixture
def bnb():
    return pytest.importorskip("bitsandbytes")


def _quantized(model_dir, quant_type="nf4", double=False, cls=None):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tiller.models.quant import quantize_after_load

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double,
                                bnb_4bit_compute_dtype=torch.float32)
    return quantize_after_load((cls or AutoModelForCausalLM).from_pretrained(
        model_dir, quantization_config=config, device_map={"": "cpu"}))


def _ids(n=2, t=12):
    return torch.randint(5, 200, (n, t), generator=torch.Generator().manual_seed(0))


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids).logits.float()


@pytest.mark.parametrize("kind", ["lora", "dora", "saved_head"])
def test_dequantized_merge_is_the_trained_function(tiny_model_dir, bnb, kind):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tiller.models.lora import merge_lora
    from tiller.models.quant import is_quantized

    extra = {"dora": {"use_dora": True}, "saved_head": {"modules_to_save": ["lm_head"]}}.get(kind, {})
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, **extra)
    peft_model = get_peft_model(_quantized(tiny_model_dir, double=True), config)
    with torch.no_grad():  # the saved head trains too: move it off the base's
        for name, p in peft_model.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.05)
    ids = _ids()
    trained = _logits(peft_model, ids)
    assert is_quantized(peft_model)
    merged = merge_lora(peft_model)  # -> tiller.models.quant.dequantized_merge
    assert not is_quantized(merged) and type(merged).__name__ == "Qwen2ForCausalLM"
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    err = (_logits(merged, ids) - trained).abs().max().item()
    # the same adapters merged into the original full-precision checkpoint are another function
    torch.manual_seed(1)
    full = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config)
    full.load_state_dict({k: v for k, v in peft_model.state_dict().items() if "lora_" in k or "modules_to_save" in k},
                         strict=False)
    other = (_logits(full.merge_and_unload(), ids) - trained).abs().max().item()
    assert err < 1e-4 < 0.01 < other
    assert _logits(peft_model, ids).equal(trained)  # the training model is untouched


def test_rollout_copy_in_another_dtype_is_the_merged_model_and_follows_the_adapters(tiny_model_dir, bnb):
    from peft import LoraConfig, get_peft_model

    from tiller.rollout.base import WeightView

    torch.manual_seed(1)
    peft_model = get_peft_model(_quantized(tiny_model_dir), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False))
    base = peft_model.get_base_model()  # what the actor hands its engine: the adapters are injected in it
    view = WeightView(base, torch.float64)
    ids = _ids()
    assert view.is_copy and next(view.module.parameters()).dtype == torch.float64
    assert (_logits(view.module, ids) - _logits(peft_model, ids)).abs().max().item() < 1e-4
    with torch.no_grad():  # an optimizer step on the adapters
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)
    stale = (_logits(view.module, ids) - _logits(peft_model, ids)).abs().max().item()
    view.sync_if_stale()
    assert (_logits(view.module, ids) - _logits(peft_model, ids)).abs().max().item() < 1e-4 < 0.01 < stale


def _plain_dir(model_dir, out):
    """The 4-bit base dequantized, saved as an ordinary model dir (with the tokenizer)."""
    from transformers import AutoTokenizer

    from tiller.models.quant import unquantized_like

    unquantized_like(_quantized(model_dir)).save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def _losses(run) -> list[float]:
    return [r["train/loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in r]


def test_sft_trains_adapters_on_the_4bit_base_and_exports_what_it_trained(tiny_model_dir, sft_file, tmp_path, bnb):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tiller.models.checkpoint import QUANT_FILE, export_hf
    from tiller.trainer.sft import train_sft

    common = {"data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 4, "optim.lr": 1e-2}
    run = tmp_path / "qlora"
    train_sft(load_config(job_overrides(tiny_model_dir, sft_file, run, **common, **{
        "model.lora_rank": 8, "model.lora_alpha": 16, "model.load_in_4bit": True, "trainer.total_training_steps": 8}),
        schema=SFTConfig, validate=validate_job))
    losses = _losses(run)
    # step 1 (adapters zero) is the loss of the 4-bit base: that of its dequantized copy, not the original's
    first = {}
    for name, model in (("dequantized", _plain_dir(tiny_model_dir, tmp_path / "dq")), ("original", tiny_model_dir)):
        train_sft(load_config(job_overrides(model, sft_file, tmp_path / name, **common, **{
            "model.tokenizer_path": tiny_model_dir, "trainer.total_training_steps": 1, "trainer.export_hf": False}),
            schema=SFTConfig, validate=validate_job))
        first[name] = _losses(tmp_path / name)[0]
    assert losses[0] == pytest.approx(first["dequantized"], rel=1e-5)
    assert abs(losses[0] - first["original"]) > 1e-3
    assert losses[-1] < 0.8 * losses[0]  # it learns
    # the checkpoint keeps the adapter and the 4-bit settings; the export is base (dequantized) + adapter
    ckpt = run / "checkpoints" / "global_step_8" / "model"
    saved = json.loads((ckpt / QUANT_FILE).read_text())
    assert (saved["load_in_4bit"], saved["bnb_4bit_quant_type"]) == (True, "nf4")
    trained = PeftModel.from_pretrained(_quantized(tiny_model_dir), str(ckpt))
    exported = AutoModelForCausalLM.from_pretrained(run / "hf_model")
    assert "quantization_config" not in json.loads((run / "hf_model" / "config.json").read_text())
    ids = _ids()
    assert (_logits(exported, ids) - _logits(trained, ids)).abs().max().item() < 1e-4
    again = export_hf(run / "checkpoints" / "global_step_8", tmp_path / "export")  # `tiller export`
    assert (_logits(AutoModelForCausalLM.from_pretrained(again), ids) - _logits(exported, ids)).abs().max() < 1e-5


def _pairs(n: int) -> list[dict]:
    return [{"prompt": f"What is {a} + {a + 3}?", "chosen": f"The answer is {2 * a + 3}.", "rejected": "I do not know."}
            for a in range(n)]


def test_dpo_reference_is_the_4bit_base_and_rm_exports_a_plain_scorer(tiny_model_dir, tmp_path, bnb):
    from transformers import AutoModelForSequenceClassification

    from tiller.trainer.preference import train_dpo
    from tiller.trainer.rm import train_rm

    train = write_jsonl(tmp_path / "d.jsonl", _pairs(8))
    qlora = {"model.lora_rank": 8, "model.lora_alpha": 16, "model.load_in_4bit": True,
             "model.bnb_4bit_use_double_quant": True, "data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 4}
    run = tmp_path / "dpo"
    train_dpo(load_config(job_overrides(tiny_model_dir, train, run, **qlora, **{
        "optim.lr": 3e-3, "trainer.total_training_steps": 4, "trainer.export_hf": False}),
        schema=DPOConfig, validate=validate_job))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # step 1: policy (4-bit base, adapters zero) == reference (the same base, adapters off): loss log 2 exactly
    assert rows[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[-1]["train/rewards/margins"] > 0
    run = tmp_path / "rm"
    train_rm(load_config(job_overrides(tiny_model_dir, train, run, **qlora, **{
        "optim.lr": 3e-3, "trainer.total_training_steps": 2}), schema=RMConfig, validate=validate_job))
    scorer = AutoModelForSequenceClassification.from_pretrained(run / "hf_model")
    assert "quantization_config" not in json.loads((run / "hf_model" / "config.json").read_text())
    assert scorer.score.weight.dtype == torch.float32 and torch.isfinite(scorer(_ids()).logits).all()


def test_rl_actor_rolls_out_what_it_trains(tmp_path, tiny_model_dir, bnb):
    from tests.trainer.test_rl import REWARD_SRC, _train, make_cfg
    from tiller.tasks import arithmetic

    data = tmp_path / "data"
    arithmetic.write_task(data, n_train=16, n_test=4, seed=0)
    (data / "reward.py").write_text(REWARD_SRC)  # the digits' share of a response: it varies within a group
    cfg = make_cfg(tmp_path / "run", tiny_model_dir, data, "actor_rollout_ref.model.lora_rank=4",
                   "actor_rollout_ref.model.lora_alpha=8", "actor_rollout_ref.model.load_in_4bit=true",
                   "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.use_kl_loss=true",
                   "data.val_files=[]", "actor_rollout_ref.rollout.dtype=float32",
                   "actor_rollout_ref.actor.dtype=float32")
    metrics, changed, _ = _train(cfg)
    # step 2 rolls out with the updated adapters on the 4-bit base: the engine's log-probs are the actor's
    assert changed and metrics["training/rollout_probs_diff_max"] < 1e-4
    assert metrics["actor/kl_loss"] > 0  # the reference is the base with the adapters off
    assert (tmp_path / "run" / "checkpoints" / "global_step_2" / "model" / "quantization_config.json").exists()


def test_refusals_name_the_key(tiny_model_dir, sft_file, tmp_path, monkeypatch):
    def job(**extra):
        return load_config(job_overrides(tiny_model_dir, sft_file, tmp_path / "r", **extra), schema=SFTConfig,
                           validate=validate_job)

    with pytest.raises(ConfigError, match=r"model\.load_in_4bit=true needs LoRA"):
        job(**{"model.load_in_4bit": True})
    with pytest.raises(ConfigError, match=r"model\.bnb_4bit_quant_type='int4': must be one of nf4, fp4"):
        job(**{"model.lora_rank": 4, "model.load_in_4bit": True, "model.bnb_4bit_quant_type": "int4"})
    with pytest.raises(ConfigError, match=r"bnb_4bit_use_double_quant=True is only read with model\.load_in_4bit"):
        job(**{"model.lora_rank": 4, "model.bnb_4bit_use_double_quant": True})
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.load_in_4bit=true runs in one process"):
        load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.model.lora_rank=4",
                     "actor_rollout_ref.model.load_in_4bit=true", "trainer.backend=ray"])
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # not installed
    with pytest.raises(ConfigError, match=r"model\.load_in_4bit=true needs the bitsandbytes package"):
        job(**{"model.lora_rank": 4, "model.load_in_4bit": True})



def test_critic_qlora_values_are_the_4bit_bodys_and_only_adapters_and_head_train(tiny_model_dir, bnb):
    """critic.model.load_in_4bit (OpenRLHF's --load_in_4bit quantizes its critic too): the value model's body loads
    4-bit, its head stays full precision; the first values are the 4-bit body's with that head (B = 0), not the
    original body's; an update moves the adapters and the head only."""
    from transformers import AutoModelForTokenClassification, BitsAndBytesConfig

    from tests.trainer.test_dynamic_batches import _batch, _cfg
    from tiller.models.quant import quantize_after_load
    from tiller.workers.critic import CriticWorker

    lora = ("critic.optim.lr=1e-2", "critic.model.lora_rank=4", "critic.model.lora_alpha=8")
    full = CriticWorker(_cfg(tiny_model_dir, *lora), total_training_steps=1)
    q = CriticWorker(_cfg(tiny_model_dir, *lora, "critic.model.load_in_4bit=true"), total_training_steps=1)
    assert type(q.module.get_base_model().model.layers[0].self_attn.q_proj.base_layer).__name__ == "Linear4bit"
    head = q.module.get_base_model().score
    assert type(head.modules_to_save["default"]) is torch.nn.Linear  # the value head: full precision, trained
    batch = _batch(seed=3)
    values = q.compute_values(batch)["values"]
    # the 4-bit body (quantized by transformers here too, the head left out) with the same fresh head, a forward per row
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                                llm_int8_skip_modules=["score"])
    body = quantize_after_load(AutoModelForTokenClassification.from_pretrained(
        tiny_model_dir, num_labels=1, quantization_config=config, device_map={"": "cpu"}))
    with torch.no_grad():
        body.score.weight.copy_(head.modules_to_save["default"].weight)
        body.score.bias.copy_(head.modules_to_save["default"].bias)
    mask = batch["response_mask"].bool()
    P = batch["prompts"].shape[1]
    for i in range(len(batch["input_ids"])):
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep][None]
        with torch.no_grad():
            v = body.eval()(input_ids=ids).logits[0, :, 0]
        start = int((~batch["attention_mask"][i][:P].bool()).sum())  # left padding of the prompt
        n = int(mask[i].sum())
        torch.testing.assert_close(values[i, :n], v[P - start - 1:P - start - 1 + n], atol=1e-4, rtol=0)
    assert (values - full.compute_values(batch)["values"])[mask].abs().max() > 1e-3  # not the original body's
    before = {k: v.clone() for k, v in q.module.state_dict().items()}
    q.update_critic(batch)
    changed = {k for k, v in q.module.state_dict().items() if not torch.equal(before[k], v)}
    assert changed and all(".lora_" in k or "modules_to_save" in k for k in changed)
    with pytest.raises(ConfigError, match=r"critic\.model\.load_in_4bit=true needs LoRA"):
        _cfg(tiny_model_dir, "critic.model.load_in_4bit=true")
    with pytest.raises(ConfigError, match=r"critic\.model\.load_in_4bit=true runs in one process"):
        _cfg(tiny_model_dir, *lora, "critic.model.load_in_4bit=true", "trainer.backend=ray")
