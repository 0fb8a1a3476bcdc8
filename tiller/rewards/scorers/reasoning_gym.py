"""reasoning-gym tasks (https://github.com/open-thought/reasoning-gym) scored by their own scorers.

data_source `reasoning_gym/<task>` (or `reasoning_gym` with the task in
`extra_info["metadata"]["source_dataset"]`). The ground truth is the entry's `answer`; the entry's
`metadata` comes from `extra_info["metadata"]` (as `tiller data` writes it). The answer is the text
inside the last `<answer>...</answer>` when present, else the response after `</think>`, stripped.
"""

from __future__ import annotations

import re
from typing import Any

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(response: str) -> str:
    """`<answer>x</answer>` -> 'x'; otherwise the text after the last `</think>`."""
    tags = _ANSWER_TAG.findall(response)
    if tags:
        return tags[-1].strip()
    idx = response.rfind("</think>")
    return (response if idx < 0 else response[idx + len("</think>"):]).strip()


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """The task's own `score_answer(answer, entry)` in [0, 1]."""
    import reasoning_gym

    metadata = dict((extra_info or {}).get("metadata") or {})
    task = data_source.split("/", 1)[1] if "/" in data_source else metadata.get("source_dataset")
    if not task:
        raise ValueError("reasoning_gym needs data_source 'reasoning_gym/<task>' or metadata.source_dataset")
    metadata.setdefault("source_dataset", task)
    entry = {"question": (extra_info or {}).get("question", ""), "answer": ground_truth, "metadata": metadata}
    score_fn = reasoning_gym.get_score_answer_fn(task)
    return float(score_fn(extract_answer(solution_str), entry))
