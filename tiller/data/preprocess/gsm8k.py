"""GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems") in verl's RL schema.

Follows `verl/examples/data_preprocess/gsm8k.py`: the prompt is the question followed by the instruction
"Let's think step by step and output the final answer after \"####\".", the ground truth is the text after
`####` in the reference solution (commas removed), `data_source` is `openai/gsm8k`, `ability` is `math`.
Input: the original `{train,test}.jsonl` files with `question` / `answer` fields (`--src DIR`), or, with no
source dir, the `openai/gsm8k` dataset (config `main`) through `datasets.load_dataset`, which reads the local
Hugging Face cache when the hub is unreachable.
"""

from __future__ import annotations

import re
from pathlib import Path

from tiller.data.rl_dataset import read_rows, write_rows
from tiller.errors import DataError

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
HUB_NAME, HUB_CONFIG = "openai/gsm8k", "main"
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


def load_hub_splits(name: str = HUB_NAME, config: str = HUB_CONFIG) -> dict[str, list[dict]]:
    """{"train": rows, "test": rows} of `name` through `datasets.load_dataset` (hub, or its local cache)."""
    try:
        import datasets
    except ImportError as err:
        raise DataError(f"gsm8k: no --src given and the `datasets` package is not installed to load {name!r}; "
                        "pass --src DIR (with train.jsonl and test.jsonl) or `pip install datasets`") from err
    try:
        ds = datasets.load_dataset(name, config)
    except Exception as err:  # offline without a cached copy, or any hub error: one line, the way out named
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"gsm8k: could not load {name!r} ({config}) with datasets.load_dataset: {first[:200]}; "
                        "pass --src DIR with train.jsonl and test.jsonl (the original GSM8K files)") from err
    return {split: [dict(row) for row in ds[split]] for split in ("train", "test")}


def convert(src: str | Path | None, out_dir: str | Path, max_rows: int = -1) -> dict[str, Path]:
    """Convert `src/{train,test}.jsonl` (or .parquet), or with `src=None` the `openai/gsm8k` dataset, to
    `out_dir/{train,test}.parquet`; returns the paths."""
    out_dir = Path(out_dir).expanduser()
    if src is None:
        sources = {split: (rows, f"{HUB_NAME} {split}") for split, rows in load_hub_splits().items()}
    else:
        src = Path(src).expanduser()
        if not src.is_dir():
            raise DataError(f"gsm8k source dir not found: {src}")
        sources = {}
        for split in ("train", "test"):
            candidates = [src / f"{split}.jsonl", src / f"{split}.parquet"]
            path = next((c for c in candidates if c.exists()), None)
            if path is None:
                raise DataError(f"gsm8k: no {split}.jsonl or {split}.parquet in {src}")
            sources[split] = (read_rows(path), str(path))
    written = {}
    for split, (rows, where) in sources.items():
        if max_rows > 0:
            rows = rows[:max_rows]
        written[split] = write_rows(convert_rows(rows, split, where=where), out_dir / f"{split}.parquet")
    return written
