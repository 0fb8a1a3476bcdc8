"""`python -m tiller.trl GRPOConfig` prints how tiller treats every field of TRL's config class (a markdown table:
field, TRL's default, mapped / noop / refused, what tiller does); docs/trl.md holds the same tables. The dataclasses
TRL's scripts parse (ScriptArguments, GRPOScriptArguments, ModelConfig, DatasetMixtureConfig, ...) have theirs too.

`python -m tiller.trl COMMAND [TRL's flags]` (COMMAND: sft, dpo, kto, reward, grpo, rloo, distillation) is `tiller trl COMMAND`:
TRL's command line on tiller (`tiller.trl.cli`)."""

from __future__ import annotations

import sys

import tiller.trl
from tiller.entry import run_main
from tiller.trl.cli import COMMANDS
from tiller.trl.cli import main as cli_main
from tiller.trl.common import field_table
from tiller.trl.fields import FIELDS, SCRIPT_FIELDS


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        run_main(cli_main, argv)  # exits: 0, 2 for bad input (one line), 1 for the machine
    classes = [*FIELDS, *SCRIPT_FIELDS]
    if len(argv) != 1 or argv[0] not in classes:
        print(f"usage: python -m tiller.trl CLASS   (CLASS: {', '.join(classes)})\n"
              f"       python -m tiller.trl COMMAND [TRL's flags]   (COMMAND: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    try:
        cls = getattr(tiller.trl, argv[0])
    except ImportError:
        print(f"tiller.trl.{argv[0]} is not available yet", file=sys.stderr)
        return 2
    print(field_table(argv[0], cls.RULES), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
