"""`tiller rl` and `python -m tiller.trainer.main_ppo`: RL training with verl's config keys.

    tiller rl [--config FILE.yaml] [--preset NAME] key=value ...
    python -m tiller.trainer.main_ppo algorithm.adv_estimator=grpo data.train_files=[a.parquet] ...

A verl command line ports by changing the entry point. With neither `actor_rollout_ref.model.path` nor
`data.train_files` given, this runs the built-in demo (`tiller demo`).
"""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    from tiller.config import load_config
    from tiller.config.cli import add_config_args

    parser = argparse.ArgumentParser(prog="tiller rl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    args = parser.parse_args(argv)
    cfg = load_config(args.overrides, config_file=args.config, preset=args.preset)
    if not cfg.actor_rollout_ref.model.path and not cfg.data.train_files:
        from tiller.trainer import demo

        print("tiller rl: no model and no data given: running the built-in demo (`tiller demo`)")
        return demo.main([])
    from tiller.trainer.rl import run

    metrics = run(cfg)
    val = {k: v for k, v in metrics.items() if k.startswith("val-core/")}
    for key, value in sorted(val.items()):
        print(f"{key}: {value:.4f}")
    print(f"done: {cfg.trainer.default_local_dir} ({metrics['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    from tiller.cli import run_main

    run_main(main)
