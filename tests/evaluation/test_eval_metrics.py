"""Worked numbers for pass@k, maj@k, mean@n (tiller.evaluation.metrics) and answer extraction."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tiller.evaluation.answers import extract_answer
from tiller.evaluation.metrics import evaluation_metrics, k_ladder, maj_at_k, majority_answer, pass_at_k


def test_pass_at_k_worked_numbers():
    # n=5, c=2: pass@1 = 1 - C(3,1)/C(5,1) = 1 - 3/5 = 0.4
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    # pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10 = 0.9
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    # pass@4: n - c = 3 < 4, every 4-subset holds a correct sample
    assert pass_at_k(5, 2, 4) == 1.0
    assert pass_at_k(5, 0, 5) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0


def test_pass_at_k_matches_binomial_formula_and_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                # brute force: fraction of k-subsets (correct = first c indices) with a correct sample
                subsets = list(itertools.combinations(range(n), k))
                brute = np.mean([any(i < c for i in s) for s in subsets])
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_k_is_unbiased_not_the_plugin_estimate():
    # n=4, c=2, k=2: unbiased 1 - C(2,2)/C(4,2) = 1 - 1/6 = 0.8333; plug-in 1 - (1/2)^2 = 0.75
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    assert pass_at_k(4, 2, 2) != pytest.approx(0.75)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_majority_ties_break_by_first_appearance_and_none_does_not_vote():
    assert majority_answer(["b", "a", "a", "b"]) == 0  # 2-2 tie: "b" appears first
    assert majority_answer(["a", "b", "b"]) == 1
    assert majority_answer([None, None, "x"]) == 2
    assert majority_answer([None, None]) is None


def test_maj_at_k_worked_numbers():
    answers = ["7", "7", "8", "9"]
    correct = [1, 1, 0, 0]
    # k = n: "7" has 2 votes of 4 -> correct
    assert maj_at_k(answers, correct, 4) == 1.0
    # k = 1: the answer of one random sample: 2 of 4 correct -> 0.5
    assert maj_at_k(answers, correct, 1) == pytest.approx(0.5)
    # k = 2, all C(4,2)=6 pairs: {7,7} -> 7 correct; {7,8}x2, {7,9}x2 -> tie, first is "7" (index order) -> correct;
    # {8,9} -> "8" wrong. 5/6
    assert maj_at_k(answers, correct, 2) == pytest.approx(5 / 6)
    # no voter -> 0
    assert maj_at_k([None, None], [1, 1], 2) == 0.0


def test_maj_at_k_resampled_estimate_is_seeded_and_close_to_exact():
    rng = np.random.default_rng(0)
    answers = [str(a) for a in rng.integers(0, 3, size=14)]
    correct = [1.0 if a == "1" else 0.0 for a in answers]
    exact = maj_at_k(answers, correct, 5, n_resamples=10**6)  # C(14,5) = 2002 subsets, enumerated
    est = maj_at_k(answers, correct, 5, n_resamples=500, seed=3)
    assert est == maj_at_k(answers, correct, 5, n_resamples=500, seed=3)
    assert abs(est - exact) < 0.08


def test_k_ladder():
    assert k_ladder(1) == [1]
    assert k_ladder(4) == [1, 2, 4]
    assert k_ladder(5) == [1, 2, 4, 5]


def test_evaluation_metrics_per_source():
    def rec(src, p, acc, pred, score=None):
        return {"data_source": src, "prompt_index": p, "acc": acc, "pred": pred, "score": acc if score is None else score}

    records = [
        # source a, n=2: prompt 0 both right, prompt 1 one right (the first answer wins the 1-1 tie: wrong one)
        rec("a", 0, 1, "1"), rec("a", 0, 1, "1"),
        rec("a", 1, 0, "5"), rec("a", 1, 1, "6"),
        # source b, n=1
        rec("b", 2, 0, None, score=-1.0),
    ]
    m = evaluation_metrics(records)
    # mean@2 = mean(1, 0.5) = 0.75; pass@2 = mean(1, 1) = 1; maj@2 = mean(1, 0) = 0.5; pass@1 = mean@2
    assert m["a"]["mean@2"] == pytest.approx(0.75)
    assert m["a"]["pass@1"] == pytest.approx(0.75)
    assert m["a"]["pass@2"] == 1.0
    assert m["a"]["maj@2"] == 0.5
    assert m["a"]["num_prompts"] == 2
    assert m["b"] == {"num_prompts": 1.0, "n": 1.0, "mean@1": 0.0, "reward/mean@1": -1.0, "pass@1": 0.0, "maj@1": 0.0}
    with pytest.raises(ValueError, match="different sample counts"):
        evaluation_metrics(records + [rec("b", 2, 1, "3")] + [rec("b", 3, 1, "3")] * 3)


def test_extract_answer_by_data_source():
    assert extract_answer("openai/gsm8k", "so 1,234.0 apples\n#### 1,234") == "1234"
    assert extract_answer("gsm8k", "it is 18.00 dollars") == "18"  # flexible fallback, canonical number
    assert extract_answer("lighteval/MATH", r"thus \boxed{\dfrac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_answer("math_dapo", "work\nAnswer: 42") == "42"
    assert extract_answer("tiller/arithmetic", "3+4=7 ok") == "7"
    assert extract_answer("tiller/arithmetic", "no digits") is None
    assert extract_answer("custom", "<think>hmm</think>  Paris \n") == "Paris"
