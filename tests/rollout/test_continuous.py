"""Continuous batching: rows join and leave between decode steps and still give the native engine's tokens;
seeded rows are batch-independent; limits (max_rows, stop strings, max_new_tokens) hold."""

from __future__ import annotations


import pytest
import torch

from tests.rollout.conftest import staggered_greedy
from tiller.rollout import SamplingParams


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from tiller.evaluation.runner import load_policy

    return load_policy(str(tiny_model_dir), dtype="float32")


def _ids(policy, text):
    return policy.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("packed_prefill", [False, True])
def test_greedy_rows_joining_at_different_steps_match_the_native_engine(policy, monkeypatch, packed_prefill):
    """(packed_prefill: the requests admitted alone are prefilled packed, a GPU's default; the reference padded)"""
    prompts = [_ids(policy, t) for t in ("1+2=", "The quick brown fox", "hello", "7*8=56, 9*9=")]
    greedy = SamplingParams(max_new_tokens=10, do_sample=False, ignore_eos=True)
    monkeypatch.setattr(policy.engine, "packed_prefill", False)
    ref = policy.engine.generate(prompts, greedy)
    monkeypatch.setattr(policy.engine, "packed_prefill", packed_prefill)
    outs, stats = staggered_greedy(policy.engine, prompts, 10, max_rows=3)  # 4 requests, 3 rows: one waits
    for k, out in enumerate(outs):
        assert out.response_ids[0] == ref.response_ids[k][: 10 - k]
        assert out.logprobs[0] == pytest.approx(ref.logprobs[k][: 10 - k], abs=1e-5)
        assert out.finish_reason == ["length"]
    assert stats["peak_rows"] == 3 and stats["tokens"] == 10 + 9 + 8 + 7
    # the 4th request waited for a row and was prefilled in the same pass as the live rows' decode step
    assert stats["prefills_in_decode"] >= 1


def test_seeded_rows_do_not_depend_on_the_batch(policy):
    from tiller.rollout.continuous import ContinuousBatcher

    p = _ids(policy, "The quick brown fox")
    seeded = SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=9, ignore_eos=True)
    batcher = ContinuousBatcher(policy.engine, max_rows=16)
    try:
        alone = batcher.submit([p], seeded).result(timeout=60)
        noise = [batcher.submit([_ids(policy, t)], SamplingParams(max_new_tokens=5 + k, temperature=0.7, ignore_eos=True))
                 for k, t in enumerate(["1+1=", "abc", "9*9=", "hello world"])]
        loaded = batcher.submit([p], seeded)
        more = [batcher.submit([_ids(policy, "2+2=")], SamplingParams(max_new_tokens=7, seed=k)) for k in range(3)]
        loaded = loaded.result(timeout=60)
        [f.result(timeout=60) for f in noise + more]
        other = batcher.submit([p], SamplingParams(n=2, max_new_tokens=16, seed=10, ignore_eos=True)).result(timeout=60)
    finally:
        batcher.close()
    assert loaded.response_ids == alone.response_ids  # same tokens; logprobs up to batched-matmul rounding
    for got, want in zip(loaded.logprobs, alone.logprobs):
        assert got == pytest.approx(want, abs=1e-5)
    assert alone.response_ids[0] != alone.response_ids[1]  # the n rows of a request draw differently
    assert other.response_ids != alone.response_ids
    assert batcher.stats["steps"] < batcher.stats["tokens"]  # rows shared steps


def test_stop_strings_logit_bias_top_logprobs_and_queue_limit(policy):
    from tiller.rollout.continuous import ContinuousBatcher, QueueFull

    p = _ids(policy, "The quick")
    batcher = ContinuousBatcher(policy.engine, max_rows=4, max_queue=64)
    try:
        free = batcher.generate([p], SamplingParams(max_new_tokens=12, do_sample=False, ignore_eos=True))
        text = policy.tokenizer.decode(free.response_ids[0])
        stop = text[3:5]
        cut = batcher.generate([p], SamplingParams(max_new_tokens=12, do_sample=False, ignore_eos=True, stop=(stop,)))
        assert stop in policy.tokenizer.decode(cut.response_ids[0]) and cut.finish_reason == ["stop"]
        assert cut.response_ids[0] == free.response_ids[0][: len(cut.response_ids[0])]
        forced = batcher.generate([p], SamplingParams(max_new_tokens=3, do_sample=False, ignore_eos=True),
                                  logit_bias={42: 100.0}, top_logprobs=4)
        assert forced.response_ids[0] == [42, 42, 42]
        assert [len(t) for t in forced.top_logprobs[0]] == [4, 4, 4] and forced.top_logprobs[0][0][0][0] == 42
        assert forced.top_logprobs[0][0][0][1] == pytest.approx(forced.logprobs[0][0])
    finally:
        batcher.close()
    small = ContinuousBatcher(policy.engine, max_rows=1, max_queue=1)
    try:
        first = small.submit([p], SamplingParams(max_new_tokens=64, do_sample=False, ignore_eos=True))
        with pytest.raises(QueueFull, match="--max-queue"):
            small.submit([p], SamplingParams(max_new_tokens=2))
        first.result(timeout=60)
    finally:
        small.close()


def test_a_repeated_prompt_is_prefilled_once_until_the_weights_change(tiny_model_dir):
    """The prompt cache: the same prompt again (4 requests of a group, then a later one) reuses the first
    prefill's keys / values and logits with the same tokens as a fresh prefill; new weights empty it."""
    from tiller.evaluation.runner import load_policy
    from tiller.rollout.continuous import ContinuousBatcher

    policy = load_policy(str(tiny_model_dir), dtype="float32")  # its own copy: this test changes the weights
    prompts = [_ids(policy, "The quick brown fox"), _ids(policy, "1+2=")]
    greedy = SamplingParams(max_new_tokens=8, do_sample=False, ignore_eos=True)
    ref = policy.engine.generate(prompts, greedy)
    batcher = ContinuousBatcher(policy.engine, max_rows=8)
    try:
        group = [batcher.submit([prompts[0]], greedy) for _ in range(4)] + [batcher.submit([prompts[1]], greedy)]
        outs = [f.result(timeout=60) for f in group]
        later = batcher.submit([prompts[0]], greedy).result(timeout=60)
        assert batcher.stats["prompt_cache_hits"] == 4  # 6 prompts, 2 prefills
        for out in outs[:4] + [later]:
            assert out.response_ids[0] == ref.response_ids[0]
            assert out.logprobs[0] == pytest.approx(ref.logprobs[0], abs=1e-5)
        assert outs[4].response_ids[0] == ref.response_ids[1]
        with torch.no_grad():  # an optimizer step in place: cached keys / values are stale now
            for p in policy.engine.weights.module.parameters():
                p.mul_(1.5)
        new = batcher.submit([prompts[0]], greedy).result(timeout=60)
        assert batcher.stats["prompt_cache_hits"] == 4
    finally:
        batcher.close()
    fresh = policy.engine.generate(prompts[:1], greedy)
    assert new.response_ids[0] == fresh.response_ids[0] != ref.response_ids[0]


def test_prompt_cache_off_still_gives_the_same_tokens(policy):
    from tiller.rollout.continuous import ContinuousBatcher

    prompt = _ids(policy, "hello")
    greedy = SamplingParams(max_new_tokens=6, do_sample=False, ignore_eos=True)
    ref = policy.engine.generate([prompt], greedy)
    batcher = ContinuousBatcher(policy.engine, prompt_cache_mb=0)
    try:
        outs = [batcher.submit([prompt], greedy).result(timeout=60) for _ in range(2)]
    finally:
        batcher.close()
    assert [o.response_ids[0] for o in outs] == [ref.response_ids[0]] * 2
    assert batcher.stats["prompt_cache_hits"] == 0 and not batcher.prompt_cache.entries


def test_a_prompt_sharing_a_cached_prefix_prefills_only_the_rest(policy):
    """An agent's next turn (the earlier prompt + more) and a prompt with the same long system text reuse the
    cached prefix's keys / values (token-granular) and give a fresh prefill's tokens and logprobs."""
    from tiller.rollout.continuous import ContinuousBatcher, PromptCache

    text = _ids(policy, "You are a careful assistant. Answer with one number. The quick brown fox jumps over it.")
    assert len(text) > PromptCache.MIN_PREFIX + 4
    first = text[: PromptCache.MIN_PREFIX + 2]
    longer = text  # shares all of `first`
    forked = first[:-1] + [t for t in _ids(policy, " 7*8=") if t != first[-1]]  # shares all but first's last token
    greedy = SamplingParams(max_new_tokens=6, do_sample=False, ignore_eos=True)
    ref = policy.engine.generate([longer, forked], greedy)
    batcher = ContinuousBatcher(policy.engine)
    try:
        batcher.submit([first], greedy).result(timeout=60)
        a = batcher.submit([longer], greedy).result(timeout=60)
        b = batcher.submit([forked], greedy).result(timeout=60)
    finally:
        batcher.close()
    assert batcher.stats["prompt_cache_prefix_tokens"] == len(first) + len(first) - 1
    assert a.response_ids[0] == ref.response_ids[0] and b.response_ids[0] == ref.response_ids[1]
    assert a.logprobs[0] == pytest.approx(ref.logprobs[0], abs=1e-5)
    assert b.logprobs[0] == pytest.approx(ref.logprobs[1], abs=1e-5)


def test_prompt_cache_lru_by_bytes_weights_and_longest_prefix():
    from tiller.rollout.continuous import PromptCache

    def entry(n):  # one layer, 1 head, dim 2, fp32: 2 * n * 2 * 4 bytes + 4 bytes of logits
        return [torch.zeros(1, n, 2)], [torch.zeros(1, n, 2)], torch.zeros(1)

    base = tuple(range(20))
    cache = PromptCache(max_bytes=3 * (2 * 20 * 2 * 4 + 4))  # three 20-token entries
    cache.check_weights(("v1",))
    for i in range(3):
        cache.put(base[:-1] + (100 + i,), *entry(20))
    assert cache.longest_prefix(list(base) + [7]) == (base[:-1] + (100,), 19)  # the oldest of equals
    assert cache.longest_prefix(list(base[:16]) + [9]) == (base[:-1] + (100,), 16)  # 16 shared, the 17th runs
    assert cache.longest_prefix(list(base[:15]) + [9, 9]) == (None, 0)  # 15 shared < MIN_PREFIX
    assert cache.longest_prefix(list(range(5))) == (None, 0)  # shorter than MIN_PREFIX
    cache.get(base[:-1] + (100,))  # used: the next eviction takes (101,)
    cache.put(base, *entry(20))
    assert set(cache.entries) == {base[:-1] + (100,), base[:-1] + (102,), base}
    assert cache.bytes == 3 * (2 * 20 * 2 * 4 + 4) and set(cache.arrays) == set(cache.entries)
    cache.check_weights(("v2",))  # new weights: nothing cached is valid
    assert not cache.entries and not cache.arrays and cache.bytes == 0
