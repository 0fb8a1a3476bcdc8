"""Geometry3K (Lu et al. 2021, "Inter-GPS") in verl's multimodal RL schema, as `verl/examples/data_preprocess/geo3k.py`.

Input: a local copy of the `hiyouga/geometry3k` dataset (what `datasets.load_dataset(DIR)` reads in verl's
script): parquet files per split, `DIR/data/train-*.parquet` and `DIR/data/test-*.parquet` as the hub lays them
out (or `DIR/train*.parquet`, `DIR/test*.parquet`), each row `images` (a list of `{"bytes", "path"}`), `problem`
(text with an `<image>` placeholder) and `answer`. Output rows, as verl writes them: `data_source`
`hiyouga/geometry3k`, one user message = the problem + verl's think / `\\boxed{}` instruction, `images` kept,
`ability` math, `reward_model.ground_truth` the answer, `extra_info` {split, index, answer, question}.
Every image is opened once while converting, so a broken one is an error naming the file and row here rather
than in the middle of a training run.

`tool=True` (`tiller data geo3k --tool`): verl's multi-turn layout (`geo3k_multiturn_w_tool.py`): a system message
asking for the `calc_geo3k_reward` tool, `extra_info.tools_kwargs` handing the answer to it, and `tool_config.yaml`
beside the parquet files (verl's `geo3k_tool_config.yaml`: `verl.tools.geo3k_tool.Geo3kTool`, which tiller carries).
"""

from __future__ import annotations

from pathlib import Path

from tiller.data.files import atomic_write_text
from tiller.data.rl_dataset import read_rows, write_rows
from tiller.errors import DataError
from tiller.models.vision import to_pil

DATA_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the final "
               r"answer. The reasoning process MUST BE enclosed within <think> </think> tags. "
               r"The final answer MUST BE put in \boxed{}.")
TOOL_SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
               "Reasoning step by step before any tool call. "
               "You should use the `calc_geo3k_reward` tool after step by step solving the question, "
               "before generate final answer at least once and refine your answer if necessary. ")
TOOL_CONFIG = """tools:
  - class_name: "verl.tools.geo3k_tool.Geo3kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_geo3k_reward"
        description: "A tool for calculating the reward of geo3k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the geo3k problem, must be a digits"
          required: ["answer"]
"""


def convert_rows(rows: list[dict], split: str, where: str = "geo3k", tool: bool = False) -> list[dict]:
    """geometry3k rows -> verl rows (`tool`: verl's multi-turn tool layout)."""
    out = []
    for i, row in enumerate(rows):
        missing = [k for k in ("images", "problem", "answer") if k not in row]
        if missing:
            raise DataError(f"{where} row {i}: missing {', '.join(missing)} (columns: {', '.join(row)})")
        images = list(row["images"] or [])
        for j, img in enumerate(images):
            to_pil(img, f"{where} row {i} images[{j}]")
        prompt = [{"role": "user", "content": f"{row['problem']} {INSTRUCTION}"}]
        extra = {"split": split, "index": i, "answer": row["answer"], "question": row["problem"]}
        if tool:
            prompt.insert(0, {"role": "system", "content": TOOL_SYSTEM})
            extra.update(need_tools_kwargs=True,
                         tools_kwargs={"calc_geo3k_reward": {"create_kwargs": {"ground_truth": row["answer"]}}})
        out.append({
            "data_source": DATA_SOURCE, "prompt": prompt, "images": [_entry(img) for img in images],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": row["answer"]}, "extra_info": extra,
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


def convert(src: str | Path, out_dir: str | Path, max_rows: int = -1, tool: bool = False) -> dict[str, Path]:
    """`src` (a local hiyouga/geometry3k copy) -> `out_dir/{train,test}.parquet` (`tool`: verl's multi-turn tool
    layout and `out_dir/tool_config.yaml`); returns the paths."""
    src, out_dir = Path(src).expanduser(), Path(out_dir).expanduser()
    if not src.is_dir():
        raise DataError(f"geo3k source dir not found: {src}")
    written = {}
    for split in ("train", "test"):
        rows = []
        for path in split_files(src, split):
            rows += convert_rows(read_rows(path), split, where=str(path), tool=tool)
            if 0 < max_rows <= len(rows):
                break
        if max_rows > 0:
            rows = rows[:max_rows]
        for i, row in enumerate(rows):
            row["extra_info"]["index"] = i
        written[split] = write_rows(rows, out_dir / f"{split}.parquet")
    if tool:
        written["tool_config"] = atomic_write_text(out_dir / "tool_config.yaml", TOOL_CONFIG)
    return written
