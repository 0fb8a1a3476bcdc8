"""Parse an OpenRLHF command line exactly as OpenRLHF's argparse would, from `tiller.openrlhf.spec`.

`parse_command(argv)` strips a launcher prefix (`deepspeed --module openrlhf.cli.train_sft`, `ray job submit ...
-- python3 -m openrlhf.cli.train_ppo_ray`, `torchrun ... -m ...`), finds the job, picks the flat (0.8.x), dotted
(0.10+) or FSDP option set (a dotted option name anywhere means dotted; an `--fsdp.` one means the FSDP2 backend's
set, OpenRLHF's `automodel` branch, where `--fsdp.*` replaced `--ds.*`), and parses with `allow_abbrev=True` as
OpenRLHF does. Bare `key=value` tokens are tiller overrides applied after the translation.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Any

from tiller.errors import ConfigError
from tiller.openrlhf import spec
from tiller.openrlhf.table import TABLE, Flag

JOBS = ("train_sft", "train_rm", "train_dpo", "train_kto", "train_ppo_ray")
_JOB_TOKEN = re.compile(r"^(?:.*[/.])?(train_sft|train_rm|train_dpo|train_kto|train_ppo_ray)(?:\.py)?$")
_OVERRIDE = re.compile(r"^[+~]{0,2}[A-Za-z_][\w.]*(=|$)")
_TYPES = {"int": int, "float": float, "str": str, None: None}


def flag_index() -> dict[str, Flag]:
    """Option name (no dashes, flat or dotted) -> its table row."""
    out: dict[str, Flag] = {}
    for row in TABLE:
        for name in (row.name, *row.dotted):
            out[name] = row
    return out


@dataclass
class Command:
    """A parsed OpenRLHF command line."""

    job: str
    version: str  # "flat" | "dotted" | "fsdp"
    values: dict[str, Any]  # row name -> value (given or OpenRLHF's default)
    defaults: dict[str, Any]  # row name -> OpenRLHF's default
    spelled: dict[str, str]  # row name -> the option string of this version ("--train.batch_size")
    given: set[str]  # row names given on the command line
    overrides: list[str] = field(default_factory=list)  # tiller key=value tokens
    launcher: list[str] = field(default_factory=list)  # the stripped prefix


def options(job: str, version: str) -> list[tuple]:
    """OpenRLHF's option rows for `job` in `version` (flat | dotted | fsdp)."""
    table = {"flat": spec.FLAT, "dotted": spec.DOTTED, "fsdp": spec.FSDP}[version]
    if job not in table:
        raise ConfigError(f"OpenRLHF {spec.DOTTED_TAG} has no {job}; use its 0.8.x flat flags "
                          f"(--pretrain, --dataset, ...) for {job}")
    return table[job]


def split_job(argv: list[str]) -> tuple[str, list[str], list[str]]:
    """(job, launcher prefix, the job's own arguments)."""
    for i, token in enumerate(argv):
        m = _JOB_TOKEN.match(token)
        if m and not token.startswith("-"):
            return m.group(1), argv[:i], argv[i + 1:]
    raise ConfigError("no OpenRLHF job on the command line: give one of " + ", ".join(JOBS)
                      + " (or openrlhf.cli.<job>, as after `deepspeed --module` / `python3 -m`)")


def detect_version(args: list[str]) -> str:
    names = [t[2:].split("=", 1)[0] for t in args if t.startswith("--")]
    if any(n.startswith("fsdp.") for n in names):
        return "fsdp"
    return "dotted" if any("." in n for n in names) else "flat"


def _parser(job: str, version: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"tiller openrlhf {job}", allow_abbrev=True, add_help=False,
                                     exit_on_error=False)
    for names, dest, action, nargs, type_name, _default, choices in options(job, version):
        kw: dict[str, Any] = {"dest": names[0][2:], "default": argparse.SUPPRESS}
        if action == "StoreTrue":
            kw["action"] = "store_true"
        elif action == "StoreFalse":
            kw["action"] = "store_false"
        else:
            kw.update(type=_TYPES[type_name], nargs=nargs, choices=choices)
        parser.add_argument(*names, **kw)
    return parser


def parse_command(argv: list[str]) -> Command:
    """Parse `argv` (launcher prefix allowed) into a `Command`; ConfigError on an unknown or malformed flag."""
    job, launcher, rest = split_job(list(argv))
    flags, overrides = [], []
    for token in rest:
        (overrides if _OVERRIDE.match(token) and "=" in token and not token.startswith("-") else flags).append(token)
    version = detect_version(flags)
    if version == "dotted" and job == "train_kto":
        raise ConfigError("train_kto exists only with OpenRLHF's 0.8.x flat flags; a dotted flag was given")
    parser = _parser(job, version)
    try:
        ns, unknown = parser.parse_known_args(flags)
    except argparse.ArgumentError as err:
        raise ConfigError(f"{job}: {err}") from None
    if unknown and version == "fsdp" and any(t.startswith("--ds.") for t in unknown):
        raise ConfigError(f"{job}: the command line mixes --fsdp.* flags (OpenRLHF's FSDP2 backend) with --ds.* ones "
                          f"(its DeepSpeed backend: {' '.join(t for t in unknown if t.startswith('--ds.'))}); "
                          "OpenRLHF takes one backend's flags: use one")
    if unknown and version != "flat" and job in spec.FLAT:
        flat = {names[0] for names, *_ in spec.FLAT[job]}
        mixed = [t.split("=", 1)[0] for t in unknown if t.split("=", 1)[0] in flat]
        if mixed:
            raise ConfigError(f"{job}: the command line mixes dotted 0.10+ flags with flat 0.8.x ones "
                              f"({' '.join(mixed[:4])}); OpenRLHF takes one spelling: use one")
    if unknown:
        raise ConfigError(f"{job}: unrecognized OpenRLHF {version} argument(s): {' '.join(unknown)} "
                          f"(`tiller openrlhf {job} --help` lists them)")
    index = flag_index()
    values, defaults, spelled, given = {}, {}, {}, set()
    for names, dest, action, _n, _t, default, _c in options(job, version):
        row = index[names[0][2:]]
        if row.name in given:  # two options of one row (actor.optim / critic.optim): the given one wins
            continue
        if action == "StoreFalse":  # --muon.no_nesterov: its own row, True when given
            value = names[0][2:] in vars(ns)
            values[row.name], defaults[row.name] = value, False
        else:
            default = float(default) if default == "inf" else default
            if _t == "int" and isinstance(default, float) and default.is_integer():
                default = int(default)  # OpenRLHF writes some int defaults as 1e8
            value = vars(ns).get(names[0][2:], default)
            defaults[row.name] = default
            values[row.name] = value
        spelled[row.name] = names[0]
        if names[0][2:] in vars(ns):
            given.add(row.name)
    return Command(job, version, values, defaults, spelled, given, overrides, launcher)
