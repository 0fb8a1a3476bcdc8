"""Continuing from a saved LoRA adapter (verl's `model.lora_adapter_path`) and LoRA's `exclude_modules`: the adapter
loads as saved and trainable, an adapter that does not fit is refused by key, and an RL run started from it trains
the adapter only, checkpoints it, resumes its own checkpoint and exports base + trained adapter."""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch

from tests.trainer.test_rl import rl_data  # noqa: F401  (fixture: the arithmetic task + a digit-fraction reward)
from tiller.errors import ConfigError

TARGETS = ["q_proj", "v_proj"]


def _perturbed_lora(model_dir, rank=4, alpha=8, seed=0):
    """A LoRA model on q_proj / v_proj whose B matrices are random (a fresh adapter has B = 0: the base itself)."""
    from tiller.models.loading import load_causal_lm
    from tiller.models.lora import apply_lora

    torch.manual_seed(seed)  # A: peft's random init
    peft_model = apply_lora(load_causal_lm(model_dir), rank, alpha, TARGETS)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return peft_model.eval()


@pytest.fixture(scope="module")
def saved_adapter(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("adapter") / "adapter"
    _perturbed_lora(tiny_model_dir).save_pretrained(path)
    return path


def _section(**kw):
    """A model config section with the LoRA keys at their defaults (as RL's and the jobs' sections have them)."""
    base = {"lora_rank": 0, "lora_alpha": 16, "target_modules": "all-linear", "exclude_modules": None,
            "lora_adapter_path": None}
    return types.SimpleNamespace(**{**base, **kw})


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.arange(5, 29).reshape(2, 12)


def test_saved_adapter_loads_as_saved_and_trainable(tiny_model_dir, saved_adapter):
    from tiller.models.loading import load_causal_lm
    from tiller.models.lora import attach_lora

    want = _logits(_perturbed_lora(tiny_model_dir), IDS)  # the model the adapter was saved from
    model = attach_lora(load_causal_lm(tiny_model_dir), _section(lora_adapter_path=str(saved_adapter)), "model")
    torch.testing.assert_close(_logits(model.eval(), IDS), want, rtol=0, atol=1e-6)
    # not the fresh-adapter model (= the base): the adapter moves the logits
    assert (_logits(load_causal_lm(tiny_model_dir), IDS) - want).abs().max().item() > 1e-2
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    layers = model.config.num_hidden_layers
    assert len(trainable) == 2 * 2 * layers  # lora_A and lora_B of q_proj and v_proj in each layer
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == set(TARGETS)
    # its config names the base it is loaded on (what `tiller export` merges into), rank / alpha from the file
    config = model.peft_config["default"]
    assert (config.base_model_name_or_path, config.r, config.lora_alpha) == (str(tiny_model_dir), 4, 8)
    # the same rank / alpha / targets set explicitly agree with the adapter: accepted
    attach_lora(load_causal_lm(tiny_model_dir), _section(lora_adapter_path=str(saved_adapter), lora_rank=4,
                                                         lora_alpha=8, target_modules=["v_proj", "q_proj"]), "model")


def test_bad_adapters_are_refused_by_key(tiny_model_dir, saved_adapter, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiller.models.loading import load_causal_lm
    from tiller.models.lora import attach_lora

    def refuse(section, model=None, key="actor_rollout_ref.model"):
        with pytest.raises(ConfigError) as err:
            attach_lora(model if model is not None else load_causal_lm(tiny_model_dir), section, key)
        return str(err.value)

    path = str(saved_adapter)
    msg = refuse(_section(lora_adapter_path=str(tmp_path / "nope")))
    assert msg.startswith("actor_rollout_ref.model.lora_adapter_path=") and "no such file" in msg
    msg = refuse(_section(lora_adapter_path=str(tiny_model_dir)))  # a model dir, not an adapter
    assert "lora_adapter_path" in msg and "no adapter_config.json" in msg
    # rank / alpha / targets that contradict the adapter: both values named
    msg = refuse(_section(lora_adapter_path=path, lora_rank=8))
    assert "actor_rollout_ref.model.lora_rank=8 but the adapter" in msg and "has 4" in msg
    msg = refuse(_section(lora_adapter_path=path, lora_alpha=32), key="model")
    assert "model.lora_alpha=32 but the adapter" in msg and "has 8" in msg
    assert "target_modules=q_proj but" in refuse(_section(lora_adapter_path=path, target_modules=["q_proj"]))
    # an adapter saved with dropout trains with it (in train mode only); a contradicting lora_dropout is named
    dropped = tmp_path / "dropout"
    shutil.copytree(saved_adapter, dropped)
    config = json.loads((dropped / "adapter_config.json").read_text())
    (dropped / "adapter_config.json").write_text(json.dumps({**config, "lora_dropout": 0.1}))
    model = attach_lora(load_causal_lm(tiny_model_dir), _section(lora_adapter_path=str(dropped)),
                        "actor_rollout_ref.model")
    assert {m.p for n, m in model.named_modules() if n.endswith("lora_dropout.default")} == {0.1}
    assert "lora_dropout=0.2 but" in refuse(_section(lora_adapter_path=str(dropped), lora_dropout=0.2))
    # another peft method's adapter
    (dropped / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    assert "a IA3 adapter" in refuse(_section(lora_adapter_path=str(dropped)))
    # a config without its weights
    (dropped / "adapter_config.json").write_text(json.dumps(config))
    (dropped / "adapter_model.safetensors").unlink()
    assert "no adapter weights there (adapter_model.safetensors" in refuse(_section(lora_adapter_path=str(dropped)))
    # a checkpoint dir (its adapter is in model/): the message points there
    (tmp_path / "global_step_3").mkdir()
    shutil.copytree(saved_adapter, tmp_path / "global_step_3" / "model")
    msg = refuse(_section(lora_adapter_path=str(tmp_path / "global_step_3")))
    assert f"the adapter of this checkpoint is {tmp_path / 'global_step_3' / 'model'}" in msg
    # an adapter of another base: wider layers (shape mismatch), or one layer fewer (weights with no place)
    base = AutoConfig.from_pretrained(tiny_model_dir)
    wider = AutoConfig.from_pretrained(tiny_model_dir, hidden_size=2 * base.hidden_size,
                                       head_dim=2 * base.hidden_size // base.num_attention_heads)
    msg = refuse(_section(lora_adapter_path=path), AutoModelForCausalLM.from_config(wider))
    assert f"lora_adapter_path={path}: the adapter does not fit the base model" in msg and "size mismatch" in msg
    shallower = AutoConfig.from_pretrained(tiny_model_dir, num_hidden_layers=base.num_hidden_layers - 1)
    msg = refuse(_section(lora_adapter_path=path), AutoModelForCausalLM.from_config(shallower))
    assert "does not fit the base model" in msg and "4 it holds that the model has no place for" in msg


def test_exclude_modules_leave_modules_without_adapters(tiny_model_dir):
    from tiller.models.loading import load_causal_lm
    from tiller.models.lora import apply_lora

    def adapted(model):
        return {n.removesuffix(".lora_A.default.weight") for n, _ in model.named_parameters() if ".lora_A." in n}

    everything = adapted(apply_lora(load_causal_lm(tiny_model_dir), 4, 8))
    by_name = adapted(apply_lora(load_causal_lm(tiny_model_dir), 4, 8, exclude_modules=["v_proj"]))
    assert by_name == {n for n in everything if not n.endswith("v_proj")} and by_name != everything
    by_regex = adapted(apply_lora(load_causal_lm(tiny_model_dir), 4, 8, exclude_modules=r".*layers\.0\..*"))
    assert by_regex == {n for n in everything if ".layers.0." not in n} and by_regex
    # through the RL config, verl 0.8+'s spelling: the actor's section gives the same adapters
    from tiller.config import load_config
    from tiller.models.lora import attach_lora

    section = load_config(["actor_rollout_ref.model.lora.rank=4",
                           "actor_rollout_ref.model.lora.exclude_modules=[v_proj]"]).actor_rollout_ref.model
    assert adapted(attach_lora(load_causal_lm(tiny_model_dir), section, "actor_rollout_ref.model")) == by_name
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.exclude_modules: no module named \['vproj'\]"):
        apply_lora(load_causal_lm(tiny_model_dir), 4, 8, exclude_modules=["vproj"], key="actor_rollout_ref.model")
    with pytest.raises(ConfigError, match="model.exclude_modules=q_proj: No modules were targeted"):
        apply_lora(load_causal_lm(tiny_model_dir), 4, 8, ["q_proj"], exclude_modules=["q_proj"])


def assert_base_plus_adapter(exported: dict, base_dir, adapter: dict, scale: float, name: str = "",
                             base: dict | None = None) -> int:
    """Every weight of `exported` (a state dict) is the base model's (from `base_dir`, or the state dict `base`) plus
    scale x B A where the peft state dict `adapter` has LoRA factors for it (keys `...lora_A{name}.weight`), else the
    base's exactly; returns how many weights carried an adapter."""
    from transformers import AutoModelForCausalLM

    merged = 0
    base = AutoModelForCausalLM.from_pretrained(base_dir).state_dict() if base is None else base
    for k, w in base.items():
        prefix = "base_model.model." + k.removesuffix(".weight")
        if f"{prefix}.lora_A{name}.weight" in adapter:
            a, b = adapter[f"{prefix}.lora_A{name}.weight"], adapter[f"{prefix}.lora_B{name}.weight"]
            torch.testing.assert_close(exported[k], w + scale * b @ a, rtol=0, atol=1e-6)
            merged += 1
        else:
            assert torch.equal(exported[k], w), k
    return merged


def _fit(cfg):
    """(the actor's logits on IDS before training, its state before training, after training); the actor runs
    in-process (local backend)."""
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(cfg)
    module = trainer.actor.worker.module
    logits = _logits(module, IDS)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer.fit()
    after = {k: v.clone() for k, v in module.state_dict().items()}
    trainer.shutdown()
    return logits, before, after


def test_rl_run_continues_a_saved_adapter(tmp_path, tiny_model_dir, saved_adapter, rl_data):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.trainer.test_rl import make_cfg
    from tiller.models.checkpoint import export_hf

    # verl 0.8+'s spelling; KL to the reference (the base: adapters disabled) in the loss
    common = (f"actor_rollout_ref.model.lora.adapter_path={saved_adapter}", "actor_rollout_ref.actor.use_kl_loss=true",
              "data.val_files=[]", "trainer.save_freq=2")
    initial, before, after = _fit(make_cfg(tmp_path / "a", tiny_model_dir, rl_data, *common,
                                           "trainer.total_training_steps=3"))
    # the actor starts as base + adapter
    torch.testing.assert_close(initial, _logits(_perturbed_lora(tiny_model_dir), IDS), rtol=0, atol=1e-6)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_A." in k or ".lora_B." in k for k in changed)  # the base stays frozen
    # the policy starts at base + adapter, so step 1's KL to the base is well above 0 (a fresh adapter: exactly 0)
    first = json.loads((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["actor/kl_loss"] > 1e-3, first["actor/kl_loss"]
    # the checkpoint is a LoRA adapter of the same shape on the same base, holding the trained weights
    ckpt = tmp_path / "a" / "checkpoints" / "global_step_3"
    config = json.loads((ckpt / "model" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, TARGETS)
    assert config["base_model_name_or_path"] == str(tiny_model_dir)
    saved = load_file(str(ckpt / "model" / "adapter_model.safetensors"))
    assert saved and all(torch.equal(v, after[k.replace(".weight", ".default.weight")]) for k, v in saved.items())
    # `tiller export`: the base with the trained adapter merged in, W + (alpha / r) B A, the rest the base's
    exported = AutoModelForCausalLM.from_pretrained(export_hf(ckpt, tmp_path / "exported")).state_dict()
    merged = assert_base_plus_adapter(exported, tiny_model_dir, after, 8 / 4, ".default")
    assert merged == 2 * AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.num_hidden_layers
    # resuming step 2's checkpoint (not the initial adapter again) lands on step 3's weights exactly
    _, _, resumed = _fit(make_cfg(tmp_path / "b", tiny_model_dir, rl_data, *common, "trainer.total_training_steps=3",
                                  "trainer.resume_mode=resume_path",
                                  f"trainer.resume_from_path={tmp_path / 'a' / 'checkpoints' / 'global_step_2'}"))
    assert all(torch.equal(after[k], resumed[k]) for k in after)
