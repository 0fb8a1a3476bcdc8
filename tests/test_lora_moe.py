"""LoRA on mixture-of-experts models, whose experts transformers 5 stores as 3-D parameters (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`), not linear modules:

- `all-linear` on a Mixtral (and Qwen2-MoE / Qwen3-MoE / DeepSeek ...: the models peft converts from their
  transformers-4 layout) adapts each expert and the router, as peft resolves it (the expert weights through peft's
  `target_parameters`, w1 + w3 fused into gate_up_proj at twice the rank);
- `target_parameters` (peft's, TRL's `lora_target_parameters`) names expert weights to adapt where `all-linear` does
  not reach them (Qwen3-VL-MoE: its experts were fused already, so `all-linear` adapts the attention only);
- either way the merged model (the export, the vLLM sync, the rollout copy) equals the adapted one, and an RL step
  trains the expert adapters and saves them with their `target_parameters`.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.sft.test_router_aux import tiny_moe_dir  # noqa: F401  (a fixture)
from tiller.config import load_config
from tiller.errors import ConfigError
from tiller.models.loading import load_causal_lm
from tiller.models.lora import apply_lora, merge_lora

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _randomise_adapters(model) -> None:
    """lora_B is zero at start (the adapted model equals the base); give every adapter a visible update."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def _merged_equals_adapted(model, base_logits, ids) -> None:
    _randomise_adapters(model)
    adapted = _logits(model, ids)
    merged = merge_lora(copy.deepcopy(model))
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(_logits(merged, ids), adapted, atol=1e-5, rtol=0)
    assert (adapted - base_logits).abs().max() > 1e-2  # the adapters change the function


def test_all_linear_adapts_a_mixtrals_experts_and_router(tiny_moe_dir):  # noqa: F811
    base = load_causal_lm(tiny_moe_dir)
    ids = torch.randint(5, base.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    base_logits = _logits(base, ids)
    model = apply_lora(base, rank=4, alpha=8)
    trained = {n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad}
    layer = "base_model.model.model.layers.0."
    # attention, the router (its weight as a parameter), and the experts: gate_up_proj wrapped inside down_proj's
    assert {layer + s for s in ("self_attn.q_proj", "mlp.gate", "mlp.experts", "mlp.experts.base_layer")} <= trained
    a = dict(model.named_parameters())
    # each of the 4 experts has its own rank-8 (w1 + w3 fused: twice the rank) update of gate_up_proj, rank 4 of down
    assert a[layer + "mlp.experts.base_layer.lora_A.default.weight"].shape == (4 * 8, 32)
    assert a[layer + "mlp.experts.lora_A.default.weight"].shape == (4 * 4, 48)
    _merged_equals_adapted(model, base_logits, ids)


@pytest.fixture(scope="module")
def vl_moe(tiny_qwen3vl_moe_dir):
    model = load_causal_lm(tiny_qwen3vl_moe_dir)
    ids = torch.randint(5, 500, (2, 9), generator=torch.Generator().manual_seed(1))
    return model, ids, _logits(model, ids)


def test_target_parameters_adapt_qwen3_vl_moe_experts(vl_moe):
    base, ids, base_logits = vl_moe
    model = apply_lora(copy.deepcopy(base), rank=4, alpha=8, target_parameters=EXPERTS)
    trained = {n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad}
    experts = {n for n in trained if ".mlp.experts" in n}
    assert len(experts) == 2 * 4 and all(".language_model.layers." in n for n in experts)  # 2 per layer, 4 layers
    assert not any(".visual." in n for n in trained)
    _merged_equals_adapted(model, base_logits, ids)
    plain = apply_lora(copy.deepcopy(base), rank=4, alpha=8)  # all-linear: the experts were fused already
    assert not any(".mlp.experts" in n for n, p in plain.named_parameters() if p.requires_grad)


def test_bad_target_parameters_are_refused_naming_the_key(vl_moe, tiny_model_dir):
    base = vl_moe[0]
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.model.target_parameters: no parameter named "
                                          r"\['experts.up_proj'\] in the model; its 3-D \(expert\) parameters: "
                                          r"mlp.experts.down_proj, mlp.experts.gate_up_proj$"):
        apply_lora(copy.deepcopy(base), 4, 8, target_parameters=["experts.up_proj"], key="actor_rollout_ref.model")
    with pytest.raises(ConfigError, match=r"3-D \(expert\) parameters: none \(not a mixture-of-experts model\)"):
        apply_lora(load_causal_lm(tiny_model_dir), 4, 8, target_parameters=EXPERTS)
    with pytest.raises(ConfigError, match=r"^model.target_parameters=.* with model.use_dora=true: peft's DoRA"):
        apply_lora(copy.deepcopy(base), 4, 8, target_parameters=EXPERTS, use_dora=True)


def test_a_job_refuses_target_parameters_without_lora(tiny_model_dir, tmp_path):
    from tiller.config.jobs import SFTConfig, validate_job

    with pytest.raises(ConfigError, match=r"^model.target_parameters=.* needs LoRA"):
        load_config([f"model.partial_pretrain={tiny_model_dir}", f"data.train_files=[{tmp_path / 't.parquet'}]",
                     f"model.target_parameters=[{EXPERTS[0]}]"], schema=SFTConfig, validate=validate_job)


def test_grpo_step_trains_the_expert_adapters_and_saves_them(tmp_path, tiny_qwen3vl_moe_dir):
    """verl keys plus tiller's actor_rollout_ref.model.target_parameters on the tiny Qwen3-VL-MoE (text prompts): the
    step moves the expert adapters, the native engine (running the adapted model) gives the actor's log-probs, the
    checkpoint's adapter_config.json holds the targets and `tiller export` merges them."""
    from tests.vision.test_vlm_rl import _fit_weights
    from tiller.cli import main
    from tiller.tasks import arithmetic

    arithmetic.write_task(tmp_path / "data", n_train=8, n_test=2, seed=0)
    run = tmp_path / "run"
    cfg = load_config([
        f"actor_rollout_ref.model.path={tiny_qwen3vl_moe_dir}", f"data.train_files=[{tmp_path / 'data/train.parquet'}]",
        "algorithm.adv_estimator=grpo", "data.train_batch_size=2", "data.max_prompt_length=64",
        "data.max_response_length=4",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.optim.lr=5e-2",
        "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        f"actor_rollout_ref.model.target_parameters=[{','.join(EXPERTS)}]", "trainer.total_training_steps=2",
        "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.resume_mode=disable", "trainer.save_freq=2",
        f"trainer.default_local_dir={run}"])
    before, after = _fit_weights(cfg)
    moved = [k for k in before if ".mlp.experts" in k and "lora_" in k and not torch.equal(before[k], after[k])]
    assert len(moved) >= 4
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1]["training/rollout_probs_diff_max"] < 1e-4  # step 2 samples from the updated experts
    adapter = run / "checkpoints" / "global_step_2" / "model"
    assert sorted(json.loads((adapter / "adapter_config.json").read_text())["target_parameters"]) == sorted(EXPERTS)
    assert main(["export", str(run / "checkpoints" / "global_step_2"), "--to", str(tmp_path / "hf")]) == 0
    exported = load_causal_lm(tmp_path / "hf")
    ids = torch.randint(5, 500, (1, 7), generator=torch.Generator().manual_seed(2))
    reloaded = load_causal_lm(tiny_qwen3vl_moe_dir)
    from peft import PeftModel

    reloaded = PeftModel.from_pretrained(reloaded, str(adapter))
    torch.testing.assert_close(_logits(exported, ids), _logits(reloaded, ids), atol=1e-5, rtol=0)
    # continuing from the adapter with other targets is refused, naming both; with the same ones it loads
    from tiller.models.lora import load_lora_adapter

    key = "actor_rollout_ref.model.lora_adapter_path"
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.model.target_parameters=mlp.experts.down_proj but the "
                                          r"adapter .* has mlp.experts.down_proj,mlp.experts.gate_up_proj"):
        load_lora_adapter(load_causal_lm(tiny_qwen3vl_moe_dir), adapter, key,
                          {"target_parameters": ["mlp.experts.down_proj"]}, "actor_rollout_ref.model")
    again = load_lora_adapter(load_causal_lm(tiny_qwen3vl_moe_dir), adapter, key, {"target_parameters": EXPERTS},
                              "actor_rollout_ref.model")
    torch.testing.assert_close(_logits(again, ids), _logits(reloaded, ids), atol=1e-6, rtol=0)
