"""GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems") in verl's RL schema.

Follows `verl/examples/data_preprocess/gsm8k.py`: the prompt is the question followed by the instruction
"Let's think step by step and output the final answer after \"####\".", the ground truth is the text after
`####` in the reference solution (commas removed), `data_source` is `openai/gsm8k`, `ability` is `math`.
Input: the original `{train,test}.jsonl` files with `question` / `answer` fields (`--src DIR`), or, with no
source dir, the `openai/gsm8k` dataset (config `main`) through `datasets.load_dataset`, which reads the local
Hugging Face cache when the hub is unreachable.

`tool=True` (`tiller data gsm8k --tool`) writes verl's multi-turn layout instead
(`verl/examples/data_preprocess/gsm8k_multiturn_w_tool.py`): a system message asking for the `calc_gsm8k_reward`
tool, the question with verl's instruction, and `extra_info.tools_kwargs` handing each row's ground truth to the
tool (`create_kwargs`), plus `tool_config.yaml` beside the parquet files (verl's `gsm8k_tool_config.yaml`, naming
`verl.tools.gsm8k_tool.Gsm8kTool`, which tiller carries: `tiller.rollout.verl_tools.Gsm8kTool`).
"""

from __future__ import annotations

import re
from pathlib import Path

from tiller.data.files import atomic_write_text
from tiller.data.rl_dataset import read_rows, write_rows
from tiller.errors import DataError


DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
HUB_NAME, HUB_CONFIG = "openai/gsm8k", "main"
# verl's gsm8k_multiturn_w_tool.py
TOOL_INSTRUCTION = "Let's think step by step and output the final answer after `####`."
TOOL_SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
               "Reasoning step by step before any tool call. "
               "You should use the `calc_gsm8k_reward` tool after step by step solving the question, "
               "before generate final answer at least once and refine your answer if necessary. "
               "Put your final answer in the format of `#### <answer>`.")
# verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml
TOOL_CONFIG = """tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""
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


def convert_rows(rows: list[dict], split: str, where: str = "gsm8k", tool: bool = False) -> list[dict]:
    """GSM8K rows -> verl rows (data_source, prompt, ability, reward_model, extra_info); `tool`: verl's multi-turn
    tool layout (see the module docstring)."""
    out = []
    for i, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise DataError(f"{where} row {i}: needs 'question' and 'answer' fields (got {', '.join(row)})")
        try:
            solution = extract_solution(row["answer"])
        except ValueError as err:
            raise DataError(f"{where} row {i}: {err}") from err
        extra = {"split": split, "index": i, "answer": row["answer"], "question": row["question"]}
        prompt = [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}]
        if tool:
            prompt = [{"role": "system", "content": TOOL_SYSTEM},
                      {"role": "user", "content": f"{row['question']} {TOOL_INSTRUCTION}"}]
            extra.update(need_tools_kwargs=True,
                         tools_kwargs={"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}})
        out.append({"data_source": DATA_SOURCE, "prompt": prompt, "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": solution}, "extra_info": extra})
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


def convert(src: str | Path | None, out_dir: str | Path, max_rows: int = -1, tool: bool = False) -> dict[str, Path]:
    """Convert `src/{train,test}.jsonl` (or .parquet), or with `src=None` the `openai/gsm8k` dataset, to
    `out_dir/{train,test}.parquet` (`tool`: verl's multi-turn tool layout and `out_dir/tool_config.yaml`); returns
    the paths."""
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
        written[split] = write_rows(convert_rows(rows, split, where=where, tool=tool), out_dir / f"{split}.parquet")
    if tool:
        written["tool_config"] = atomic_write_text(out_dir / "tool_config.yaml", TOOL_CONFIG)
    return written
