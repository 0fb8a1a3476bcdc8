"""Datasets as TRL's trainers take them -> rows tiller reads: a `datasets.Dataset` (duck typed: `column_names` and
`to_list()` / iteration; `datasets` is never imported here), a list of dicts, or a path to a local data file
(.parquet / .jsonl / .json, read by `tiller.data.files`). Rows are written back with `write_rows_atomic`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from tiller.data.files import read_rows, write_rows
from tiller.errors import DataError


def to_dataset_rows(dataset: Any, where: str) -> list[dict]:
    """The rows of `dataset` as a list of dicts; `where` names the argument in errors (e.g. "train_dataset")."""
    if dataset is None:
        raise DataError(f"{where} is None: give a datasets.Dataset, a list of dicts or a local data file")
    if isinstance(dataset, (str, Path)):
        rows = read_rows(dataset)
    elif hasattr(dataset, "column_names") and callable(getattr(dataset, "to_list", None)):
        if isinstance(dataset.column_names, dict):  # a DatasetDict: one split must be chosen
            raise DataError(f"{where} is a DatasetDict with splits {sorted(dataset.column_names)}: pass one split, "
                            f"e.g. dataset['train']")
        rows = dataset.to_list()
    elif hasattr(dataset, "column_names") and hasattr(dataset, "__iter__") and not hasattr(dataset, "__len__"):
        raise DataError(f"{where} is an IterableDataset: tiller needs the whole dataset (a datasets.Dataset, "
                        "a list of dicts or a local file)")
    elif isinstance(dataset, (list, tuple)):
        rows = list(dataset)
    else:
        raise DataError(f"{where}: a {type(dataset).__name__} is not a dataset: give a datasets.Dataset, a list of "
                        "dicts or a path to a .parquet / .jsonl file")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{where}: row {i} is a {type(row).__name__}, not a dict of columns")
    if not rows:
        raise DataError(f"{where} is empty")
    return [dict(row) for row in rows]


def dataset_decoder(dataset: Any) -> Callable[[dict], dict] | None:
    """For a `datasets.Dataset` with decodable columns (images, audio): the row decoder its indexing applies
    (`features.decode_example`: an image entry `{"bytes", "path"}` -> a PIL image), else None. `to_dataset_rows`
    keeps such rows encoded (`to_list()`), so a row is decoded only when a reward function reads it, as TRL's
    data loader reads it."""
    features = getattr(dataset, "features", None)
    if not callable(getattr(features, "decode_example", None)):
        return None
    if not any(getattr(f, "decode", False) or getattr(getattr(f, "feature", None), "decode", False)
               for f in features.values()):
        return None
    return features.decode_example


def write_rows_atomic(rows: Sequence[dict], path: str | Path) -> Path:
    """Write rows to `.parquet` or `.jsonl` atomically (temp file then rename)."""
    return write_rows(rows, path)


def column(rows: list[dict], name: str, where: str) -> list[Any]:
    """The values of column `name`; a `DataError` naming `where` and the columns there are if a row lacks it."""
    for i, row in enumerate(rows):
        if name not in row:
            raise DataError(f"{where}: row {i} has no {name!r} column (columns: {', '.join(sorted(row))})")
    return [row[name] for row in rows]
