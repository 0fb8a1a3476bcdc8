"""LoRA on the PPO critic (verl's `critic.model.lora_rank` / `lora_alpha` / `target_modules` / `exclude_modules` /
`lora_adapter_path`): the body trains adapters only and the value head in full (as verl's FSDP critic, peft
TOKEN_CLS); the critic starts equal to the full critic (B = 0); an RL run checkpoints the adapter with the head,
resumes bitwise and exports base + adapter; a saved critic adapter continues where it left off; bad keys are refused
by name (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_lora_adapter import assert_base_plus_adapter
from tests.trainer.test_dynamic_batches import _batch, _cfg
from tests.trainer.test_rl import _overrides, _train, make_cfg, rl_data  # noqa: F401 (rl_data: a fixture)
from tiller.config import load_config
from tiller.errors import ConfigError

LORA = ("algorithm.adv_estimator=gae", "critic.model.lora_rank=4", "critic.model.lora_alpha=8", "data.val_files=[]")


def _critic(model_dir, *extra):
    from tiller.workers.critic import CriticWorker

    return CriticWorker(_cfg(model_dir, "critic.optim.lr=1e-2", *extra), total_training_steps=1)


def test_critic_lora_trains_adapters_and_head_only_and_starts_as_the_full_critic(tiny_model_dir):
    batch = _batch(seed=3)
    full = _critic(tiny_model_dir)
    lora = _critic(tiny_model_dir, "critic.model.lora_rank=4", "critic.model.lora_alpha=8")
    # B = 0 at start: W x + (alpha/r) B A x adds exact zeros, so the values and the first loss are the full critic's
    # bit for bit (the same seed draws the same fresh value head in both)
    assert torch.equal(full.compute_values(batch)["values"], lora.compute_values(batch)["values"])
    before = {k: v.clone() for k, v in lora.module.state_dict().items()}
    assert full.update_critic(batch)["critic/vf_loss"] == lora.update_critic(batch)["critic/vf_loss"]
    after = lora.module.state_dict()
    trainable = {n for n, p in lora.module.named_parameters() if p.requires_grad}
    head = {f"base_model.model.score.modules_to_save.default.{w}" for w in ("weight", "bias")}
    assert head <= trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable - head)
    # every linear layer of the body has an adapter, the head none (all-linear); only those weights moved
    c = lora.module.config
    kinds = {n.split(".")[-4] for n in trainable - head}
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k or "modules_to_save" in k for k in changed)
    assert "base_model.model.score.modules_to_save.default.weight" in changed
    # The first AdamW step, worked: m_hat = g, v_hat = g^2, so a weight moves by lr g / (|g| + eps) after the
    # decoupled decay p (1 - lr wd). With B = 0, dL/dA = scale B^T (dL/dy) x^T = 0: A only decays, A (1 - lr wd);
    # B (decay of 0 is 0) moves by lr sign(g) wherever its gradient is not ~0 (|g| >> eps = 1e-8)
    group = lora.optimizer.param_groups[0]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    assert lr == 1e-2 and wd > 0 and eps == 1e-8
    a_keys = [k for k in before if ".lora_A." in k]
    for k in a_keys:
        torch.testing.assert_close(after[k], before[k] * (1 - lr * wd), rtol=1e-6, atol=0)
    steps = torch.cat([after[k.replace(".lora_A.", ".lora_B.")].abs().flatten() for k in a_keys])
    assert float(steps.max()) <= lr * (1 + 1e-6) and float(steps.median()) == pytest.approx(lr, rel=1e-3)
    # memory: the optimizer holds exactly the trainable parameters, r (in + out) per adapted matrix + the head.
    # Worked for this model (hidden h, MLP width i, key/value width kv, L layers, r = 4):
    # per layer r [(h+h) q + (h+kv) k + (h+kv) v + (h+h) o + 2 (h+i) gate/up + (i+h) down], plus h + 1 (score).
    h, i, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    expected = layers * 4 * (2 * h + 2 * (h + kv) + 2 * h + 3 * (h + i)) + h + 1
    held = [p for g in lora.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in held} == {id(p) for p in lora.module.parameters() if p.requires_grad}
    assert sum(p.numel() for p in held) == expected
    # exclude_modules leaves a named target without an adapter
    some = _critic(tiny_model_dir, "critic.model.lora_rank=2", "critic.model.target_modules=[q_proj,v_proj,o_proj]",
                   "critic.model.exclude_modules=[o_proj]")
    assert {n.split(".")[-4] for n, p in some.module.named_parameters() if ".lora_A." in n} == {"q_proj", "v_proj"}


@pytest.fixture(scope="module")
def critic_run(tiny_model_dir, rl_data, tmp_path_factory):
    """A 2-step GAE run with critic LoRA, checkpointing each step: its run dir."""
    run = tmp_path_factory.mktemp("critic_lora") / "a"
    metrics, changed, _ = _train(make_cfg(run, tiny_model_dir, rl_data, *LORA, "trainer.save_freq=1"))
    assert changed and metrics["training/global_step"] == 2
    return run


def test_rl_run_checkpoints_resumes_and_exports_the_critic_adapter(critic_run, tiny_model_dir, rl_data, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from tiller.models.checkpoint import export_hf

    ckpt = critic_run / "checkpoints" / "critic" / "global_step_2"
    config = json.loads((ckpt / "model" / "adapter_config.json").read_text())
    assert (config["task_type"], config["r"], config["lora_alpha"]) == ("TOKEN_CLS", 4, 8)
    assert config["base_model_name_or_path"] == str(tiny_model_dir)
    saved = load_file(str(ckpt / "model" / "adapter_model.safetensors"))
    # the base stays frozen: the checkpoint holds adapters and the value head only
    assert {"base_model.model.score.weight", "base_model.model.score.bias"} <= set(saved)
    assert all(".lora_" in k or ".score." in k for k in saved)
    # resuming step 1's checkpoint lands on step 2's critic (and actor) exactly, metrics included
    run_b = tmp_path / "b"
    _train(make_cfg(run_b, tiny_model_dir, rl_data, *LORA, "trainer.resume_mode=resume_path",
                    f"trainer.resume_from_path={critic_run / 'checkpoints' / 'global_step_1'}"))
    resumed = load_file(str(run_b / "checkpoints" / "critic" / "global_step_2" / "model" / "adapter_model.safetensors"))
    assert saved.keys() == resumed.keys() and all(torch.equal(saved[k], resumed[k]) for k in saved)
    step2 = [json.loads(line) for line in (critic_run / "metrics.jsonl").read_text().splitlines()][-1]
    step2_b = [json.loads(line) for line in (run_b / "metrics.jsonl").read_text().splitlines()][-1]
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/values/mean", "actor/pg_loss"):
        assert step2[key] == step2_b[key], key
    # `tiller export` of the critic checkpoint: a token-classification model, W + (alpha / r) B A on the body
    # (the base's other weights as they are), the trained value head
    exported = AutoModelForTokenClassification.from_pretrained(export_hf(ckpt, tmp_path / "exported")).state_dict()
    body = {k: v for k, v in AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().items()
            if k != "lm_head.weight"}
    merged = assert_base_plus_adapter(exported, tiny_model_dir, saved, 8 / 4, base=body)
    assert merged == 7 * AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.num_hidden_layers
    assert set(exported) == set(body) | {"score.weight", "score.bias"}
    assert torch.equal(exported["score.weight"], saved["base_model.model.score.weight"])
    assert torch.equal(exported["score.bias"], saved["base_model.model.score.bias"])


def test_critic_continues_a_saved_adapter(critic_run, tiny_model_dir, tmp_path):
    from tiller.models.checkpoint import export_hf

    adapter = critic_run / "checkpoints" / "critic" / "global_step_2" / "model"
    batch = _batch(seed=4)
    cont = _critic(tiny_model_dir, f"critic.model.lora_adapter_path={adapter}")
    # it starts as base + adapter: the values of the exported (merged) critic
    plain = _critic(tiny_model_dir, f"critic.model.path={export_hf(adapter.parent, tmp_path / 'exported')}")
    values = cont.compute_values(batch)["values"]
    torch.testing.assert_close(values, plain.compute_values(batch)["values"], rtol=0, atol=1e-5)
    assert not torch.allclose(values, _critic(tiny_model_dir).compute_values(batch)["values"], atol=1e-3)
    trainable = {n for n, p in cont.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or "score.modules_to_save" in n for n in trainable)
    # a key that contradicts the adapter, and an adapter of a policy (causal LM), are refused by key
    with pytest.raises(ConfigError, match=r"critic\.model\.lora_rank=8 but the adapter "
                                          r"critic\.model\.lora_adapter_path="):
        _critic(tiny_model_dir, f"critic.model.lora_adapter_path={adapter}", "critic.model.lora_rank=8")
    from tests.test_lora_adapter import _perturbed_lora

    _perturbed_lora(tiny_model_dir).save_pretrained(tmp_path / "policy_adapter")
    with pytest.raises(ConfigError, match=r"critic\.model\.lora_adapter_path=.*policy_adapter: a causal language model "
                                          r"\(a policy\)'s adapter .*checkpoints/critic/global_step_N"):
        _critic(tiny_model_dir, f"critic.model.lora_adapter_path={tmp_path / 'policy_adapter'}")


def test_bad_critic_lora_keys_are_refused_by_name(tmp_path, tiny_model_dir, rl_data, capsys):
    # through the CLI: a one-line error naming the key, exit code 2 (the worker's refusals below are ConfigErrors too)
    from tiller.cli import main

    code = main(["rl", *_overrides(tmp_path / "run", tiny_model_dir, rl_data, "algorithm.adv_estimator=gae",
                                   "critic.model.lora_rank=-1")])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "critic.model.lora_rank must be an integer >= 0 (0 = no LoRA), got -1" in err
    assert "Traceback" not in err
    with pytest.raises(ConfigError, match=r"critic\.model\.lora_alpha must be > 0"):
        load_config(["critic.model.lora_rank=4", "critic.model.lora_alpha=0"])
    with pytest.raises(ConfigError, match=r"critic\.model\.target_modules: \['score'\] is the model's TOKEN_CLS head"):
        _critic(tiny_model_dir, "critic.model.lora_rank=4", "critic.model.target_modules=[q_proj,score]")
    with pytest.raises(ConfigError, match=r"critic\.model\.target_modules: no module named \['qproj'\]"):
        _critic(tiny_model_dir, "critic.model.lora_rank=4", "critic.model.target_modules=[qproj]")
    with pytest.raises(ConfigError, match=r"critic\.model\.lora_adapter_path=.*nowhere: no such file"):
        _critic(tiny_model_dir, f"critic.model.lora_adapter_path={tmp_path / 'nowhere'}")
