"""`python -m tiller.trl GRPOConfig` prints how tiller treats every field of TRL's config class (a markdown table:
field, TRL's default, mapped / noop / refused, what tiller does); docs/trl.md holds the same tables."""

from __future__ import annotations

import sys

import tiller.trl
from tiller.trl.common import field_table
from tiller.trl.fields import FIELDS


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in FIELDS:
        print(f"usage: python -m tiller.trl CLASS   (CLASS: {', '.join(FIELDS)})", file=sys.stderr)
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
