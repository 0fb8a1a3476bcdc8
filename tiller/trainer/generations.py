"""verl's generation dumps: `trainer.rollout_data_dir` (every training step's samples) and
`trainer.validation_data_dir` (every validation's), each as `<dir>/<step>.jsonl`, one sample a line.

A line has verl's keys: `input` (the prompt as the policy saw it, chat template applied, decoded without special
tokens), `output` (the response, decoded likewise), `gts` (the ground truth), `score` (the reward, before any KL
penalty), `step`, then `uid` (the sample's prompt group) and the reward function's extra outputs (`acc`, `pred`,
...: a name with a value for every sample). Files are written whole (temp file, then rename), so a reader never sees
a half-written step; a resumed run rewrites the steps it repeats.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from tiller.data.files import write_rows


def _plain(value: Any) -> Any:
    """A JSON-ready copy: numpy scalars / arrays and tensors as Python numbers / lists, anything else as str."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):  # numpy scalars and arrays, torch tensors
        return _plain(value.tolist())
    return str(value)


def generation_rows(inputs: Sequence[str], outputs: Sequence[str], gts: Sequence[Any], scores: Sequence[float],
                    step: int, extras: dict[str, Sequence[Any]]) -> list[dict]:
    """verl's `_write_generations` records: one dict a sample; an extra whose length is not the sample count is
    left out (as verl does)."""
    n = len(inputs)
    columns: dict[str, Sequence[Any]] = {"input": inputs, "output": outputs, "gts": gts,
                                         "score": [float(s) for s in scores], "step": [step] * n}
    for key, values in extras.items():
        if key not in columns and len(values) == n:
            columns[key] = values
    return [{key: _plain(values[i]) for key, values in columns.items()} for i in range(n)]


def dump_generations(directory: str | Path, step: int, rows: list[dict]) -> Path:
    """Write `rows` to `<directory>/<step>.jsonl` atomically; returns its path."""
    return write_rows(rows, Path(directory) / f"{step}.jsonl")


def per_sample_extras(extras: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The reward function's extra outputs that have one value a sample, as one dict a sample (they ride on the
    batch's rows through filtering and concatenation until the step's dump)."""
    columns = {key: values for key, values in extras.items()
               if hasattr(values, "__len__") and not isinstance(values, (str, bytes, dict))
               and getattr(values, "ndim", 1) >= 1 and len(values) == n}
    return [{key: values[i] for key, values in columns.items()} for i in range(n)]
