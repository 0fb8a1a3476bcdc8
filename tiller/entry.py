"""`run_main`: the `python -m tiller.x` entry helper, with the `tiller` command's error handling.

It sits in the lowest layer so any module can offer a `python -m` entry without importing the command line
(`tiller.cli`), which is the top layer.
"""

from __future__ import annotations

import sys

from tiller.errors import UserError, describe_os_error


def run_main(func, argv: list[str] | None = None) -> None:
    """Entry for `python -m tiller.x` modules: same error handling as the `tiller` script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = func(argv)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except OSError as err:  # the machine, not the input: one line, status 1
        print(f"error: {describe_os_error(err)}", file=sys.stderr)
        sys.exit(1)
    sys.exit(int(code or 0))
