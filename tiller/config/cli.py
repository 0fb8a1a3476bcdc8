"""`tiller config show|explain|keys`: the resolved config, its batch arithmetic, and the state of every verl key.

    tiller config show [--config FILE | --config-path DIR --config-name NAME] [--preset NAME] [key=value ...]
    tiller config explain [same options as show]
    tiller config keys [--markdown]

`show` prints the resolved RL config as YAML (and, on stderr, the verl keys you set that have no effect in
tiller); `keys` lists every key with its state (honoured / no-op / refused) and why, `--markdown` as the
table committed in docs/verl-keys.md. `explain` prints what the batch sizes mean together (samples, mini-batches,
micro-batches per rank, steps) and a peak-memory estimate per rank read from the model's config.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tiller.config import edge
from tiller.config.args import add_config_args
from tiller.config.edge import report_noop_keys
from tiller.config.explain import explain
from tiller.config.loader import load_config, to_yaml


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tiller config", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="print the resolved RL config as YAML")
    add_config_args(show)
    add_config_args(sub.add_parser("explain", help="batch arithmetic and a peak-memory estimate per rank, before a run"))
    keys = sub.add_parser("keys", help="every RL key: honoured, no-op or refused, and why")
    keys.add_argument("--markdown", action="store_true", help="the table of docs/verl-keys.md")
    args = parser.parse_args(argv)
    if args.action == "keys":
        return _keys(args.markdown)
    cfg = load_config(args.overrides, config_file=args.config, preset=args.preset)
    report_noop_keys(cfg)
    if args.action == "explain":
        print(explain(cfg), end="")
        return 0
    print(to_yaml(cfg), end="")
    return 0


def _keys(markdown: bool) -> int:
    if markdown:
        print(edge.markdown(), end="")
        return 0
    states = edge.key_states()
    width = max(len(k.key) for k in states)
    for k in states:
        where = f" [read in {', '.join(k.readers)}]" if k.readers else ""
        print(f"{k.key.ljust(width)}  {k.state:<8}  {k.note}{where}")
    return 0
