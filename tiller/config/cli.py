"""`tiller config show [--config FILE] [--preset NAME] [key=value ...]`: print the resolved config."""

from __future__ import annotations

import argparse

from tiller.config.loader import PRESET_DIR, load_config, to_yaml


def add_config_args(parser: argparse.ArgumentParser, presets: bool = True) -> None:
    """The options every config-driven command shares (`presets`: the RL presets apply to this command)."""
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file with config values (verl's tree)")
    if presets:
        parser.add_argument(
            "--preset", help=f"built-in RL preset: {', '.join(sorted(p.stem for p in PRESET_DIR.glob('*.yaml')))}"
        )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.train_batch_size=64")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tiller config", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="print the resolved RL config as YAML")
    add_config_args(show)
    args = parser.parse_args(argv)
    cfg = load_config(args.overrides, config_file=args.config, preset=args.preset)
    print(to_yaml(cfg), end="")
    return 0
