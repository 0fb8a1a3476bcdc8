"""GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems") in verl's RL schema.

Follows `verl/examples/data_preprocess/gsm8k.py`: the prompt is the question followed by the instruction
"Let's think step by step and output the final answer after \"####\".", the ground truth is the text after
`####` in the reference solution (commas removed), `data_source` is `openai/gsm8k`, `ability` is `math`.
Input: the original `{train,test}.jsonl` files with `question` / `answer` fields.
"""

from __future__ import annotations

import re
from pathlib import Path

from tiller.data.rl_dataset import read_rows, write_rows
from tiller.errors import DataError

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DEFAULT_SRC = Path("/work/shared/data/gsm8k")
_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_solution(answer: str) -> str:
    """The final answer after `####`, commas removed.

    >>> extract_solution("48/2 = 24\\n#### 1,072")
    '1072'
    """
    m = _ANSWER.search(answer)
    if m is None:
        raise ValueError(f"no '#### <number>' in answer: {answer[-60:]!r}")
    return m.group(1).replace(",", "")


def convert_rows(rows: list[dict], split: str, where: str = "gsm8k") -> list[dict]:
    """GSM8K rows -> verl rows (data_source, prompt, ability, reward_model, extra_info)."""
    out = []
    for i, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise DataError(f"{where} row {i}: needs 'question' and 'answer' fields (got {', '.join(row)})")
        try:
            solution = extract_solution(row["answer"])
        except ValueError as err:
            raise DataError(f"{where} row {i}: {err}") from err
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": i, "answer": row["answer"], "question": row["question"]},
        })
    return out


def convert(src: str | Path, out_dir: str | Path, max_rows: int = -1) -> dict[str, Path]:
    """Convert `src/{train,test}.jsonl` (or .parquet) to `out_dir/{train,test}.parquet`; returns the paths."""
    src, out_dir = Path(src).expanduser(), Path(out_dir).expanduser()
    if not src.is_dir():
        raise DataError(f"gsm8k source dir not found: {src}")
    written = {}
    for split in ("train", "test"):
        candidates = [src / f"{split}.jsonl", src / f"{split}.parquet"]
        path = next((c for c in candidates if c.exists()), None)
        if path is None:
            raise DataError(f"gsm8k: no {split}.jsonl or {split}.parquet in {src}")
        rows = read_rows(path)
        if max_rows > 0:
            rows = rows[:max_rows]
        written[split] = write_rows(convert_rows(rows, split, where=str(path)), out_dir / f"{split}.parquet")
    return written
