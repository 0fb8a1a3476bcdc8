"""Rule-based scorers: GSM8K (strict / flexible, all 1319 test solutions), arithmetic, format, math-verify."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tiller.errors import UserError
from tiller.rewards import default_compute_score
from tiller.rewards.scorers import arithmetic, gsm8k
from tiller.rewards.scorers import format as fmt
from tiller.rewards.scorers import math as math_scorer

GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")


def _gsm8k_rows():
    if not GSM8K_TEST.exists():
        pytest.skip(f"{GSM8K_TEST} not present")
    return [json.loads(line) for line in GSM8K_TEST.read_text().splitlines() if line.strip()]


def test_gsm8k_every_test_solution_scores_one_and_a_wrong_number_zero():
    rows = _gsm8k_rows()
    assert len(rows) == 1319
    for row in rows:
        truth = row["answer"].split("####")[-1].strip().replace(",", "")
        wrong = str(int(float(truth)) + 1)
        for method in ("strict", "flexible"):
            assert default_compute_score("openai/gsm8k", row["answer"], truth, method=method) == 1.0, row
            # the solution with its final number replaced by a wrong one
            bad = row["answer"].rsplit("####", 1)[0] + "#### " + wrong
            assert default_compute_score("openai/gsm8k", bad, truth, method=method) == 0.0, row


@pytest.mark.parametrize(
    "response, strict, flexible",
    [
        ("#### 1,234", 1.0, 1.0),  # commas stripped in both
        ("#### $1234", 0.0, 1.0),  # '$' directly after '####' does not match the strict regex
        ("#### 1234.00", 0.0, 1.0),  # strict is a string match; flexible compares numbers
        ("The answer is 1234.", 0.0, 1.0),  # no '####': strict finds nothing
        ("#### 1234\nor maybe 99", 1.0, 0.0),  # flexible takes the last number
        ("####1234", 0.0, 1.0),  # strict needs the space
        ("#### 12\n#### 1234", 1.0, 1.0),  # strict takes the last match
        ("x" * 400 + "#### 1234", 1.0, 1.0),
        ("#### 1234" + "x" * 300, 0.0, 1.0),  # strict only reads the last 300 characters
    ],
)
def test_gsm8k_formatting_variants(response, strict, flexible):
    assert gsm8k.compute_score(response, "1234", method="strict") == strict
    assert gsm8k.compute_score(response, "1234", method="flexible") == flexible


def test_gsm8k_format_score_and_bad_method():
    assert gsm8k.compute_score("#### 5", "6", format_score=0.1) == 0.1  # wrong number, right format
    assert gsm8k.compute_score("no answer", "6", format_score=0.1) == 0.0
    with pytest.raises(ValueError):
        gsm8k.compute_score("#### 5", "5", method="loose")


def test_arithmetic_last_integer():
    assert arithmetic.compute_score("17 + 25 = 42", "42") == 1.0
    assert arithmetic.compute_score("42, no wait, 41", "42") == 0.0
    assert arithmetic.compute_score("-7", "-7") == 1.0
    assert arithmetic.compute_score("no digits", "3") == 0.0
    assert default_compute_score("tiller/arithmetic", "=> 99", "99") == 1.0


def test_think_format():
    assert fmt.think_format_ok("<think>6*7</think>42")
    assert not fmt.think_format_ok("<think>6*7</think>")  # no answer
    assert not fmt.think_format_ok("42 <think>x</think> 42")  # not at the start
    assert not fmt.think_format_ok("<think>a<think>b</think>42")  # nested
    ok = default_compute_score("tiller/arithmetic", "<think>6*7=41?</think> 42", "42", think_format=True)
    assert ok == {"score": 1.0, "format": 1.0}  # the 41 in the thought is not the answer
    bad = default_compute_score("tiller/arithmetic", "42", "42", think_format=True)
    assert bad == {"score": 0.0, "format": 0.0}


def test_unknown_data_source_is_a_user_error():
    with pytest.raises(UserError, match="openai/gsm8k"):
        default_compute_score("my/unknown", "x", "y")


@pytest.mark.parametrize(
    "truth, answer, expected",
    [
        ("\\frac{1}{2}", "0.5", 1.0),  # fraction vs decimal
        ("\\frac12", "\\dfrac{1}{2}", 1.0),  # LaTeX spellings (fast path)
        ("\\{1,2,3\\}", "\\{3,1,2\\}", 1.0),  # sets are unordered
        ("(0,1]", "(0,1]", 1.0),  # interval
        ("2\\sqrt{2}", "\\sqrt{8}", 1.0),  # symbolic simplification
        ("x=3", "3", 1.0),  # equation vs value
        ("10", "10.0", 1.0),
        ("1/3", "0.33", 0.0),  # not equal to 6 places
        ("\\frac{1}{2}", "\\frac{1}{3}", 0.0),
        ("\\{1,2\\}", "\\{1,3\\}", 0.0),
    ],
)
def test_math_verify_equivalences(truth, answer, expected):
    assert default_compute_score("HuggingFaceH4/MATH-500", f"so the answer is $\\boxed{{{answer}}}$.", truth) == expected


def test_math_needs_a_box_and_takes_the_last():
    assert math_scorer.compute_score("the answer is 5", "5") == 0.0
    assert math_scorer.compute_score("\\boxed{4} no, \\boxed{5}", "5") == 1.0
    assert math_scorer.compute_score("\\boxed{\\frac{a}{b+{c}}}", "\\frac{a}{b+c}") == 1.0  # nested braces
    assert math_scorer.last_boxed_only_string("\\boxed{unclosed") is None


def test_pathological_math_input_returns_within_the_bound():
    # A tower of exponents sends sympy's numeric comparison into an effectively endless evaluation;
    # the worker process is killed at the deadline and the answer scores 0.
    start = time.monotonic()
    score = math_scorer.compute_score("\\boxed{9^{9^{9^{9^{9}}}}}", "1", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert score == 0.0
    assert elapsed < 1.0 + 10.0  # the bound plus worker restart on a busy 2-core machine
    # the scorer still works after the kill
    assert math_scorer.compute_score("\\boxed{0.25}", "\\frac{1}{4}") == 1.0


def test_math_works_from_a_thread():
    import threading

    out = []
    worker = threading.Thread(target=lambda: out.append(math_scorer.compute_score("\\boxed{0.5}", "\\frac{1}{2}")))
    worker.start()
    worker.join(60)
    assert out == [1.0]


def test_math_dapo_answer_line():
    # verl's math_dapo: +1 / -1 and the normalised prediction
    assert default_compute_score("math_dapo", "work...\nAnswer: 1,000", "1000") == {"score": 1.0, "acc": 1.0, "pred": "1000"}
    assert default_compute_score("aime2024", "Answer: 7 dollars", "7")["score"] == 1.0
    assert default_compute_score("aime2024", "Answer: 8", "7")["score"] == -1.0
    assert default_compute_score("math_dapo", "no answer line", "7")["pred"] == "[INVALID]"


def test_reasoning_gym_own_scorer():
    reasoning_gym = pytest.importorskip("reasoning_gym")
    data = reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=5)
    for entry in data:
        extra = {"metadata": entry["metadata"], "question": entry["question"]}
        good = f"<think>hm</think><answer>{entry['answer']}</answer>"
        assert default_compute_score("reasoning_gym/basic_arithmetic", good, entry["answer"], extra) == 1.0
        assert default_compute_score("reasoning_gym", "<answer>nonsense</answer>", entry["answer"], extra) == 0.0
