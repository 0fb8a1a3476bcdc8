"""LoRA on a vision-language model: `all-linear` adapts the language model only, a GRPO step on image prompts
trains only the adapters (reference = adapters off, with the pixels), the rollout engine runs the adapted weights
and merging them gives the same model; a user's target_modules list is taken as given."""

from __future__ import annotations

import copy

import torch

from tests.vision.test_vlm_rl import _cfg, shapes_data  # noqa: F401 - the module fixture
from tiller.models.lora import apply_lora, merge_lora


def test_all_linear_adapts_the_language_model_only(any_vlm_dir):
    from tiller.models.loading import load_causal_lm

    model = apply_lora(load_causal_lm(any_vlm_dir), rank=4, alpha=8)
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if "lora_A" in n}
    # 4 decoder layers x (q, k, v, o, gate, up, down); nothing in the vision tower, not the LM head. Qwen3-VL-MoE:
    # q, k, v, o only (peft's all-linear: the experts are 3-D parameters and the router no nn.Linear)
    # Qwen3.5: 2 attention layers x 7 and 2 Gated DeltaNet layers x (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a,
    # out_proj, gate, up, down); Qwen3.5-MoE: each layer's shared expert (gate, up, down) and its gate in place of
    # the dense MLP, the routed experts being 3-D parameters; GLM-4.1V: (q, k, v, o, gate_up, down), gate and up
    # being one matrix; GLM-4.5V: q, k, v, o and, in the 3 experts layers, the experts' fused 3-D parameters (peft
    # 0.21 reads gate / up / down as the experts' pre-transformers-5 names for this model type and adapts
    # `experts.gate_up_proj` / `experts.down_proj` in their place: the dense first layer's and the shared expert's MLP
    # get none)
    count = {"qwen3_vl_moe": 16, "qwen3_5": 2 * 7 + 2 * 8, "qwen3_5_moe": 2 * 8 + 2 * 9, "glm4v": 4 * 6,
             "glm4v_moe": 4 * 4 + 3 * 2}.get(
        model.config.model_type, 28)
    assert len(adapted) == count and all(".language_model.layers." in n for n in adapted)
    # naming the vision blocks' layers adapts them: the user's list is taken as given
    model = apply_lora(load_causal_lm(any_vlm_dir), rank=4, alpha=8, target_modules=["qkv", "q_proj"])
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if "lora_A" in n}
    assert any(".visual.blocks." in n for n in adapted) and any(".language_model." in n for n in adapted)


def test_grpo_step_with_lora_changes_only_the_adapters(tmp_path, tiny_vlm_dir, shapes_data, monkeypatch):  # noqa: F811
    from tiller.models.vision import encode_image_prompt, load_processor
    from tiller.trainer.rl import RLTrainer

    cfg = _cfg(tmp_path / "run", tiny_vlm_dir, shapes_data, "actor_rollout_ref.model.lora_rank=4",
               "actor_rollout_ref.model.lora_alpha=8", "actor_rollout_ref.actor.use_kl_loss=true",
               "actor_rollout_ref.actor.optim.lr=5e-2", f"custom_reward_function.path={shapes_data / 'reward.py'}",
               "trainer.save_freq=1",
               # the entropy bonus has a gradient whatever the rewards (a step whose groups all score alike has none)
               "actor_rollout_ref.actor.entropy_coeff=0.01")
    monkeypatch.setenv("SHAPES_LOG", str(tmp_path / "reward.log"))
    trainer = RLTrainer(cfg)
    try:
        worker = trainer.actor.worker
        before = trainer.actor.execute("state_dict")
        trainer.fit()
        after = trainer.actor.execute("state_dict")
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert changed and all("lora_" in k for k in changed), changed
        assert any("lora_B" in k for k in changed)  # B starts at 0: a moved B is a real update
        # the engine runs the adapted module; merging the adapters gives the same outputs (the exported model)
        engine_module = worker.rollout_module
        merged = merge_lora(copy.deepcopy(worker.module))
        assert type(merged).__name__ == "Qwen2VLForConditionalGeneration"
        proc = load_processor(tiny_vlm_dir)
        from PIL import Image

        p = encode_image_prompt(proc, "<|vision_start|><|image_pad|><|vision_end|>how many?",
                                [Image.new("RGB", (64, 64), (200, 0, 0))])
        ids = torch.tensor([p.prompt_ids])
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=p.pixel_values,
                  image_grid_thw=p.image_grid_thw, mm_token_type_ids=(ids == merged.config.image_token_id).int())
        with torch.no_grad():
            got, want = engine_module.eval()(**kw).logits, merged.eval()(**kw).logits
            with worker.module.disable_adapter():
                base = engine_module(**kw).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert (got - base).abs().max() > 1e-4  # the adapters moved the outputs
    finally:
        trainer.shutdown()
    # `tiller export` merges the checkpoint's adapter into the VLM and keeps the processor
    from tiller.models.checkpoint import export_hf
    from tiller.models.loading import load_causal_lm

    out = export_hf(tmp_path / "run", tmp_path / "merged")
    exported = load_causal_lm(out).eval()
    assert (out / "preprocessor_config.json").is_file() and load_processor(out).image_processor.merge_size == 2
    with torch.no_grad():
        torch.testing.assert_close(exported(**kw).logits, want, atol=1e-4, rtol=0)


def test_lora_and_freeze_vision_tower(tmp_path, tiny_vlm_dir, shapes_data, monkeypatch):  # noqa: F811
    """freeze_vision_tower with LoRA on adapters named in the vision tower: those adapters stay fixed."""
    from tiller.trainer.rl import RLTrainer

    cfg = _cfg(tmp_path / "run", tiny_vlm_dir, shapes_data, "actor_rollout_ref.model.lora_rank=4",
               "actor_rollout_ref.model.target_modules=[qkv,q_proj]",
               "actor_rollout_ref.actor.freeze_vision_tower=true", "actor_rollout_ref.actor.optim.lr=5e-2",
               f"custom_reward_function.path={shapes_data / 'reward.py'}")
    monkeypatch.setenv("SHAPES_LOG", str(tmp_path / "reward.log"))
    trainer = RLTrainer(cfg)
    try:
        trainable = [n for n, p in trainer.actor.worker.module.named_parameters() if p.requires_grad]
    finally:
        trainer.shutdown()
    assert trainable and all("lora_" in n and ".language_model." in n for n in trainable)
