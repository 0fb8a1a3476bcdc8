"""The command-line options every config-driven command shares (`--config`, Hydra's `--config-path/--config-name`,
`--preset`, `key=value` overrides): used by `tiller rl|sft|rm|dpo|kto|generate|eval|config`."""

from __future__ import annotations

import argparse
from pathlib import Path

from tiller.config.loader import PRESET_DIR


class _HydraConfigArg(argparse.Action):
    """Hydra's `--config-path DIR --config-name NAME` (as in verl's launch scripts) = `--config DIR/NAME.yaml`."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        path, name = getattr(namespace, "config_path", None), getattr(namespace, "config_name", None)
        if name is not None:
            stem = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
            namespace.config = str(Path(path or ".") / stem)


def add_config_args(parser: argparse.ArgumentParser, presets: bool = True) -> None:
    """The options every config-driven command shares (`presets`: the RL presets apply to this command)."""
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file with config values (verl's tree); its "
                        "Hydra `defaults:` list is followed (`ppo_trainer` = tiller's defaults)")
    parser.add_argument("--config-path", "-cp", dest="config_path", metavar="DIR", action=_HydraConfigArg,
                        help="Hydra style: the directory of --config-name")
    parser.add_argument("--config-name", "-cn", dest="config_name", metavar="NAME", action=_HydraConfigArg,
                        help="Hydra style: --config-path/NAME.yaml as --config")
    if presets:
        parser.add_argument(
            "--preset", help=f"built-in RL preset: {', '.join(sorted(p.stem for p in PRESET_DIR.glob('*.yaml')))}"
        )
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="Hydra overrides: key=value, +key=value (add), ++key=value (add or set), ~key (reset)")
