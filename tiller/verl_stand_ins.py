"""Stand-ins for verl's modules while a user's verl-facing file imports (tools, agent loops, reward managers).

`installed(modules)` puts the given module objects into `sys.modules` for the time of the block (so `from verl...
import X` in the user's file finds tiller's X) and takes them out again afterwards, unless verl itself is installed or
already imported: a real verl is never shadowed. Each module is also set as its parent's attribute when the parent is
among them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from typing import Iterator


def verl_installed() -> bool:
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
def installed(modules: dict[str, types.ModuleType]) -> Iterator[bool]:
    """The stand-ins in `sys.modules` inside the block (yields False, and installs nothing, with a real verl)."""
    if verl_installed() or "verl" in sys.modules:
        yield False
        return
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent in modules:
            setattr(modules[parent], child, module)
    saved = {n: sys.modules.get(n) for n in modules}
    sys.modules.update(modules)
    try:
        yield True
    finally:
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = module
