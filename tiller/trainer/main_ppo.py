"""`tiller rl` and `python -m tiller.trainer.main_ppo`: RL training with verl's config keys.

    tiller rl [--config FILE.yaml] [--preset NAME] key=value ...
    python -m tiller.trainer.main_ppo algorithm.adv_estimator=grpo data.train_files=[a.parquet] ...

A verl command line ports by changing the entry point (Hydra's `--config-path` / `--config-name` work
too). `tiller rl` with no arguments at all runs the built-in demo (`tiller demo`); with arguments it needs
`actor_rollout_ref.model.path`.
"""

from __future__ import annotations

import argparse

from tiller.config import load_config
from tiller.config.args import add_config_args
from tiller.errors import ConfigError
from tiller.trainer import demo
from tiller.trainer.rl import run


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tiller rl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    args = parser.parse_args(argv)
    if not argv:
        print("tiller rl: no arguments: running the built-in demo (`tiller demo`)")
        return demo.main([])
    cfg = load_config(args.overrides, config_file=args.config, preset=args.preset)
    if not cfg.actor_rollout_ref.model.path:
        raise ConfigError("actor_rollout_ref.model.path is not set: give the policy's Hugging Face model dir "
                          "(or run `tiller demo`, or `tiller rl` with no arguments, for the built-in demo)")
    metrics = run(cfg)
    val = {k: v for k, v in metrics.items() if k.startswith("val-core/")}
    for key, value in sorted(val.items()):
        print(f"{key}: {value:.4f}")
    print(f"done: {cfg.trainer.default_local_dir} ({metrics['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    from tiller.entry import run_main

    run_main(main)
