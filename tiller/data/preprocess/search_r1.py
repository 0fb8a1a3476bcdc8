"""Search-R1's question answering (Jin et al. 2025, "Search-R1") in verl's multi-turn search-tool layout, as
`verl/examples/data_preprocess/preprocess_search_r1_dataset.py` writes it.

Input: a local copy of `PeterJinGo/nq_hotpotqa_train` (`DIR/train.parquet`, `DIR/test.parquet`; .jsonl works too):
rows with `question`, `golden_answers` (or `reward_model.ground_truth`), `data_source` (`nq`, `hotpotqa`, ...).
Output rows as verl's script: a system message ("You are a helpful and harmless assistant.") and Search-R1's
instruction + the question as the user message, `data_source` `searchR1_<source>` (scored by
`tiller.rewards.scorers.search_r1`), `reward_model.ground_truth` `{"target": [golden answers]}`, and
`extra_info.tools_kwargs.search.create_kwargs` {ground_truth, question, data_source}; plus `tool_config.yaml`
beside them (verl's `search_tool_config.yaml`: `verl.tools.search_tool.SearchTool` at `retrieval_url`).
"""

from __future__ import annotations

from pathlib import Path

from tiller.data.files import atomic_write_text
from tiller.data.rl_dataset import read_rows, write_rows
from tiller.errors import DataError

SYSTEM = "You are a helpful and harmless assistant."
INSTRUCTION = ("Answer the given question. You must conduct reasoning inside <think> and </think> "
               "first every time you get new information. After reasoning, if you find you lack "
               "some knowledge, you can call a search engine by <tool_call> query </tool_call> "
               "and it will return the top searched results between <tool_response> and "
               "</tool_response>. You can search as many times as your want. If you find no "
               "further external knowledge needed, you can directly provide the answer inside "
               "<answer> and </answer>, without detailed illustrations. For example, "
               "<answer> Beijing </answer>. Question: ")
DEFAULT_URL = "http://127.0.0.1:8000/retrieve"


def tool_config(retrieval_url: str = DEFAULT_URL) -> str:
    """verl's `examples/sglang_multiturn/config/tool_config/search_tool_config.yaml`, at `retrieval_url`."""
    return f"""tools:
  - class_name: verl.tools.search_tool.SearchTool
    config:
      retrieval_service_url: {retrieval_url}
      num_workers: 120
      rate_limit: 120
      timeout: 30
      type: native
    tool_schema:
      type: function
      function:
        name: search
        description: Searches the web for relevant information based on the given query.
        parameters:
          type: object
          properties:
            query_list:
              type: array
              item:
                type: string
              description: A list of fully-formed semantic queries. The tool will return search results for each query.
          required:
            - query_list
"""


def convert_rows(rows: list[dict], split: str, where: str = "search-r1") -> list[dict]:
    """Search-R1 rows -> verl rows (see the module docstring)."""
    out = []
    for i, row in enumerate(rows):
        question = row.get("question")
        if not isinstance(question, str) or not question.strip():
            raise DataError(f"{where} row {i}: needs a 'question' string")
        reward_model = row.get("reward_model")
        if isinstance(reward_model, dict) and "ground_truth" in reward_model:
            ground_truth = reward_model["ground_truth"]
        else:
            ground_truth = {"target": list(row.get("golden_answers") or [])}
            reward_model = {"style": "rule", "ground_truth": ground_truth}
        target = ground_truth.get("target") if isinstance(ground_truth, dict) else None
        if target is None or len(target) == 0:
            raise DataError(f"{where} row {i}: no golden answers ('golden_answers' or reward_model.ground_truth."
                            "target)")
        source = "searchR1_" + str(row.get("data_source", ""))
        out.append({
            "data_source": source,
            "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": INSTRUCTION + question}],
            "ability": row.get("ability"),
            "reward_model": reward_model,
            "extra_info": {"index": i, "need_tools_kwargs": True, "question": question, "split": split,
                           "tools_kwargs": {"search": {"create_kwargs": {
                               "ground_truth": ground_truth, "question": question, "data_source": source}}}},
        })
    return out


def convert(src: str | Path, out_dir: str | Path, max_rows: int = -1,
            retrieval_url: str = DEFAULT_URL) -> dict[str, Path]:
    """`src/{train,test}.parquet` (or .jsonl) -> `out_dir/{train,test}.parquet` + `out_dir/tool_config.yaml`."""
    src, out_dir = Path(src).expanduser(), Path(out_dir).expanduser()
    if not src.is_dir():
        raise DataError(f"search-r1 source dir not found: {src}")
    written = {}
    for split in ("train", "test"):
        path = next((c for c in (src / f"{split}.parquet", src / f"{split}.jsonl") if c.exists()), None)
        if path is None:
            raise DataError(f"search-r1: no {split}.parquet or {split}.jsonl in {src}")
        rows = read_rows(path)
        rows = rows[:max_rows] if max_rows > 0 else rows
        written[split] = write_rows(convert_rows(rows, split, where=str(path)), out_dir / f"{split}.parquet")
    written["tool_config"] = atomic_write_text(out_dir / "tool_config.yaml", tool_config(retrieval_url))
    return written
