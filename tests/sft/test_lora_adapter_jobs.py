"""The offline jobs continue from a saved LoRA adapter (`model.lora_adapter_path`, verl's SFT key): `tiller sft` starts
at base + adapter and exports base + trained adapter; DPO's reference is the starting policy (base + adapter); bad
adapter settings exit 2 naming the key."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from tests.sft.conftest import job_overrides, write_jsonl
from tests.test_lora_adapter import TARGETS, _perturbed_lora, assert_base_plus_adapter
from tiller.config import load_config
from tiller.config.jobs import DPOConfig, SFTConfig, validate_job


@pytest.fixture(scope="module")
def adapter_and_merged(tiny_model_dir, tmp_path_factory):
    """A saved adapter (rank 4, alpha 8, q_proj / v_proj) and the plain model it makes merged into the base."""
    from tiller.models.lora import merge_lora

    root = tmp_path_factory.mktemp("job_adapter")
    _perturbed_lora(tiny_model_dir).save_pretrained(root / "adapter")
    merge_lora(_perturbed_lora(tiny_model_dir)).save_pretrained(root / "merged")
    return root / "adapter", root / "merged"


def _first_loss(run) -> float:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["train/loss"]


def test_sft_from_adapter_starts_there_and_exports_the_trained_adapter(tiny_model_dir, sft_file, tmp_path,
                                                                        adapter_and_merged):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tiller.trainer.sft import train_sft

    adapter, merged = adapter_and_merged
    common = {"data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 8, "optim.lr": 1e-2}
    run = tmp_path / "lora"
    train_sft(load_config(job_overrides(tiny_model_dir, sft_file, run, **common, **{
        "model.lora_adapter_path": adapter, "trainer.total_training_steps": 2}), schema=SFTConfig,
        validate=validate_job))
    # step 1's loss (before any update) is the loss of base + adapter: that of the merged model trained in full
    full = tmp_path / "full"
    train_sft(load_config(job_overrides(merged, sft_file, full, **common, **{
        "model.tokenizer_path": tiny_model_dir, "trainer.total_training_steps": 1, "trainer.export_hf": False}),
        schema=SFTConfig, validate=validate_job))
    assert _first_loss(run) == pytest.approx(_first_loss(full), rel=1e-5)
    # hf_model = the base with the trained adapter (the step-2 checkpoint's) merged in: W + (alpha / r) B A
    ckpt = run / "checkpoints" / "global_step_2" / "model"
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, TARGETS)
    trained = load_file(str(ckpt / "adapter_model.safetensors"))
    initial = load_file(str(adapter / "adapter_model.safetensors"))
    assert all(not torch.equal(trained[k], initial[k]) for k in initial if ".lora_B." in k)  # it trained
    exported = AutoModelForCausalLM.from_pretrained(run / "hf_model").state_dict()
    assert assert_base_plus_adapter(exported, tiny_model_dir, trained, 8 / 4) == len(trained) // 2


def test_dpo_reference_is_base_plus_adapter(tiny_model_dir, tmp_path, adapter_and_merged):
    from tiller.trainer.preference import train_dpo

    rows = [{"prompt": f"What is {a} + {a + 3}?", "chosen": f"The answer is {2 * a + 3}.",
             "rejected": "I do not know."} for a in range(4)]
    train = write_jsonl(tmp_path / "d.jsonl", rows)
    run = tmp_path / "dpo"
    train_dpo(load_config(job_overrides(tiny_model_dir, train, run, **{
        "model.lora_adapter_path": adapter_and_merged[0], "data.train_batch_size": 4,
        "data.micro_batch_size_per_gpu": 4, "trainer.total_training_steps": 1, "trainer.export_hf": False}),
        schema=DPOConfig, validate=validate_job))
    # step 1: the policy (base + adapter) equals the reference, so the loss is log 2 exactly as DPO starts (with the
    # base as reference it would not be: the adapter moves the log-probs)
    assert _first_loss(run) == pytest.approx(math.log(2), abs=1e-5)


@pytest.mark.parametrize("extra, needles", [
    ({"model.lora_adapter_path": "{tmp}/nope"}, ["model.lora_adapter_path=", "no such file or directory"]),
    ({"model.lora_adapter_path": "{adapter}", "model.lora_rank": 8}, ["model.lora_rank=8 but the adapter", "has 4"]),
    ({"model.lora_adapter_path": "{model}"}, ["model.lora_adapter_path=", "no adapter_config.json"]),
    ({"model.lora_rank": 4, "model.modules_to_save": "[lm_heads]"}, ["model.modules_to_save: no module named"]),
])
def test_cli_bad_adapter_exits_2(tiny_model_dir, sft_file, tmp_path, capsys, adapter_and_merged, extra, needles):
    from tiller.cli import main

    fill = {"tmp": tmp_path, "adapter": adapter_and_merged[0], "model": tiny_model_dir}
    extra = {k: str(v).format(**fill) for k, v in extra.items()}
    assert main(["sft", *job_overrides(tiny_model_dir, sft_file, tmp_path / "r", **extra)]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_spin_from_adapter_starts_there_then_trains_fresh_adapters_of_its_shape(tiny_model_dir, tmp_path,
                                                                                adapter_and_merged):
    from safetensors.torch import load_file

    from tiller.config.jobs import SPINConfig
    from tiller.trainer.spin import run_spin

    rows = [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a, b in zip(range(10, 18), range(50, 58))]
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    run = tmp_path / "run"
    summary = run_spin(load_config([
        f"model.partial_pretrain={tiny_model_dir}", f"model.lora_adapter_path={adapter_and_merged[0]}",
        f"data.train_files=[{data}]", "data.apply_chat_template=false", "data.max_length=32",
        "data.train_batch_size=8", "data.micro_batch_size_per_gpu=8", "trainer.total_training_steps=1",
        "trainer.logger=[jsonl]", "algorithm.iterations=2", "algorithm.max_new_tokens=4",
        f"trainer.default_local_dir={run}"], schema=SPINConfig, validate=validate_job))
    assert [r["iteration"] for r in summary["iterations"]] == [0, 1]
    largest_b = []
    for t in (0, 1):
        # p_theta_0 = base + adapter is iteration 0's reference and policy; iteration 1 starts from iteration 0's
        # merged model with fresh adapters (B = 0): each first loss is log 2
        assert _first_loss(run / f"iter_{t}") == pytest.approx(math.log(2), abs=1e-5)
        ckpt = next((run / f"iter_{t}" / "checkpoints").glob("*/model"))
        config = json.loads((ckpt / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, TARGETS)
        weights = load_file(str(ckpt / "adapter_model.safetensors"))
        largest_b.append(max(v.abs().max().item() for k, v in weights.items() if ".lora_B." in k))
    # iteration 0 trained the saved adapter (B ~ 0.3 N(0, 1)); iteration 1 one step of fresh adapters (B from 0 by
    # about lr = 1e-5), not the saved adapter applied a second time
    assert largest_b[0] > 0.1 and largest_b[1] < 1e-3, largest_b
    assert config["base_model_name_or_path"] == str(run / "iter_0" / "hf_model")


def _two_lora_steps(model_dir, sft_file, run, flag: str):
    """Two SFT steps with rank-4, alpha-8 adapters on q_proj / v_proj and `flag` on; the step-2 adapter dir."""
    from tiller.trainer.sft import train_sft

    train_sft(load_config(job_overrides(model_dir, sft_file, run, **{
        "data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 8, "optim.lr": 1e-2, "model.lora_rank": 4,
        "model.lora_alpha": 8, "model.target_modules": "[q_proj,v_proj]", flag: True,
        "trainer.total_training_steps": 2}), schema=SFTConfig, validate=validate_job))
    return run / "checkpoints" / "global_step_2" / "model"


def test_rslora_scales_by_alpha_over_sqrt_rank_into_the_export(tiny_model_dir, sft_file, tmp_path):
    # model.use_rslora (peft's, TRL's): rank 4, alpha 8 -> scale 8 / sqrt(4) = 4 (plain LoRA: 2); the adapter config
    # says so, the exported model is W + 4 B A, and continuing from that adapter keeps it (a contradicting key stops)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tiller.errors import ConfigError
    from tiller.models.loading import load_causal_lm
    from tiller.models.lora import attach_lora

    run = tmp_path / "rs"
    ckpt = _two_lora_steps(tiny_model_dir, sft_file, run, "model.use_rslora")
    assert json.loads((ckpt / "adapter_config.json").read_text())["use_rslora"] is True
    trained = load_file(str(ckpt / "adapter_model.safetensors"))
    exported = AutoModelForCausalLM.from_pretrained(run / "hf_model").state_dict()
    assert assert_base_plus_adapter(exported, tiny_model_dir, trained, 8 / math.sqrt(4)) == len(trained) // 2
    cfg = load_config(job_overrides(tiny_model_dir, sft_file, tmp_path / "x", **{"model.lora_adapter_path": ckpt}),
                      schema=SFTConfig, validate=validate_job)
    peft_model = attach_lora(load_causal_lm(tiny_model_dir), cfg.model, "model")
    assert peft_model.peft_config["default"].use_rslora is True  # the adapter's own setting
    with pytest.raises(ConfigError, match="use_rslora"):
        load_config(job_overrides(tiny_model_dir, sft_file, tmp_path / "y", **{"model.use_rslora": True}),
                    schema=SFTConfig, validate=validate_job)


def test_dora_trains_and_exports_peft_merge(tiny_model_dir, sft_file, tmp_path):
    # model.use_dora: the checkpoint's adapter is a DoRA adapter (magnitude vectors), and hf_model is peft's own merge
    # of it into the base
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = tmp_path / "dora"
    ckpt = _two_lora_steps(tiny_model_dir, sft_file, run, "model.use_dora")
    assert json.loads((ckpt / "adapter_config.json").read_text())["use_dora"] is True
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ckpt)
    assert any("lora_magnitude_vector" in k for k in peft_model.state_dict())
    want = peft_model.merge_and_unload().state_dict()
    exported = AutoModelForCausalLM.from_pretrained(run / "hf_model").state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert all(torch.allclose(exported[k], want[k], atol=1e-6) for k in want)
    assert any(not torch.allclose(exported[k], base[k], atol=1e-4) for k in base)  # it trained


def test_modules_to_save_trains_the_head_in_full_and_exports_it(tiny_model_dir, sft_file, tmp_path):
    # model.modules_to_save (peft's, TRL's lora_modules_to_save): the tiny model ties lm_head to embed_tokens, so
    # [lm_head] trains that one matrix in full (peft's ensure_weight_tying) beside the q_proj / v_proj adapters; the
    # checkpoint's adapter holds it, and hf_model (peft's merge) is still tied, with the trained matrix, reloading to
    # the same logits; continuing from that adapter keeps it, and a contradicting modules_to_save stops
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tiller.errors import ConfigError
    from tiller.models.loading import load_causal_lm
    from tiller.models.lora import attach_lora
    from tiller.trainer.sft import train_sft

    run = tmp_path / "saved"
    train_sft(load_config(job_overrides(tiny_model_dir, sft_file, run, **{
        "data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 8, "optim.lr": 1e-2, "model.lora_rank": 4,
        "model.lora_alpha": 8, "model.target_modules": "[q_proj,v_proj]", "model.modules_to_save": "[lm_head]",
        "trainer.total_training_steps": 2}), schema=SFTConfig, validate=validate_job))
    ckpt = run / "checkpoints" / "global_step_2" / "model"
    saved = json.loads((ckpt / "adapter_config.json").read_text())
    assert saved["modules_to_save"] == ["model.embed_tokens"] and saved["ensure_weight_tying"] is True
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert base.lm_head.weight is base.model.embed_tokens.weight  # tied in the base
    want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ckpt).merge_and_unload()
    exported = AutoModelForCausalLM.from_pretrained(run / "hf_model")
    assert exported.lm_head.weight is exported.model.embed_tokens.weight  # still tied
    assert not torch.allclose(exported.lm_head.weight, base.lm_head.weight, atol=1e-4)  # and trained
    torch.testing.assert_close(exported.lm_head.weight, want.lm_head.weight, atol=1e-6, rtol=0)
    ids = torch.tensor([[1, 5, 9, 12, 3]])
    torch.testing.assert_close(exported(input_ids=ids).logits, want(input_ids=ids).logits, atol=1e-5, rtol=0)
    cfg = load_config(job_overrides(tiny_model_dir, sft_file, tmp_path / "x", **{"model.lora_adapter_path": ckpt}),
                      schema=SFTConfig, validate=validate_job)
    for same in (None, ["lm_head"], ["embed_tokens"]):  # unset, or the tied pair by either name
        continued = attach_lora(load_causal_lm(tiny_model_dir), dataclasses.replace(cfg.model, modules_to_save=same),
                                "model")
        assert continued.peft_config["default"].modules_to_save == ["model.embed_tokens"]  # the adapter's own
    with pytest.raises(ConfigError, match="model.modules_to_save=o_proj but the adapter"):
        attach_lora(load_causal_lm(tiny_model_dir), dataclasses.replace(cfg.model, modules_to_save=["o_proj"]),
                    "model")


@pytest.mark.parametrize("saved, needle", [("[nope]", "model.modules_to_save: no module named ['nope']"),
                                           ("[q_proj]", "['q_proj'] also in model.target_modules")])
def test_modules_to_save_names_a_module_that_is_not_adapted(tiny_model_dir, saved, needle):
    from tiller.errors import ConfigError
    from tiller.models.loading import load_causal_lm
    from tiller.models.lora import apply_lora

    names = saved.strip("[]").split(",")
    with pytest.raises(ConfigError) as err:
        apply_lora(load_causal_lm(tiny_model_dir), 4, 8, ["q_proj", "v_proj"], modules_to_save=names)
    assert needle in str(err.value)
