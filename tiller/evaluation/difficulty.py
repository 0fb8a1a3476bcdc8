"""`tiller data filter-difficulty`: Skywork-OR1's offline difficulty filtering of an RL prompt set.

    tiller data filter-difficulty --model DIR --data train.parquet --k 8 --keep 0.1:0.9 --out kept.parquet

Skywork-OR1 (He et al. 2025, arXiv 2505.22312, section 3.1 "data preparation": offline filtering) samples
several responses per problem with the model RL starts from and drops the problems it always solves (no
learning signal, pass rate 1) and those it never solves (pass rate 0): with group-relative advantages a
group whose responses all score the same has zero advantage and costs a rollout for nothing. What is kept
is the band of prompts the starting model solves sometimes. (Skywork's released 7B training data keep the problems
DeepSeek-R1-Distill-Qwen-7B solved 1 to 15 times in 16: `--k 16 --keep 0.0625:0.9375`; their data script
or1_scripts/data_preprocess/download_and_filter_data_7b.py.)

Here: k samples per prompt with the rollout engine (`actor_rollout_ref.rollout.name`, native by default,
`generate_batched` as `tiller generate` / `tiller eval` use it), sampled with the training rollout keys
(`rollout.temperature` 1.0 by default, as Skywork's sampling with the starting model; `rollout.top_p` ...),
`rollout.response_length` / `data.max_response_length` tokens each, seed `trainer.seed`; scored by the
same reward manager as `tiller eval` and training (`reward_model.*`, `custom_reward_function.*`), a sample
counting as solved when the scorer's `acc` (or, without one, its score) is > 0.5. The pass rate of a prompt
is solved / k; a prompt is kept when LO <= pass rate <= HI (`--keep LO:HI`, inclusive; the default 0.1:0.9
drops exactly the never-solved and all-solved prompts for any k <= 9).

Writes, atomically:
- `--out` (same format as `--data`: `.parquet` keeps the input's schema, `.jsonl` one object a line): the kept
  rows in input order, every input column plus `pass_rate` (float, replaced if the input had one);
- `<out stem>_pass_rates.png`: histogram of all prompts' pass rates with the kept band shaded;
- `<out stem>_summary.json`: counts (prompts, kept, never / all solved, below / above the band), the
  histogram as numbers, k, the band, the sampling, tokens and wall time.

Rows that `data.filter_overlong_prompts` drops before sampling are not scored and not kept (counted in
the summary's `num_unscored`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from tiller.config import load_config
from tiller.config.args import add_config_args
from tiller.data.files import atomic_write_text
from tiller.data.rl_dataset import build_rl_dataset, read_rows
from tiller.errors import ConfigError, DataError
from tiller.evaluation.evaluate import image_inputs, score_samples
from tiller.evaluation.runner import (
    decode,
    generate_batched,
    policy_from_config,
    sampling_from_rollout,
)
from tiller.rewards import build_reward_manager
from tiller.rewards.registry import check_ground_truths

PASS_RATE_COLUMN = "pass_rate"


def parse_band(text: str) -> tuple[float, float]:
    """`"LO:HI"` -> (lo, hi) with 0 <= lo <= hi <= 1; a ConfigError naming `--keep` otherwise."""
    parts = str(text).split(":")
    if len(parts) != 2:
        raise ConfigError(f"--keep {text!r}: give the band of pass rates to keep as LO:HI, e.g. --keep 0.1:0.9")
    try:
        lo, hi = float(parts[0]), float(parts[1])
    except ValueError:
        raise ConfigError(f"--keep {text!r}: LO and HI must be numbers, e.g. --keep 0.1:0.9") from None
    if not (0.0 <= lo <= 1.0 and 0.0 <= hi <= 1.0):
        raise ConfigError(f"--keep {text!r}: pass rates lie in [0, 1]; LO and HI must too")
    if lo > hi:
        raise ConfigError(f"--keep {text!r}: LO must be <= HI (did you mean --keep {parts[1]}:{parts[0]}?)")
    return lo, hi


def pass_rates(acc: np.ndarray, k: int) -> np.ndarray:
    """Per-prompt pass rate from per-sample correctness `acc[G * k]` (prompt i's samples at i*k .. i*k+k-1)."""
    acc = np.asarray(acc, dtype=np.float64).reshape(-1, k)
    return (acc > 0.5).sum(axis=1) / k


def in_band(rates: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Bool mask of the rates inside [lo, hi] (inclusive; a 1e-9 slack so 0.1 keeps a rate of 1/10)."""
    rates = np.asarray(rates, dtype=np.float64)
    return (rates >= lo - 1e-9) & (rates <= hi + 1e-9)


def summarize(rates: np.ndarray, keep: np.ndarray, k: int, lo: float, hi: float) -> dict:
    """Counts of the filter, and the histogram over the k + 1 possible pass rates."""
    rates = np.asarray(rates, dtype=np.float64)
    solved = np.rint(rates * k).astype(int)
    hist = np.bincount(solved, minlength=k + 1)
    return {
        "num_prompts": int(len(rates)), "num_kept": int(keep.sum()),
        "num_never_solved": int((solved == 0).sum()), "num_all_solved": int((solved == k).sum()),
        "num_below_band": int((rates < lo - 1e-9).sum()), "num_above_band": int((rates > hi + 1e-9).sum()),
        "pass_rate_mean": float(rates.mean()) if len(rates) else float("nan"),
        "pass_rate_mean_kept": float(rates[keep].mean()) if keep.any() else None,
        "histogram": {f"{c}/{k}": int(hist[c]) for c in range(k + 1)},
    }


def _row_index(uid: str) -> int:
    """The input row of a dataset item (`RLDataset` uids are `<file stem>-<row>`)."""
    return int(uid.rsplit("-", 1)[1])


def write_kept_rows(src: Path, out: Path, keep_rows: list[int], rates: list[float]) -> Path:
    """The input rows `keep_rows` (in order) with a `pass_rate` column, written atomically in the input's format."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if src.suffix.lower() == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(src).take(pa.array(keep_rows, type=pa.int64()))
        if PASS_RATE_COLUMN in table.column_names:
            table = table.drop([PASS_RATE_COLUMN])
        table = table.append_column(PASS_RATE_COLUMN, pa.array(rates, type=pa.float64()))
        pq.write_table(table, tmp)
    else:
        rows = read_rows(src)
        with open(tmp, "w", encoding="utf-8") as fh:
            for i, rate in zip(keep_rows, rates):
                fh.write(json.dumps({**rows[i], PASS_RATE_COLUMN: rate}, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return out


def plot_histogram(rates: np.ndarray, k: int, lo: float, hi: float, path: Path, title: str) -> Path:
    """Histogram of pass rates (one bar per possible value c/k), the kept band shaded; written atomically."""
    import matplotlib  # optional heavy dependency: only this command draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = (np.arange(k + 2) - 0.5) / k
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.axvspan(lo - 0.5 / k, hi + 0.5 / k, color="tab:green", alpha=0.12, label=f"kept band [{lo:g}, {hi:g}]")
    ax.hist(np.asarray(rates, dtype=np.float64), bins=edges, color="tab:blue", edgecolor="white")
    ax.set_xlabel(f"pass rate ({k} samples per prompt)")
    ax.set_ylabel("prompts")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper center", fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path


def filter_difficulty(cfg, data: str, out: str, *, k: int, band: tuple[float, float], batch_size: int = 64,
                      progress: bool = True) -> dict:
    """Sample k responses per prompt of `data`, score them, write the kept rows + PNG + summary; returns the summary."""
    src, dst = Path(data).expanduser(), Path(out).expanduser()
    if k < 1:
        raise ConfigError(f"--k must be >= 1 (samples per prompt), got {k}")
    if not src.is_file():
        raise DataError(f"--data {data}: file not found")
    if src.suffix.lower() not in (".parquet", ".jsonl"):
        raise DataError(f"--data {data}: use a .parquet or .jsonl file")
    if dst.suffix.lower() != src.suffix.lower():
        raise ConfigError(f"--out {out}: the kept rows are written in the input's format; name it *{src.suffix}")
    if cfg.actor_rollout_ref.rollout.multi_turn.enable or cfg.actor_rollout_ref.rollout.agent.path:
        raise ConfigError("tiller data filter-difficulty samples single-turn responses; multi-turn / agent rollouts "
                          "(actor_rollout_ref.rollout.multi_turn.enable, rollout.agent.path) are not supported")
    lo, hi = band
    start = time.time()
    policy = policy_from_config(cfg)
    rm = cfg.reward_model
    rules = not (cfg.custom_reward_function.path or rm.enable or rm.remote_url)
    ds = build_rl_dataset(cfg.data, policy.tokenizer, [str(src)], what="--data", require_ground_truth=rules,
                          processor=policy.processor)
    if rules:
        check_ground_truths(ds.items, "--data", rm.bad_ground_truth)
    items = ds.items
    r = cfg.actor_rollout_ref.rollout
    sampling = replace(sampling_from_rollout(r, r.response_length or cfg.data.max_response_length, cfg.trainer.seed),
                       n=k)
    gen = generate_batched(policy.engine, [it.prompt_ids for it in items], sampling, batch_size=batch_size,
                           progress=progress, desc="filter-difficulty", multi_modal=image_inputs(items))
    texts = [decode(policy.tokenizer, ids) for ids in gen.response_ids]
    reward_fn = build_reward_manager(cfg, policy.tokenizer)
    try:
        records = score_samples(reward_fn, items, texts, [len(ids) for ids in gen.response_ids], k)
    finally:
        if hasattr(reward_fn, "close"):
            reward_fn.close()
    rates = pass_rates(np.array([rec["acc"] for rec in records]), k)
    keep = in_band(rates, lo, hi)
    rows = [_row_index(it.uid) for it in items]
    write_kept_rows(src, dst, [rows[i] for i in np.flatnonzero(keep)], [float(x) for x in rates[keep]])
    stem = dst.name[: -len(dst.suffix)]
    png = plot_histogram(rates, k, lo, hi, dst.with_name(f"{stem}_pass_rates.png"),
                         f"{src.name}: {int(keep.sum())} of {len(rates)} prompts kept")
    summary = {
        **summarize(rates, keep, k, lo, hi),
        "num_unscored": ds.num_filtered,
        "k": k, "keep": [lo, hi], "model": cfg.actor_rollout_ref.model.path, "data": str(src), "out": str(dst),
        "plot": str(png), "summary": str(dst.with_name(f"{stem}_summary.json")),
        "sampling": {key: (list(v) if isinstance(v, tuple) else v) for key, v in asdict(sampling).items()},
        "num_tokens": gen.num_tokens, "wall_s": time.time() - start,
    }
    atomic_write_text(summary["summary"], json.dumps(summary, indent=2) + "\n")
    return summary


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiller data filter-difficulty", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="DIR", help="the starting model (HF model dir)")
    parser.add_argument("--data", required=True, metavar="FILE", help="prompt file (.parquet / .jsonl, verl schema)")
    parser.add_argument("--out", required=True, metavar="FILE", help="kept rows (same format as --data)")
    parser.add_argument("--k", default="8", help="samples per prompt (default 8)")
    parser.add_argument("--keep", default="0.1:0.9", metavar="LO:HI",
                        help="keep prompts with LO <= pass rate <= HI (default 0.1:0.9)")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per engine call (default 64)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_args(parser)
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_intermixed_args(argv)
    band = parse_band(args.keep)
    try:  # parsed here, not by argparse, so a bad value is one line naming the flag
        args.k = int(args.k)
    except ValueError:
        raise ConfigError(f"--k {args.k!r}: give a whole number of samples per prompt, e.g. --k 8") from None
    if args.k < 1:
        raise ConfigError(f"--k must be >= 1 (samples per prompt), got {args.k}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not Path(args.data).expanduser().is_file():
        raise DataError(f"--data {args.data}: file not found")
    cfg = load_config(list(args.overrides) + [f"actor_rollout_ref.model.path={args.model}"],
                      config_file=args.config, preset=args.preset)
    s = filter_difficulty(cfg, args.data, args.out, k=args.k, band=band, batch_size=args.batch_size,
                          progress=not args.no_progress)
    print(f"pass rates over {s['num_prompts']} prompts x {args.k} samples: "
          + ", ".join(f"{key}: {v}" for key, v in s["histogram"].items()))
    print(f"kept {s['num_kept']} of {s['num_prompts']} prompts with pass rate in [{band[0]:g}, {band[1]:g}] "
          f"(never solved {s['num_never_solved']}, all solved {s['num_all_solved']}) -> {s['out']}")
    print(f"plot: {s['plot']}; summary: {s['summary']}")
    return 0
