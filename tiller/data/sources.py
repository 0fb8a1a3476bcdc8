"""Data sources as OpenRLHF names them: files, dataset dirs or hub names, blended with sampling probabilities.

`load_sources(sources, split, probs=None, seed=42, max_per_source=-1) -> [(where, row), ...]`:
- a source is a local `.parquet` / `.jsonl` / `.json` file (read by `tiller.data.files.read_rows`; a file is
  one split, read whole), or a dataset dir / a dataset name, read with `datasets.load_dataset(name)` (offline it
  reads the local Hugging Face cache) and then `split` (OpenRLHF's `--dataset_split`); `name@subdir` gives
  `data_dir` as OpenRLHF does. Without `datasets` installed, or when the dataset cannot be loaded, one
  `DataError` names the dataset and how to export it to a file;
- `max_per_source` rows are kept from each source (OpenRLHF's `max_count`), before blending (the readers pass
  their `max_samples`, which also caps the blend);
- no `probs`: the sources are concatenated in order; with `probs` they are interleaved as
  `datasets.interleave_datasets(..., probabilities=probs, seed=seed, stopping_strategy="all_exhausted")` does
  (OpenRLHF's blend): a source is drawn with `numpy.random.default_rng(seed).choice` in blocks of 1000, each
  source restarts when exhausted, and the blend stops once every source has been exhausted at least once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tiller.data.files import read_rows
from tiller.errors import ConfigError, DataError

FILE_SUFFIXES = (".parquet", ".jsonl", ".json")


def _is_file_source(source: str) -> bool:
    p = Path(source).expanduser()
    return p.suffix.lower() in FILE_SUFFIXES or p.is_file()


def read_source(source: str, split: str = "train") -> list[dict]:
    """Rows of one source (see the module docstring)."""
    if _is_file_source(source):
        return read_rows(source)
    name, _, data_dir = source.partition("@")
    export = (f"export it to a file where it loads: python -c \"import datasets; datasets.load_dataset("
              f"'{name}', split='{split}').to_json('data.jsonl')\" and pass data.jsonl")
    try:
        import datasets  # optional: only a dataset given by name or dir needs it
    except ImportError:
        raise DataError(f"{source}: not a local .parquet / .jsonl file, and reading a dataset by name needs the "
                        f"`datasets` package (pip install datasets); or {export}") from None
    try:
        if Path(name).is_dir() and not data_dir:
            try:
                data = datasets.load_from_disk(name)
            except Exception:  # noqa: BLE001 - not a save_to_disk dir: read its files
                data = datasets.load_dataset(name)
        else:
            data = datasets.load_dataset(name, data_dir=data_dir or None)
    except Exception as err:  # noqa: BLE001 - hub / cache / format errors of every kind
        raise DataError(f"dataset {name!r} could not be loaded ({type(err).__name__}: {str(err)[:200]}); {export}") \
            from None
    if isinstance(data, dict) or hasattr(data, "keys"):
        if split not in data:
            raise DataError(f"dataset {name!r} has no split {split!r} (splits: {', '.join(data.keys())})")
        data = data[split]
    return [dict(row) for row in data]


def interleave_indices(lengths: Sequence[int], probs: Sequence[float], seed: int) -> list[tuple[int, int]]:
    """(source, row) pairs of an all-exhausted probabilistic interleave (HF datasets' algorithm).

    default_rng(0) draws sources 1, 0, 0, ...: row 0 of source 1 (now exhausted), rows 0 and 1 of source 0 (now
    exhausted too): every source has run out once, so the blend stops.

    >>> interleave_indices([2, 1], [0.5, 0.5], seed=0)
    [(1, 0), (0, 0), (0, 1)]
    """
    probs = np.asarray(probs, dtype=np.float64)
    if len(probs) != len(lengths) or (probs < 0).any() or not np.isclose(probs.sum(), 1.0):
        raise ConfigError(f"sampling probabilities {list(probs)} must be one per source, >= 0, summing to 1")
    exhausted = np.array([p == 0 or n == 0 for p, n in zip(probs, lengths)])
    current = [0] * len(lengths)
    out: list[tuple[int, int]] = []
    rng = np.random.default_rng(seed)
    while not exhausted.all():
        for source in rng.choice(len(lengths), size=1000, p=probs):
            if exhausted.all():
                break
            source = int(source)
            out.append((source, current[source]))
            current[source] += 1
            if current[source] >= lengths[source]:
                exhausted[source], current[source] = True, 0
    return out


def load_sources(sources: Sequence[str], split: str = "train", probs: Sequence[float] | None = None, seed: int = 42,
                 max_per_source: int = -1) -> list[tuple[str, dict]]:
    """[(where, row)] of the blended sources (see the module docstring); `where` = "<source> row <i>"."""
    if not sources:
        raise ConfigError("no data sources given")
    per_source = []
    for source in sources:
        rows = read_source(str(source), split)
        if max_per_source > 0:
            rows = rows[:max_per_source]
        per_source.append(rows)
    if probs is None:
        return [(f"{src} row {i}", row) for src, rows in zip(sources, per_source) for i, row in enumerate(rows)]
    if len(probs) != len(sources):
        raise ConfigError(f"{len(probs)} sampling probabilities for {len(sources)} sources ({', '.join(sources)})")
    picks = interleave_indices([len(r) for r in per_source], probs, seed)
    return [(f"{sources[s]} row {i}", per_source[s][i]) for s, i in picks]


def apply_template(template: Any, prompt: str, what: str = "data.input_template") -> str:
    """OpenRLHF's `input_template.format(prompt)`; a template without `{}` is an error."""
    if "{}" not in template:
        raise ConfigError(f"{what} must contain '{{}}' where the prompt goes, got {template!r}")
    return template.replace("{}", prompt, 1) if template.count("{}") == 1 else template.format(prompt)
