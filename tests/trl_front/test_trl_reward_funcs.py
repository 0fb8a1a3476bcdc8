"""tiller.trl.reward_funcs: TRL's built-in reward functions, value for value against `trl.rewards` (when trl is
installed) and against worked numbers (always)."""

from __future__ import annotations

import pytest

from tiller.trl import reward_funcs as rf

SOLUTIONS = [r"\frac{1}{3}", r"\frac{1}{3}", "42", r"\frac{1}{3}", "not math at all", "2", r"$0.5$", "x"]
TEXTS = [r"My answer is \boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", r"The answer is $42$.",
         r"<think> hmm </think> so \boxed{0.333}", r"\boxed{1}", r"<think>a<think>b</think> \boxed{2}",
         r"<think>x</think>\boxed{\frac{1}{2}}", "no answer"]
COMPLETIONS = [[{"role": "assistant", "content": t}] for t in TEXTS]
IDS = [[1] * n for n in (0, 1, 2, 3, 1000, 1024, 1100, 1280)] + [[1] * 1281]


def test_worked_numbers():
    assert rf.accuracy_reward(COMPLETIONS[:3], SOLUTIONS[:3]) == [1.0, 0.0, 1.0]
    # no </think>: incomplete reasoning scores 0 even when the boxed answer is right; after it, math-verify
    assert rf.reasoning_accuracy_reward(
        [[{"content": r"\boxed{2}"}], [{"content": r"<think>.</think> \boxed{2}"}]], ["2", "2"]) == [0.0, 1.0]
    assert rf.think_format_reward(COMPLETIONS) == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    # L_max 1280, L_cache 256: free up to 1024; 1100 -> (1024 - 1100) / 256; past 1280 -> -1
    punish = rf.SCRIPT_REWARDS["get_soft_overlong_punishment"]()
    assert punish(completion_ids=IDS[-5:]) == [0.0, 0.0, (1024 - 1100) / 256, (1024 - 1280) / 256, -1.0]
    assert punish.__name__ == "soft_overlong_punishment_reward"
    # plain-string completions (standard prompts) are scored as their text
    assert rf.think_format_reward(["<think>a</think>b", "b"]) == [1.0, 0.0]


def test_builtins_equal_trl_rewards():
    trl_rewards = pytest.importorskip("trl.rewards")
    pytest.importorskip("math_verify")
    logged_trl, logged_tiller = {}, {}
    assert rf.accuracy_reward(COMPLETIONS, SOLUTIONS, log_extra=logged_tiller.__setitem__) == \
        trl_rewards.accuracy_reward(COMPLETIONS, SOLUTIONS, log_extra=logged_trl.__setitem__)
    assert logged_tiller == logged_trl
    for delims in (None, ["</think>", "so"]):
        assert rf.reasoning_accuracy_reward(COMPLETIONS, SOLUTIONS, reasoning_delimiters=delims) == \
            trl_rewards.reasoning_accuracy_reward(COMPLETIONS, SOLUTIONS, reasoning_delimiters=delims)
    assert rf.think_format_reward(COMPLETIONS) == trl_rewards.think_format_reward(COMPLETIONS)
    for cache in (256, 0):
        assert rf.get_soft_overlong_punishment(1280, cache)(completion_ids=IDS) == \
            trl_rewards.get_soft_overlong_punishment(1280, cache)(completion_ids=IDS)
    ids = IDS[:len(COMPLETIONS)]
    assert rf.get_cosine_scaled_reward(100)(COMPLETIONS, SOLUTIONS, ids) == \
        trl_rewards.get_cosine_scaled_reward(100)(COMPLETIONS, SOLUTIONS, ids)
    reps = [[1, 2, 3], [1, 1, 1, 1, 1], [1, 2, 1, 2, 1, 2], [5]]
    assert rf.get_repetition_penalty_reward(2, -0.5)(completion_ids=reps) == \
        trl_rewards.get_repetition_penalty_reward(2, -0.5)(completion_ids=reps)
