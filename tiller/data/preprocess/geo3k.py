"""Geometry3K (Lu et al. 2021, "Inter-GPS") in verl's multimodal RL schema, as `verl/examples/data_preprocess/geo3k.py`.

Input: a local copy of the `hiyouga/geometry3k` dataset (what `datasets.load_dataset(DIR)` reads in verl's
script): parquet files per split, `DIR/data/train-*.parquet` and `DIR/data/test-*.parquet` as the hub lays them
out (or `DIR/train*.parquet`, `DIR/test*.parquet`), each row `images` (a list of `{"bytes", "path"}`), `problem`
(text with an `<image>` placeholder) and `answer`. Output rows, as verl writes them: `data_source`
`hiyouga/geometry3k`, one user message = the problem + verl's think / `\\boxed{}` instruction, `images` kept,
`ability` math, `reward_model.ground_truth` the answer, `extra_info` {split, index, answer, question}.
Every image is opened once while converting, so a broken one is an error naming the file and row here rather
than in the middle of a training run.
"""

from __future__ import annotations

from pathlib import Path

from tiller.data.rl_dataset import read_rows, write_rows
from tiller.errors import DataError
from tiller.models.vision import to_pil

DATA_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the final "
               r"answer. The reasoning process MUST BE enclosed within <think> </think> tags. "
               r"The final answer MUST BE put in \boxed{}.")


def convert_rows(rows: list[dict], split: str, where: str = "geo3k") -> list[dict]:
    """geometry3k rows -> verl rows."""
    out = []
    for i, row in enumerate(rows):
        missing = [k for k in ("images", "problem", "answer") if k not in row]
        if missing:
            raise DataError(f"{where} row {i}: missing {', '.join(missing)} (columns: {', '.join(row)})")
        images = list(row["images"] or [])
        for j, img in enumerate(images):
            to_pil(img, f"{where} row {i} images[{j}]")
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{row['problem']} {INSTRUCTION}"}],
            "images": [_entry(img) for img in images],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": row["answer"]},
            "extra_info": {"split": split, "index": i, "answer": row["answer"], "question": row["problem"]},
        })
    return out


def _entry(img) -> dict:
    """verl's image entry: {"bytes": ..., "path": ...} (bytes inline, so the parquet is self-contained)."""
    if isinstance(img, dict):
        data = img.get("bytes")
        if data is None and img.get("path"):
            data = Path(img["path"]).expanduser().read_bytes()
        return {"bytes": data, "path": img.get("path")}
    if isinstance(img, (bytes, bytearray)):
        return {"bytes": bytes(img), "path": None}
    return {"bytes": Path(str(img)).expanduser().read_bytes(), "path": str(img)}


def split_files(src: Path, split: str) -> list[Path]:
    """The parquet files of `split` under `src` (hub layout `data/<split>-*.parquet`, or `<split>*.parquet`)."""
    found = sorted(src.glob(f"data/{split}-*.parquet")) or sorted(src.glob(f"{split}*.parquet"))
    if not found:
        raise DataError(f"geo3k: no {split} parquet under {src} (expected data/{split}-*.parquet as in "
                        "hiyouga/geometry3k, or {split}.parquet)")
    return found


def convert(src: str | Path, out_dir: str | Path, max_rows: int = -1) -> dict[str, Path]:
    """`src` (a local hiyouga/geometry3k copy) -> `out_dir/{train,test}.parquet`; returns the paths."""
    src, out_dir = Path(src).expanduser(), Path(out_dir).expanduser()
    if not src.is_dir():
        raise DataError(f"geo3k source dir not found: {src}")
    written = {}
    for split in ("train", "test"):
        rows = []
        for path in split_files(src, split):
            rows += convert_rows(read_rows(path), split, where=str(path))
            if 0 < max_rows <= len(rows):
                break
        if max_rows > 0:
            rows = rows[:max_rows]
        for i, row in enumerate(rows):
            row["extra_info"]["index"] = i
        written[split] = write_rows(rows, out_dir / f"{split}.parquet")
    return written
