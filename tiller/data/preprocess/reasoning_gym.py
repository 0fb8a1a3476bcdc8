"""reasoning-gym tasks (procedural, offline) in verl's RL schema, scored by the task's own scorer.

Each entry of `reasoning_gym.create_dataset(task, size, seed)` becomes a row with
`data_source = "reasoning_gym/<task>"`, the question (plus an instruction to put the final answer in
`<answer>...</answer>`) as one user message, `reward_model.ground_truth` = the entry's answer, and
`extra_info = {"question", "metadata"}` (what `tiller.rewards.scorers.reasoning_gym` reads back).
Train and test use different seeds, so they are different draws of the task.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiller.data.rl_dataset import write_rows
from tiller.errors import DataError, UserError

INSTRUCTION = "Give only the final answer inside <answer></answer>."


def make_rows(task: str, size: int, seed: int, split: str, instruction: str = INSTRUCTION) -> list[dict]:
    """`size` verl rows of reasoning-gym `task` drawn with `seed`."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise UserError("tiller data reasoning-gym needs `pip install reasoning-gym`") from err
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed)
    except (KeyError, ValueError) as err:
        raise UserError(f"reasoning-gym: unknown task or bad options for {task!r}: {err}") from err
    rows = []
    for i, entry in enumerate(dataset):
        # metadata goes through JSON so parquet gets plain types (tuples -> lists, no numpy scalars)
        metadata = json.loads(json.dumps(entry.get("metadata", {}), default=str))
        rows.append({
            "data_source": f"reasoning_gym/{task}",
            "prompt": [{"role": "user", "content": f"{entry['question']} {instruction}".strip()}],
            "ability": "reasoning",
            "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
            "extra_info": {"split": split, "index": i, "question": entry["question"], "metadata": metadata},
        })
    return rows


def convert(task: str, out_dir: str | Path, n_train: int = 1000, n_test: int = 200, seed: int = 0,
            fmt: str = "parquet") -> dict[str, Path]:
    """Write `out_dir/{train,test}.<fmt>`; returns the paths."""
    out_dir = Path(out_dir)
    written = {}
    for split, size, split_seed in (("train", n_train, seed), ("test", n_test, seed + 1_000_003)):
        rows = make_rows(task, size, split_seed, split)
        try:
            written[split] = write_rows(rows, out_dir / f"{split}.{fmt}")
        except Exception as err:  # pyarrow cannot type some tasks' mixed metadata
            if fmt != "parquet":
                raise
            raise DataError(f"reasoning-gym {task}: cannot write parquet ({err}); use --format jsonl") from err
    return written
