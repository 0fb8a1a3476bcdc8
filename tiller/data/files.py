"""Data files: rows of `.parquet` / `.jsonl` / `.json` files read and written, with one error per problem naming the
file (and line or row). The one reader of every command (rl, sft, rm, dpo, kto, eval, generate, data
filter-difficulty)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from tiller.errors import DataError


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a `.parquet` or `.jsonl` / `.json` file as dicts; a `DataError` names the file on any problem."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data file not found: {p}")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        return read_parquet(p)
    if suffix in (".jsonl", ".json"):
        rows = []
        try:
            with open(p, encoding="utf-8") as fh:
                text = fh.read()
        except UnicodeDecodeError as err:
            line = p.read_bytes()[:err.start].count(b"\n") + 1
            raise DataError(f"{p}:{line}: not UTF-8 text (byte {err.start}); save the file as UTF-8") from None
        if suffix == ".json" and text.lstrip().startswith("["):
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as err:
                raise DataError(f"{p}: invalid JSON: {err}") from err
        else:
            for lineno, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"{p}:{lineno}: invalid JSON line: {err.msg}") from err
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
        if bad is not None:
            raise DataError(f"{p}: row {bad} is not a JSON object")
        return rows
    raise DataError(f"{p}: unsupported data file type {suffix!r}; use .parquet or .jsonl")


PARQUET_MAGIC = b"PAR1"  # a parquet file starts and ends with these 4 bytes


def parquet_problem(path: Path) -> str | None:
    """What makes `path` not a readable parquet file, judged from its size and its first and last bytes (an empty
    file, another format under a .parquet name, a cut-off copy); None when it looks like parquet."""
    size = path.stat().st_size
    if size == 0:
        return "the file is empty (0 bytes): write the data again"
    with open(path, "rb") as fh:
        head = fh.read(4)
        fh.seek(max(size - 4, 0))
        tail = fh.read(4)
    if head != PARQUET_MAGIC:
        kind = " (it looks like JSON: name it .jsonl)" if head[:1] in (b"{", b"[") else ""
        return f"not a parquet file: it does not start with the parquet marker PAR1 (starts with {head!r}){kind}"
    if tail != PARQUET_MAGIC or size < 12:
        return f"the parquet file is cut short ({size} bytes, no footer): copy or write it again"
    return None


def read_parquet(path: str | Path) -> list[dict]:
    """Rows of a parquet file; a `DataError` names the file and what is wrong with it (the one parquet reader of every
    command: rl, sft, rm, dpo, kto, eval, generate, data filter-difficulty)."""
    import pyarrow.parquet as pq

    p = Path(path).expanduser()
    problem = parquet_problem(p)
    if problem:
        raise DataError(f"{p}: {problem}")
    try:
        return pq.read_table(p).to_pylist()
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a corrupt file
        raise DataError(f"{p}: not a readable parquet file ({type(err).__name__}: {str(err)[:200]})") from None


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` via a temp file and `os.replace`."""
    import os

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, p)
    return p


def write_rows(rows: Sequence[dict], path: str | Path) -> Path:
    """Write rows to `.parquet` or `.jsonl` atomically (temp file then rename)."""
    import os

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    if p.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), tmp)
    else:
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                for i, r in enumerate(rows):
                    fh.write(json.dumps(r, ensure_ascii=False) + "\n")
        except TypeError:  # bytes (an image column), or another object JSON has no form for
            tmp.unlink(missing_ok=True)
            check_jsonl_rows([r], p, first=i)
            raise
    os.replace(tmp, p)
    return p


def check_jsonl_rows(rows: Sequence[dict], path: str | Path, first: int = 0) -> None:
    """A DataError naming `path`, the row and its fields when a row holds a value JSON cannot write (an image
    column's bytes): such rows go to a .parquet file."""
    for i, row in enumerate(rows, first):
        bad = [k for k, v in row.items() if not _json_ok(v)]
        if bad:
            raise DataError(f"{path}: row {i} field {', '.join(map(repr, bad))} cannot be written as JSON (binary "
                            "data, e.g. an image column's bytes); write a .parquet file instead")


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False
