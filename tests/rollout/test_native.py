"""The native engine against HF generate: greedy token-for-token equality, compaction, sampling knobs."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.layer_kinds import MOE
from tests.rollout.conftest import PROMPTS, assert_same_rows, load_family, prompt_ids, staggered_greedy
from tiller.rollout import SamplingParams, build_rollout_engine, fused_decode
from tiller.rollout.fused_decode import FusedDecoder, can_pack
from tiller.rollout.native import KVBuffer
from tiller.rollout.sampling import draw_from, warp_logits

MORE_PROMPTS = PROMPTS + ["x", "Once upon a time there was a little"]


@pytest.mark.parametrize("arch", ["sharp_qwen", "sharp_llama"])
def test_greedy_native_equals_hf_token_for_token(arch, request):
    model, tok = request.getfixturevalue(arch)
    prompts = prompt_ids(tok, MORE_PROMPTS)  # lengths 1..8 tokens: real left padding in both engines
    assert len({len(p) for p in prompts}) >= 4
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=24, ignore_eos=True)
    hf = build_rollout_engine("hf", model, tok).generate(prompts, greedy)
    native = build_rollout_engine("native", model, tok, prefill_tokens=16).generate(prompts, greedy)
    assert native.response_ids == hf.response_ids
    assert len(set(map(tuple, hf.response_ids))) == len(prompts)  # the continuations differ per prompt
    for a, b in zip(native.logprobs, hf.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", ["qwen3", "glm4"])
def test_fused_step_on_qwen3_and_glm4_equals_hf_token_for_token(model_type, layer_kind_dir):
    """Qwen3 (per-head q / k norms) and GLM-4 (post norms, fused gate-up, paired rotary on half of each head) decode
    on the fused step, eager and prepacked, and the same step compiled: greedy rows equal HF `generate`, logprobs to
    1e-5."""
    from tiller.rollout import compiled_decode

    model, tok = load_family(layer_kind_dir, model_type)
    prompts = prompt_ids(tok, MORE_PROMPTS)
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=16, ignore_eos=True)
    hf = build_rollout_engine("hf", model, tok).generate(prompts, greedy)
    assert len(set(map(tuple, hf.response_ids))) == len(prompts)  # the continuations differ per prompt
    engines = [build_rollout_engine("native", model, tok, prefill_tokens=16)]
    if compiled_decode.available():
        engines.append(build_rollout_engine("native", model, tok, compile_decode=True))
    for engine in engines:
        out = engine.generate(prompts, greedy)
        assert engine._fused is not None and (any(engine._fused.qk_norms) or any(engine._fused.post_norms))
        assert_same_rows(out, hf, atol=1e-5)
    assert engines[-1]._fused.compiled is not None or len(engines) == 1


@pytest.mark.parametrize("model_type", MOE)
def test_fused_step_runs_experts_layers_as_hf_does(model_type, layer_kind_dir):
    """Qwen3-MoE (a dense first layer), Qwen2-MoE (a dense layer, a shared expert, q / k / v biases) and Mixtral (experts
    in every layer): the fused step runs their attention fused and each experts block as the model's module, eager,
    prepacked and (Qwen2-MoE) compiled, the block an opaque op; the continuous batcher on the same step. Greedy rows equal HF
    `generate`, logprobs to 1e-5."""
    from tiller.rollout import compiled_decode

    model, tok = load_family(layer_kind_dir, model_type)
    prompts = prompt_ids(tok, MORE_PROMPTS)
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=16, ignore_eos=True)
    hf = build_rollout_engine("hf", model, tok).generate(prompts, greedy)
    assert len(set(map(tuple, hf.response_ids))) == len(prompts)
    engines = [build_rollout_engine("native", model, tok, prefill_tokens=16)]
    if compiled_decode.available() and model_type == "qwen2_moe":  # (one family compiled: ~15 s each)
        engines.append(build_rollout_engine("native", model, tok, compile_decode=True))
    for engine in engines:
        out = engine.generate(prompts, greedy)
        experts = [lin is None for lin in engine._fused.gate_up]
        assert any(experts) and experts == [fused_decode.is_experts(layer.mlp) for layer in model.model.layers]
        # (1e-4: these logits reach ~|10|, and fp32 summation order moves a logprob by ~1e-5; an expert routed
        # differently moves it by ~1e-1)
        assert_same_rows(out, hf, atol=1e-4)
    assert engines[-1]._fused.compiled is not None or len(engines) == 1
    # rows joining and leaving the continuous batcher at different steps (its slot cache, the same fused step)
    outs, _ = staggered_greedy(engines[0], prompts, 16, max_rows=3)
    for k, out in enumerate(outs):
        assert out.response_ids[0] == hf.response_ids[2 * k][: 16 - k]


def test_rows_leaving_the_batch_do_not_change_others(sharp_qwen):
    """Stop ids end rows at different steps, so the batch is compacted several times; greedy rows are
    independent, so every row must still equal HF's (which never compacts)."""
    model, tok = sharp_qwen
    prompts = prompt_ids(tok, MORE_PROMPTS)
    free = build_rollout_engine("hf", model, tok).generate(
        prompts, SamplingParams(do_sample=False, max_new_tokens=30, ignore_eos=True))
    stops = sorted({r[k] for r, k in zip(free.response_ids, [3, 7, 12, 20, 25, 29])})
    greedy = SamplingParams(do_sample=False, max_new_tokens=30, ignore_eos=True, stop_token_ids=stops)
    hf = build_rollout_engine("hf", model, tok).generate(prompts, greedy)
    native = build_rollout_engine("native", model, tok, compact_fraction=0.01).generate(prompts, greedy)
    assert native.response_ids == hf.response_ids and native.finish_reason == hf.finish_reason
    assert len({len(r) for r in native.response_ids}) >= 3 and "stop" in native.finish_reason


def test_waves_give_the_same_greedy_output(sharp_qwen):
    model, tok = sharp_qwen
    prompts = prompt_ids(tok, MORE_PROMPTS)
    greedy = SamplingParams(n=3, do_sample=False, max_new_tokens=10)
    one = build_rollout_engine("native", model, tok).generate(prompts, greedy)
    waves = build_rollout_engine("native", model, tok, max_num_seqs=4).generate(prompts, greedy)
    assert waves.response_ids == one.response_ids and waves.prompt_ids == one.prompt_ids


def test_warp_logits_worked_numbers():
    # logits log([0.5, 0.25, 0.15, 0.1]): probabilities 0.5, 0.25, 0.15, 0.1.
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    inf = float("-inf")
    # top-k 2 keeps 0.5 and 0.25 -> renormalised 2/3, 1/3
    kept = warp_logits(logits, top_k=2).softmax(-1)
    torch.testing.assert_close(kept, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    # top-p 0.7: ascending cumsum 0.1, 0.25, 0.5, 1.0; drop cum <= 0.3 -> drop 0.1 and 0.15; keep 0.5, 0.25
    assert warp_logits(logits, top_p=0.7)[0, 2:].tolist() == [inf, inf]
    # min-p 0.4: threshold 0.4 * 0.5 = 0.2 -> keep 0.5 and 0.25 only
    assert torch.isfinite(warp_logits(logits, min_p=0.4)).tolist() == [[True, True, False, False]]
    # temperature 2: probabilities ~ sqrt(p): 0.7071, 0.5, 0.3873, 0.3162 over their sum 1.9106
    torch.testing.assert_close(warp_logits(logits, temperature=2.0).softmax(-1),
                               torch.tensor([[0.3701, 0.2617, 0.2027, 0.1655]]), atol=1e-4, rtol=0)


def test_sampled_tokens_respect_top_k_and_top_p(qwen):
    model, tok = qwen
    engine = build_rollout_engine("native", model, tok)
    out = engine.generate(prompt_ids(tok)[:2], SamplingParams(n=4, top_k=1, max_new_tokens=6, seed=0,
                                                               ignore_eos=True))
    greedy = engine.generate(prompt_ids(tok)[:2], SamplingParams(n=4, do_sample=False, max_new_tokens=6,
                                                                  ignore_eos=True))
    assert out.response_ids == greedy.response_ids  # top-k 1 is greedy
    assert all(lp == 0.0 for row in out.logprobs for lp in row)  # a one-token distribution: log 1 = 0


def test_fused_decode_equals_hf_forward_decode_and_follows_weights(sharp_llama):
    model, tok = sharp_llama
    actor = type(model)(model.config)
    actor.load_state_dict(model.state_dict())
    prompts = prompt_ids(tok, MORE_PROMPTS)
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=16, ignore_eos=True)
    fused = build_rollout_engine("native", actor, tok)
    plain = build_rollout_engine("native", actor, tok, fused_decode=False)
    a = fused.generate(prompts, greedy)
    assert fused._fused is not None and plain._fused is None
    assert a.response_ids == plain.generate(prompts, greedy).response_ids
    with torch.no_grad():  # an optimizer step, in place, with no update_weights() call
        for p in actor.parameters():
            p.mul_(1.5)
    b = fused.generate(prompts, greedy)
    assert b.response_ids != a.response_ids
    assert b.response_ids == plain.generate(prompts, greedy).response_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_decode_step_equals_the_plain_matmuls(sharp_qwen, dtype):
    """oneDNN-prepacked weights change only the summation order: the step's logits match F.linear's."""
    model, _ = sharp_qwen
    model = copy.deepcopy(model).to(dtype)
    if not can_pack(model):
        pytest.skip("torch without mkldnn")
    packed, plain = FusedDecoder(model), FusedDecoder(model, pack=False)
    assert packed.qkv[0][2] is not None and plain.qkv[0][2] is None
    rows, width = 5, 7
    cache_a, cache_b = KVBuffer(rows, width, torch.device("cpu")), KVBuffer(rows, width, torch.device("cpu"))
    ids = torch.randint(0, 100, (rows, 1), generator=torch.Generator().manual_seed(0))
    pos = torch.zeros(rows, 1, dtype=torch.long)
    mask = torch.ones(rows, 1, 1, 1, dtype=torch.bool)
    with torch.no_grad():
        a, b = packed.step(ids, pos, mask, cache_a), plain.step(ids, pos, mask, cache_b)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(a.float(), b.float(), atol=tol * b.abs().max().item(), rtol=0)


def test_draw_from_matches_the_distribution():
    probs = torch.tensor([[0.5, 0.25, 0.0, 0.15, 0.1]]).repeat(20000, 1)
    tokens = draw_from(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=5).double() / len(tokens)
    # standard error of a frequency near 0.5 over 20000 draws is 0.0035; allow ~4 of them
    torch.testing.assert_close(freq, probs[0].double(), atol=0.015, rtol=0)
    assert freq[2] == 0  # a zero-probability token is never drawn
    again = draw_from(probs, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)


def test_the_draw_by_blocks_picks_the_inverse_cdfs_tokens():
    """`draw_blocked` (the static decode step's draw) picks the token `draw_with_uniforms` picks for the same uniform:
    vocabularies that blocks do and do not divide, filtered (-inf) tokens, a row with one token left, uniforms at
    the edges; never a zero-probability token."""
    from tiller.rollout.sampling import draw_blocked, draw_with_uniforms

    g = torch.Generator().manual_seed(0)
    for vocab, block in ((512, 1024), (5000, 1024), (5000, 64), (3000, 7)):
        scores = torch.randn(64, vocab, generator=g) * 3
        scores[:, ::3] = float("-inf")
        scores[0, :] = float("-inf")
        scores[0, vocab - 2] = 1.0  # one token left, in the last block
        lse = torch.logsumexp(scores, -1, keepdim=True)
        u = torch.cat([torch.rand(64, 40, generator=g, dtype=torch.float64),
                       torch.tensor([0.0, 1 - 2 ** -53], dtype=torch.float64).expand(64, 2)], dim=1)
        for col in range(u.shape[1]):
            got = draw_blocked(scores, lse, u[:, col : col + 1], block)
            assert torch.equal(got, draw_with_uniforms(torch.exp(scores - lse), u[:, col : col + 1]))
            assert torch.isfinite(scores.gather(1, got[:, None])).all() and got[0] == vocab - 2


def test_top_p_min_p_logprobs_match_hf_warpers(sharp_qwen):
    """Native logprobs with temperature + top-p + min-p equal HF's own warpers applied to a teacher-forced
    forward of the same tokens (both engines then sample from one distribution)."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopPLogitsWarper

    model, tok = sharp_qwen
    prompts = prompt_ids(tok)[:2]
    out = build_rollout_engine("native", model, tok).generate(
        prompts, SamplingParams(n=3, temperature=0.8, top_p=0.9, min_p=0.05, max_new_tokens=10, seed=1,
                                ignore_eos=True))
    warpers = [TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)]
    for prompt, response, logprobs in zip(out.prompt_ids, out.response_ids, out.logprobs):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        for t in range(len(response)):
            scores = logits[t : t + 1]
            for w in warpers:
                scores = w(ids[:, : len(prompt) + t], scores)
            ref = torch.log_softmax(scores, dim=-1)[0, response[t]]
            assert torch.isfinite(ref)  # the sampled token survived HF's filters too
            assert abs(logprobs[t] - ref.item()) < 1e-4


def test_fused_decode_declines_a_peft_wrapped_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from tiller.models.lora import apply_lora
    from tiller.rollout.fused_decode import supports

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert supports(model)
    assert not supports(apply_lora(model, rank=2, alpha=4))


def test_prefill_chunks_group_similar_lengths():
    from tiller.rollout.native import prefill_chunks

    # sorted: 10, 11, 12 | 29, 30. Adding 29 to the first chunk would pad to 4 x 29 = 116 with 54 padded
    # slots (> 1/8 of 116), so it starts a chunk; 30 joins it (60 slots, 1 padded)
    assert prefill_chunks([30, 10, 11, 29, 12], 4096) == [[1, 2, 4], [3, 0]]
    # the token budget splits equal lengths too: 3 x 10 = 30 > 25
    assert prefill_chunks([10, 10, 10, 10], 25) == [[0, 1], [2, 3]]
    lengths = [(7 * i) % 41 + 1 for i in range(64)]
    chunks = prefill_chunks(lengths, 256)
    assert sorted(i for c in chunks for i in c) == list(range(64))  # every prompt exactly once
    for c in chunks:
        padded = max(lengths[i] for i in c) * len(c)
        assert padded <= 256 or len(c) == 1
        assert padded - sum(lengths[i] for i in c) <= padded / 8


def test_packed_chunks_keep_order_within_the_token_budget():
    from tiller.rollout.native import packed_chunks

    assert packed_chunks([30, 10, 11, 29, 12], 60) == [[0, 1, 2], [3, 4]]
    assert packed_chunks([70, 5, 5], 60) == [[0], [1, 2]]  # a prompt over the budget is a chunk of its own
    lengths = [(7 * i) % 41 + 1 for i in range(64)]
    chunks = packed_chunks(lengths, 256)
    assert [i for c in chunks for i in c] == list(range(64))
    assert all(sum(lengths[i] for i in c) <= 256 for c in chunks)
    assert all(sum(lengths[i] for i in a) + lengths[b[0]] > 256 for a, b in zip(chunks, chunks[1:]))


def _prefills(model, prompts, n: int, width: int, budget: int):
    """(first logits, keys, values) of the padded and the packed prefill of `prompts` (n rows each)."""
    out = []
    for packed in (False, True):
        engine = build_rollout_engine("native", model, None, packed_prefill=packed, prefill_tokens=budget)
        engine.fused_for(model)
        assert engine.packs_prefill(model, "cpu", torch.float32) is packed
        cache = KVBuffer(len(prompts) * n, width + 4, torch.device("cpu"))
        with torch.no_grad():
            logits = engine._prefill(model, prompts, cache, width, n, 0)
        out.append((logits, cache.keys, cache.values))
    return out


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "glm4", "qwen2_moe"])
def test_packed_prefill_equals_the_padded_one(model_type, layer_kind_dir, tiny_model_dir):
    """Prompts prefilled end to end without padding (a GPU's default: torch's varlen kernel; here SDPA per prompt)
    give the padded chunks' first logits and write the same keys / values at the same cells of every row, zeros
    elsewhere; Qwen3's head norms, GLM-4's post norms and pair rotary, an experts layer; chunks cut by the budget."""
    from tests.rollout.conftest import load

    model, _ = load(tiny_model_dir) if model_type == "qwen2" else load_family(layer_kind_dir, model_type)
    prompts = [[5, 6, 7, 8], [9, 10], [11], list(range(20, 45)), [3, 4, 5, 6, 7, 8, 9], [12, 13, 14]]
    width, n = 25, 3
    for budget in (4096, 30):  # one chunk; four ([0-3 tokens..]: 4+2+1 | 25 | 7+3)
        (want, wk, wv), (got, gk, gv) = _prefills(model, prompts, n, width, budget)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        for a, b in zip([*gk, *gv], [*wk, *wv]):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
        # each prompt's n rows hold its keys at its last len(p) columns; nothing before them
        first_layer = gk[0]
        for i, p in enumerate(prompts):
            rows = first_layer[i * n : (i + 1) * n]
            assert rows[:, :, : width - len(p)].abs().sum() == 0 and rows[:, :, width - len(p) : width].abs().min() > 0
            assert torch.equal(rows[0], rows[-1])


def test_packed_prefill_generates_what_the_padded_one_does(sharp_qwen):
    """The whole generate, eager and static-shape decode: the same greedy rows and logprobs either way."""
    model, tok = sharp_qwen
    prompts = prompt_ids(tok, MORE_PROMPTS)
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=10, ignore_eos=True)
    for static in (False, True):
        padded, packed = (build_rollout_engine("native", model, tok, packed_prefill=p, static_decode=static,
                                               prefill_tokens=12).generate(prompts, greedy) for p in (False, True))
        assert_same_rows(packed, padded, atol=1e-5)
