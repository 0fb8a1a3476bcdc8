"""`tiller data <dataset> --out DIR`: write a public dataset as verl-schema parquet files.

    tiller data gsm8k --out data/gsm8k [--src DIR_WITH_train.jsonl_AND_test.jsonl] [--max-rows N] [--tool]
        (without --src: openai/gsm8k through `datasets`, from the hub or its local cache)
    tiller data search-r1 --src DIR --out data/search_r1 [--retrieval-url URL] [--max-rows N]
        (DIR: a local copy of PeterJinGo/nq_hotpotqa_train; verl's search-tool layout and tool_config.yaml out)
    tiller data geo3k --src DIR --out data/geo3k [--max-rows N] [--tool]
        (DIR: a local copy of hiyouga/geometry3k, data/{train,test}-*.parquet; verl's multimodal schema out)
    tiller data arithmetic --out data/arith [--train N --test N --seed S]   (the demo task)
    tiller data reasoning-gym --task letter_counting --out data/lc [--train N --test N --format jsonl]
    tiller data filter-difficulty --model DIR --data train.parquet --k 8 --keep 0.1:0.9 --out kept.parquet
        (Skywork-OR1 offline difficulty filtering: keep the prompts the model solves sometimes;
        `tiller data filter-difficulty --help` for details)
"""

from __future__ import annotations

import argparse

from tiller.data.preprocess import geo3k, gsm8k, reasoning_gym, search_r1
from tiller.tasks import arithmetic


def main(argv: list[str]) -> int:
    if argv and argv[0] == "filter-difficulty":  # its own parser: config overrides mixed with its options
        from tiller.evaluation import difficulty  # import cost: the rollout engine and reward pipeline, loaded when used

        return difficulty.main(argv[1:])
    parser = argparse.ArgumentParser(prog="tiller data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="dataset", required=True)
    g = sub.add_parser("gsm8k", help="GSM8K -> train/test parquet (verl's gsm8k.py format)")
    g.add_argument("--out", required=True, help="output directory")
    g.add_argument("--src", default=None, help="dir with GSM8K train.jsonl and test.jsonl (default: load "
                                               "openai/gsm8k with the `datasets` package, hub or local cache)")
    g.add_argument("--max-rows", type=int, default=-1, help="keep only the first N rows of each split")
    g.add_argument("--tool", action="store_true", help="verl's multi-turn tool layout (gsm8k_multiturn_w_tool.py: "
                   "the calc_gsm8k_reward tool, its per-row tools_kwargs) and tool_config.yaml beside the parquet")
    q = sub.add_parser("search-r1", help="Search-R1 QA (a local PeterJinGo/nq_hotpotqa_train copy) -> verl's search-"
                                         "tool parquet (preprocess_search_r1_dataset.py) + tool_config.yaml")
    q.add_argument("--src", required=True, help="dir with train.parquet and test.parquet (or .jsonl)")
    q.add_argument("--out", required=True, help="output directory")
    q.add_argument("--max-rows", type=int, default=-1, help="keep only the first N rows of each split")
    q.add_argument("--retrieval-url", default=search_r1.DEFAULT_URL,
                   help="the retrieval server's /retrieve URL in tool_config.yaml (tiller retrieval-server)")
    v = sub.add_parser("geo3k", help="Geometry3K (a local hiyouga/geometry3k copy) -> train/test parquet with images "
                                     "(verl's geo3k.py format)")
    v.add_argument("--src", required=True, help="dir of the dataset (data/train-*.parquet, data/test-*.parquet)")
    v.add_argument("--out", required=True, help="output directory")
    v.add_argument("--max-rows", type=int, default=-1, help="keep only the first N rows of each split")
    v.add_argument("--tool", action="store_true", help="verl's multi-turn tool layout (geo3k_multiturn_w_tool.py: "
                   "the calc_geo3k_reward tool, its per-row tools_kwargs) and tool_config.yaml beside the parquet")
    a = sub.add_parser("arithmetic", help="the built-in demo task (tiller/arithmetic) -> train/test parquet")
    a.add_argument("--out", required=True)
    a.add_argument("--train", type=int, default=2000)
    a.add_argument("--test", type=int, default=256)
    a.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("reasoning-gym", help="a reasoning-gym task -> train/test (data_source reasoning_gym/<task>)")
    r.add_argument("--task", required=True, help="task name, e.g. letter_counting, basic_arithmetic, countdown")
    r.add_argument("--out", required=True)
    r.add_argument("--train", type=int, default=1000)
    r.add_argument("--test", type=int, default=200)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    sub.add_parser("filter-difficulty", add_help=False,
                   help="keep the prompts a model solves sometimes (Skywork-OR1 offline filtering); "
                        "see `tiller data filter-difficulty --help`")
    args = parser.parse_args(argv)
    if args.dataset == "reasoning-gym":
        paths = reasoning_gym.convert(args.task, args.out, n_train=args.train, n_test=args.test, seed=args.seed,
                                      fmt=args.format)
    elif args.dataset == "search-r1":
        paths = search_r1.convert(args.src, args.out, max_rows=args.max_rows, retrieval_url=args.retrieval_url)
    elif args.dataset == "geo3k":
        paths = geo3k.convert(args.src, args.out, max_rows=args.max_rows, tool=args.tool)
    elif args.dataset == "gsm8k":
        paths = gsm8k.convert(args.src, args.out, max_rows=args.max_rows, tool=args.tool)
    else:
        paths = arithmetic.write_task(args.out, n_train=args.train, n_test=args.test, seed=args.seed)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0
