"""`tiller generate`: n sampled responses per prompt, written next to the input rows (verl's
`main_generation`: the input table plus a `responses` column).

    tiller generate --data prompts.parquet --out gens.jsonl actor_rollout_ref.model.path=DIR \\
        actor_rollout_ref.rollout.n=4 actor_rollout_ref.rollout.temperature=0.7 data.max_response_length=256

Input: `.parquet` / `.jsonl` rows with a `data.prompt_key` column (default `prompt`) holding a string or a
list of chat messages (verl's schema works as is; `data_source` is not needed); with a vision-language model, rows
with images (`data.image_key`, verl's image parquet) are generated with their pixels. Without `--data`,
`data.val_files` (then `data.train_files`) are read. Sampling comes from `actor_rollout_ref.rollout.*`
(n, temperature, top_p, top_k, min_p, do_sample, stop, ignore_eos, name = engine, dtype); the response length
from `rollout.response_length` or `data.max_response_length`; the seed from `trainer.seed` (batch j uses
seed + j, so a run is reproducible for a fixed `--batch-size`).

Output (`.jsonl` or `.parquet` by suffix, written atomically): every input column, plus `prompt_text` (the
rendered prompt), `responses` (n strings), `finish_reasons` and `response_lengths` (tokens).
"""

from __future__ import annotations

import argparse
import time

from tiller.config import load_config
from tiller.config.args import add_config_args
from tiller.data.files import check_jsonl_rows
from tiller.data.rl_dataset import write_rows
from tiller.errors import ConfigError
from tiller.evaluation.runner import (
    decode,
    generate_batched,
    load_prompt_rows,
    policy_from_config,
    sampling_from_rollout,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiller generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", action="append", default=[], metavar="FILE",
                        help="prompt file (.parquet / .jsonl); repeat for several (default: data.val_files)")
    parser.add_argument("--out", required=True, metavar="FILE", help="output .jsonl or .parquet")
    parser.add_argument("--model", metavar="DIR", help="shortcut for actor_rollout_ref.model.path=DIR")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per engine call (default 64)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_args(parser)
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_intermixed_args(argv)
    overrides = list(args.overrides) + ([f"actor_rollout_ref.model.path={args.model}"] if args.model else [])
    cfg = load_config(overrides, config_file=args.config, preset=args.preset)
    if not args.out.endswith((".jsonl", ".parquet")):
        raise ConfigError(f"--out {args.out}: use a .jsonl or .parquet file name")
    files = args.data or list(cfg.data.val_files) or list(cfg.data.train_files)
    policy = policy_from_config(cfg)
    d = cfg.data
    rows, prompt_ids, images = load_prompt_rows(files, policy.tokenizer, prompt_key=d.prompt_key,
                                                max_prompt_length=cfg.actor_rollout_ref.rollout.prompt_length
                                                or d.max_prompt_length, truncation=d.truncation,
                                                apply_chat_template=d.apply_chat_template, max_samples=d.max_samples,
                                                chat_template_kwargs=dict(d.apply_chat_template_kwargs),
                                                processor=policy.processor, image_key=d.image_key)
    if args.out.endswith(".jsonl"):  # (before any generating)
        check_jsonl_rows(rows, args.out)
    r = cfg.actor_rollout_ref.rollout
    sampling = sampling_from_rollout(r, r.response_length or d.max_response_length, cfg.trainer.seed)
    start = time.time()
    out = generate_batched(policy.engine, prompt_ids, sampling, batch_size=args.batch_size,
                           progress=not args.no_progress, multi_modal=images)
    wall = time.time() - start
    n = sampling.n
    for i, row in enumerate(rows):
        ids = out.response_ids[i * n:(i + 1) * n]
        row["responses"] = [decode(policy.tokenizer, r_ids) for r_ids in ids]
        row["finish_reasons"] = list(out.finish_reason[i * n:(i + 1) * n])
        row["response_lengths"] = [len(r_ids) for r_ids in ids]
    path = write_rows(rows, args.out)
    print(f"wrote {len(rows)} prompts x {n} responses to {path} "
          f"({out.num_tokens} tokens, {wall:.1f} s, {out.num_tokens / max(wall, 1e-9):.0f} tok/s)")
    return 0


if __name__ == "__main__":
    from tiller.entry import run_main

    run_main(main)
