"""The native engine on image prompts: greedy equals HF `generate` with the pixels (images of several sizes, a
prompt with two images, a text prompt in the same batch), sampled rows' logprobs equal the actor's forward with
the same pixels, the n samples of a prompt share one vision pass, and bad image inputs are refused. The tests taking
`any_setup` / `any_vlm_dir` run on the tiny Qwen2-VL and the tiny Qwen3-VL (deepstack, q / k norms in the fused step).
"""

from dataclasses import replace

import pytest
import torch
from PIL import Image

from tiller.algos.entropy import logprobs_from_logits
from tiller.errors import UserError
from tiller.models.loading import load_causal_lm
from tiller.models.vision import encode_image_prompt, load_processor
from tiller.rollout import build_rollout_engine, SamplingParams
from tiller.rollout.base import left_pad
from tiller.rollout.images import vision_token_ids
from tiller.workers.common import response_forward
from tests.vision.slots import for_model

V = "<|vision_start|><|image_pad|><|vision_end|>"
NO_FUSED_STEP = ("qwen3_5", "qwen3_5_moe")
"""Decoded by the HF forward: Gated DeltaNet layers. (Qwen3-VL-MoE's experts blocks run inside the fused step.)"""
# (text, image sizes): grids 8 x 10, 14 x 6, and two images (8 x 8, 12 x 6) -> 20, 21 and 16 + 18 image tokens
SPECS = [("a" + V + "how many?", [(64, 48)]), (V, [(32, 96)]), ("count " + V + " and " + V + " now", [(64, 64), (40, 80)])]


@pytest.fixture(scope="module")
def setup(tiny_vlm_dir):
    return _setup(tiny_vlm_dir)


@pytest.fixture(scope="module")
def any_setup(any_vlm_dir):
    """`setup` on the tiny Qwen2-VL, then on the tiny Qwen3-VL (patch 16, deepstack, q / k norms, interleaved
    M-RoPE: the same image token counts, as its processor resizes to twice the side)."""
    return _setup(any_vlm_dir)


def _setup(model_dir):
    model = load_causal_lm(model_dir).eval()
    proc = load_processor(model_dir)
    prompts = [encode_image_prompt(proc, for_model(proc, text),
                                   [Image.new("RGB", size, (60 * i + 40 * j, 100, 200 - 50 * i))
                                    for j, size in enumerate(sizes)])
               for i, (text, sizes) in enumerate(SPECS)]
    text = proc.tokenizer("the sum of two and three", add_special_tokens=False)["input_ids"]
    return model, proc, prompts, text


def _mm(prompts):
    return [{"pixel_values": p.pixel_values, "image_grid_thw": p.image_grid_thw} for p in prompts]


def _hf_generate(model, ids, pixels=None, grid=None, steps=8):
    """HF `generate` of one prompt (no padding), greedy, vision tokens suppressed: (tokens, logprobs)."""
    ids = torch.tensor([ids])
    vision = {} if pixels is None else dict(pixel_values=pixels, image_grid_thw=grid,
                                            mm_token_type_ids=(ids == model.config.image_token_id).int())
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                             do_sample=False, eos_token_id=[10**9], pad_token_id=0, output_scores=True,
                             suppress_tokens=vision_token_ids(model), return_dict_in_generate=True, **vision)
    tokens = ref.sequences[0, ids.shape[1]:]
    return tokens.tolist(), torch.stack(ref.scores, 1)[0].log_softmax(-1).gather(-1, tokens[:, None])[:, 0]


def test_greedy_equals_hf_generate_on_image_prompts(any_setup):
    model, proc, prompts, text = any_setup
    engine = build_rollout_engine("native", model, proc.tokenizer)
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=8, ignore_eos=True)
    out = engine.generate([p.prompt_ids for p in prompts] + [text], greedy, multi_modal=_mm(prompts) + [None])
    refs = [_hf_generate(model, p.prompt_ids, p.pixel_values, p.image_grid_thw) for p in prompts]
    refs.append(_hf_generate(model, text))
    for i, (tokens, logp) in enumerate(refs):
        for row in (2 * i, 2 * i + 1):  # both samples of the prompt
            assert out.response_ids[row] == tokens
            # atol 1e-5: decode positions off by the rope delta move these by ~8e-3 (checked by hand)
            torch.testing.assert_close(torch.tensor(out.logprobs[row]), logp, atol=1e-5, rtol=0)
    # Qwen2-VL / Qwen3-VL / GLM-4.1V decode with the fused step (image prefill: the HF forward); NO_FUSED_STEP with the
    # HF forward
    assert (engine._fused is not None) == (model.config.model_type not in NO_FUSED_STEP)
    # waves of one prompt, and rows leaving early (prompt 0's first token made a stop token: the batch is compacted,
    # each remaining row keeps its own M-RoPE offset)
    stop = refs[0][0][0]
    ids = [p.prompt_ids for p in prompts] + [text]
    for opts, sampling in (({"max_num_seqs": 2}, greedy), ({}, replace(greedy, stop_token_ids=[stop]))):
        again = build_rollout_engine("native", model, proc.tokenizer, **opts).generate(
            ids, sampling, multi_modal=_mm(prompts) + [None])
        for i, (tokens, logp) in enumerate(refs):
            end = tokens.index(stop) + 1 if stop in sampling.stop_token_ids and stop in tokens else len(tokens)
            assert again.response_ids[2 * i] == tokens[:end]
            torch.testing.assert_close(torch.tensor(again.logprobs[2 * i]), logp[:end], atol=1e-5, rtol=0)
    alone = engine.generate([text], greedy)  # a text-only call: the fused step prefills too
    assert alone.response_ids[0] == refs[-1][0]
    torch.testing.assert_close(torch.tensor(alone.logprobs[0]), refs[-1][1], atol=1e-5, rtol=0)


def test_qwen2_5_vl_greedy_equals_hf_generate(setup):
    """Qwen2.5-VL (verl's VLM example model; windowed vision attention): the tiny VLM's language model config with
    a small Qwen2.5-VL vision tower, random weights; fused decode, a prompt with two images."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    model, proc, prompts, _ = setup
    c = model.config
    vision = dict(depth=2, hidden_size=64, out_hidden_size=c.text_config.hidden_size, intermediate_size=128,
                  num_heads=2, patch_size=8, spatial_merge_size=2, temporal_patch_size=2, window_size=32,
                  fullatt_block_indexes=[1])
    config = Qwen2_5_VLConfig(text_config=c.text_config.to_dict(), vision_config=vision, tie_word_embeddings=True,
                              image_token_id=c.image_token_id, video_token_id=c.video_token_id,
                              vision_start_token_id=c.vision_start_token_id, vision_end_token_id=c.vision_end_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vl25 = Qwen2_5_VLForConditionalGeneration(config).eval()
        with torch.no_grad():
            for p in vl25.model.visual.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.1)
    engine = build_rollout_engine("native", vl25, proc.tokenizer)
    greedy = SamplingParams(do_sample=False, max_new_tokens=6, ignore_eos=True)
    chosen = [prompts[0], prompts[2]]
    out = engine.generate([p.prompt_ids for p in chosen], greedy, multi_modal=_mm(chosen))
    assert engine._fused is not None
    for i, p in enumerate(chosen):
        tokens, logp = _hf_generate(vl25, p.prompt_ids, p.pixel_values, p.image_grid_thw, steps=6)
        assert out.response_ids[i] == tokens
        torch.testing.assert_close(torch.tensor(out.logprobs[i]), logp, atol=1e-5, rtol=0)


def test_sampled_logprobs_equal_the_actor_forward_and_n_share_one_vision_pass(any_setup):
    model, proc, prompts, _ = any_setup
    engine = build_rollout_engine("native", model, proc.tokenizer)
    seen = []
    handle = model.model.visual.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
    try:
        sampling = SamplingParams(n=3, max_new_tokens=6, ignore_eos=True, seed=5)
        out = engine.generate([p.prompt_ids for p in prompts], sampling, multi_modal=_mm(prompts))
    finally:
        handle.remove()
    assert seen == [sum(p.pixel_values.shape[0] for p in prompts)]  # one pass over the 3 prompts' patches
    again = engine.generate([p.prompt_ids for p in prompts], sampling, multi_modal=_mm(prompts))
    assert again.response_ids == out.response_ids  # seeded
    rows = [prompts[r // 3] for r in range(len(out))]
    assert len({tuple(r) for r in out.response_ids}) > 3  # sampled: the rows differ
    assert not set(vision_token_ids(model)) & {t for r in out.response_ids for t in r}
    # the actor's forward (left-padded batch, pixels per row, M-RoPE by get_rope_index) on the sampled rows
    prompt, pmask = left_pad([p.prompt_ids for p in rows], 0)
    resp = torch.tensor(out.response_ids)
    with torch.no_grad():
        logits, t = response_forward(model, torch.cat([prompt, resp], 1),
                                     torch.cat([pmask, torch.ones_like(resp)], 1), prompt.shape[1],
                                     torch.ones_like(resp), multi_modal=_mm(rows))
    logits[..., vision_token_ids(model)] = float("-inf")  # the engine samples with them suppressed
    torch.testing.assert_close(torch.tensor(out.logprobs), logprobs_from_logits(logits, resp[:, :t]), atol=1e-4,
                               rtol=0)


def test_bad_image_inputs_are_refused(setup, tiny_model_dir):
    model, proc, prompts, text = setup
    engine = build_rollout_engine("native", model, proc.tokenizer)
    greedy = SamplingParams(do_sample=False, max_new_tokens=2)
    with pytest.raises(UserError, match="multi_modal has 1 entries for 2 prompts"):
        engine.generate([prompts[0].prompt_ids, text], greedy, multi_modal=_mm(prompts[:1]))
    wrong = dict(_mm(prompts[:1])[0], image_grid_thw=prompts[1].image_grid_thw)
    with pytest.raises(UserError, match="prompt 0 has 20 image tokens but its images fill 21"):
        engine.generate([prompts[0].prompt_ids], greedy, multi_modal=[wrong])
    text_model = load_causal_lm(tiny_model_dir)
    with pytest.raises(UserError, match="image prompts need a vision-language model"):
        build_rollout_engine("native", text_model).generate([[1, 2, 3]], greedy, multi_modal=_mm(prompts[:1]))


def test_grpo_step_rolls_out_image_prompts_with_the_native_engine(tmp_path, any_vlm_dir):
    """verl's keys with the default engine: the rollout's logprobs agree with the actor's recomputed ones."""
    import json

    from tiller.config import load_config
    from tiller.rollout.native import NativeRolloutEngine
    from tiller.tasks import shapes
    from tiller.trainer.rl import RLTrainer

    shapes.write_task(tmp_path / "data", n_train=4, n_test=2, seed=0)
    cfg = load_config([
        f"actor_rollout_ref.model.path={any_vlm_dir}", f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]",
        "data.image_key=images", "data.train_batch_size=2", "data.max_prompt_length=64",
        "data.max_response_length=4", "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=6", "algorithm.adv_estimator=grpo",
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable", "trainer.save_freq=-1", f"trainer.default_local_dir={tmp_path / 'run'}"])
    assert cfg.actor_rollout_ref.rollout.name == "native"
    trainer = RLTrainer(cfg)
    try:
        assert isinstance(trainer.actor.worker.rollout, NativeRolloutEngine)
        trainer.fit()
    finally:
        trainer.shutdown()
    step = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    # 16 image tokens + the question's text in the chat template (GLM's is two tokens shorter)
    assert step["step"] == 1 and step["prompt_length/mean"] == (
        36 if json.loads((any_vlm_dir / "config.json").read_text())["model_type"] in ("glm4v", "glm4v_moe") else 38)
    # the rollout's sampling probabilities and the actor's (old_log_prob) agree (measured 2.4e-5)
    assert step["training/rollout_probs_diff_max"] < 1e-4 and step["training/rollout_actor_probs_pearson_corr"] > 0.9999


def test_continuous_batcher_takes_image_prompts(any_setup):
    """The serve / agent scheduler: equal to the engine's greedy rows; two requests with the same tokens over
    different images never share a prefill or a prompt-cache entry."""
    from tiller.rollout.continuous import ContinuousBatcher

    model, proc, prompts, text = any_setup
    engine = build_rollout_engine("native", model, proc.tokenizer)
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=6, ignore_eos=True)
    want = engine.generate([p.prompt_ids for p in prompts] + [text], greedy, multi_modal=_mm(prompts) + [None])
    green = encode_image_prompt(proc, for_model(proc, SPECS[0][0]), [Image.new("RGB", SPECS[0][1][0], (0, 255, 0))])
    assert green.prompt_ids == prompts[0].prompt_ids
    other = _mm([green])[0]  # the same tokens, other pixels
    alone = engine.generate([prompts[0].prompt_ids], greedy, multi_modal=[other])
    batcher = ContinuousBatcher(engine, max_rows=16)
    try:
        futures = [batcher.submit([p.prompt_ids], greedy, multi_modal=[m]) for p, m in zip(prompts, _mm(prompts))]
        futures.append(batcher.submit([text], greedy))
        futures.append(batcher.submit([prompts[0].prompt_ids], greedy, multi_modal=[other]))
        got = [f.result(timeout=120) for f in futures]
        again = batcher.submit([prompts[0].prompt_ids], greedy, multi_modal=_mm(prompts[:1])).result(timeout=120)
    finally:
        batcher.close()
    for i, out in enumerate(got[:-1]):
        assert out.response_ids == want.response_ids[2 * i:2 * i + 2]
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(want.logprobs[2 * i:2 * i + 2]),
                                   atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(got[-1].logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    assert abs(got[-1].logprobs[0][0] - got[0].logprobs[0][0]) > 1e-4  # the other image changed the answer
    torch.testing.assert_close(torch.tensor(again.logprobs), torch.tensor(got[0].logprobs), atol=1e-5, rtol=0)
    assert batcher.stats["prompt_cache_hits"] == 0  # only the text prompt was cached, and not asked again


@pytest.mark.slow
def test_compiled_decode_step_on_image_prompts(any_setup):
    """rollout.enforce_eager=False on a CPU (the decode step compiled by Inductor; for Qwen3-VL with its per-head q / k
    norms): greedy rows equal HF `generate` with the pixels."""
    from tiller.rollout import compiled_decode

    if not compiled_decode.available():
        pytest.skip("no C++ compiler for Inductor")
    model, proc, prompts, _ = any_setup
    engine = build_rollout_engine("native", model, proc.tokenizer, compile_decode=True)
    greedy = SamplingParams(do_sample=False, max_new_tokens=6, ignore_eos=True)
    out = engine.generate([p.prompt_ids for p in prompts], greedy, multi_modal=_mm(prompts))
    if model.config.model_type in NO_FUSED_STEP:
        assert engine._fused is None
    else:
        assert engine._fused.compiled is not None
    for i, p in enumerate(prompts):
        tokens, logp = _hf_generate(model, p.prompt_ids, p.pixel_values, p.image_grid_thw, steps=6)
        assert out.response_ids[i] == tokens
        torch.testing.assert_close(torch.tensor(out.logprobs[i]), logp, atol=1e-4, rtol=0)
