"""Stand-in modules while a user's file written for another library imports (verl tools, agent loops and reward
managers; OpenRLHF agent files).

`installed(modules)` puts the given module objects into `sys.modules` for the time of the block (so `from verl...
import X` in the user's file finds tiller's X) and takes them out again afterwards; each module is also set as its
parent's attribute when the parent is among them. `skip=True` (the real library is importable: it is never
shadowed) installs nothing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from typing import Iterator


def verl_installed() -> bool:
    """verl itself is importable, or already imported (its stand-ins then stay out)."""
    if "verl" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("verl") is not None
    except (ImportError, ValueError):
        return False


def package(name: str) -> types.ModuleType:
    """An empty stand-in package (importable children)."""
    module = types.ModuleType(name)
    module.__path__ = []
    return module


@contextlib.contextmanager
def installed(modules: dict[str, types.ModuleType], skip: bool = False) -> Iterator[None]:
    """The stand-ins in `sys.modules` inside the block (nothing installed with `skip`)."""
    if skip:
        yield
        return
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent in modules:
            setattr(modules[parent], child, module)
    saved = {n: sys.modules.get(n) for n in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = module
