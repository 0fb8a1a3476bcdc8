"""`tiller openrlhf JOB [FLAGS...]`: run an OpenRLHF command line on tiller.

    tiller openrlhf train_sft --pretrain ./tiny --dataset data.jsonl --input_key question --output_key answer
    tiller openrlhf deepspeed --module openrlhf.cli.train_dpo --pretrain ... --dry-run    # launcher stripped
    python -m tiller.openrlhf.train_ppo_ray --pretrain ./tiny --remote_rm_url reward.py ...

JOB is train_sft | train_rm | train_dpo | train_kto | train_ppo_ray (the tiller jobs sft, rm, dpo, kto, rl).
Flat 0.8.x flags, dotted 0.10+ flags (`--train.batch_size`) and the FSDP2 backend's `--fsdp.*` flags
(OpenRLHF's `automodel` branch) all work. `--dry-run` prints the resolved
tiller config, the equivalent `tiller JOB key=value ...` command and the notices, and exits 0 without loading
a model or data or creating a directory. `--help` after the job prints the flag table. Bare `key=value`
tokens are tiller overrides applied last (e.g. `trainer.device=cuda`).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from tiller.config import load_config, to_yaml
from tiller.config.jobs import DPOConfig, KTOConfig, RMConfig, SFTConfig, validate_job
from tiller.entry import run_main
from tiller.errors import ConfigError
from tiller.openrlhf.parse import JOBS, flag_index, options, parse_command, split_job
from tiller.openrlhf.table import HINT, MAPPED, REFUSED
from tiller.openrlhf.translate import Translation, translate

OWN_FLAGS = ("--dry-run", "--help", "-h")


def quote(value: Any) -> str:
    """A value as a Hydra override value (strings single-quoted, lists in brackets, None as null)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(quote(v) for v in value) + "]"
    text = str(value)
    if re.fullmatch(r"[A-Za-z_./][\w./-]*", text) and text.lower() not in ("true", "false", "null", "none"):
        return text
    if "${" in text:
        raise ConfigError(f"{text!r}: a value with '${{' is read as an interpolation by tiller's config; remove it")
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text).replace("'", "\\'")
    return f"'{text}'"


def override_list(tr: Translation, extra: list[str]) -> list[str]:
    return [f"{key}={quote(value)}" for key, value in tr.values.items()] + list(extra)


def schema_for(job: str):
    """(schema, validate) of a tiller job."""
    if job == "rl":
        return None, None
    return {"sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig, "kto": KTOConfig}[job], validate_job


def resolve(argv: list[str]):
    """(Command, Translation, tiller config) of an OpenRLHF command line: parsed, translated, validated."""
    cmd = parse_command(argv)
    tr = translate(cmd)
    schema, validate = schema_for(tr.job)
    cfg = load_config(override_list(tr, cmd.overrides), schema=schema, validate=validate)
    return cmd, tr, cfg


def flag_table(job: str) -> str:
    """The classification of every flag of `job` (flat, dotted and FSDP spellings), as `--help` prints it."""
    index = flag_index()
    rows: dict[str, list[str]] = {}
    for version in ("flat", "dotted", "fsdp"):
        try:
            opts = options(job, version)
        except ConfigError:
            continue
        for names, *_ in opts:
            rows.setdefault(index[names[0][2:]].name, []).append(names[0])
    counts = {MAPPED: 0, HINT: 0, REFUSED: 0}
    lines = []
    for name, spellings in rows.items():
        kind, text = index[name].for_job(job) if name in index else index[spellings[0][2:]].for_job(job)
        counts[kind] += 1
        lines.append(f"  {' | '.join(dict.fromkeys(spellings))}\n      {kind}: {text}")
    head = (f"tiller openrlhf {job}: OpenRLHF's flags and what tiller does with each "
            f"({counts[MAPPED]} mapped, {counts[HINT]} hints, {counts[REFUSED]} refused)\n"
            "  mapped: translated into tiller config keys; hint: accepted, one notice line; "
            "refused: exit 2 unless left at OpenRLHF's default\n")
    return head + "\n".join(lines)


def _usage() -> str:
    return (__doc__ or "") + "\njobs: " + ", ".join(JOBS)


def main(argv: list[str]) -> int:
    argv = list(argv)
    dry_run = "--dry-run" in argv
    wants_help = any(t in ("--help", "-h") for t in argv)
    argv = [t for t in argv if t not in OWN_FLAGS]
    if not argv or (wants_help and not any(_is_job(t) for t in argv)):
        print(_usage())
        return 0
    if wants_help:
        job, _, _ = split_job(argv)
        print(flag_table(job))
        return 0
    cmd, tr, cfg = resolve(argv)
    if cmd.launcher:
        many = tr.job != "rl" and cmd.launcher[0] in ("deepspeed", "torchrun")
        print(f"tiller openrlhf: launcher prefix stripped: {' '.join(cmd.launcher)}"
              + (" (this runs one process; for N: torchrun --nproc_per_node N -m tiller.cli openrlhf ...)"
                 if many else ""))
    for line in tr.notices:
        print(f"notice: {line}")
    if dry_run:
        print(f"# tiller {tr.job} (from OpenRLHF {cmd.job}, {cmd.version} flags)")
        print(to_yaml(cfg))
        print("# the same run as a tiller command line:")
        print(f"tiller {tr.job} " + " ".join(_shell(o) for o in override_list(tr, cmd.overrides)))
        return 0
    os.environ.update(tr.env)
    return run_job(tr.job, cfg)


def _is_job(token: str) -> bool:
    try:
        split_job([token])
        return True
    except ConfigError:
        return False


def _shell(token: str) -> str:
    import shlex

    return shlex.quote(token)


def run_job(job: str, cfg) -> int:
    """Run tiller's job on a resolved config."""
    if job == "rl":
        from tiller.trainer.rl import run  # import cost: only the chosen job's trainer (here the whole RL stack)

        metrics = run(cfg)
        print(f"done: {cfg.trainer.default_local_dir} ({metrics.get('wall_s', 0.0):.1f} s)")
        return 0
    if job == "sft":
        from tiller.trainer.sft import train_sft as train  # import cost: only the chosen job's trainer
    elif job == "rm":
        from tiller.trainer.rm import train_rm as train  # import cost: only the chosen job's trainer
    elif job == "dpo":
        from tiller.trainer.preference import train_dpo as train  # import cost: only the chosen job's trainer
    else:
        from tiller.trainer.preference import train_kto as train  # import cost: only the chosen job's trainer
    train(cfg)
    print(f"done: {cfg.trainer.default_local_dir}")
    return 0


def job_main(job: str):
    """`python -m tiller.openrlhf.<job>` entry point."""
    run_main(lambda argv: main([job, *argv]))


if __name__ == "__main__":
    run_main(main)
    sys.exit(0)
