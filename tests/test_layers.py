"""tiller's import layering (docs/internals.md, "Layers"), read from the source with `ast`.

The packages stand on named floors (`FLOORS`, ground first). Every import of a tiller module points to the same
or a lower floor; a package's `cli.py` (a command-line face) stands on the top floor; packages (their `cli.py`
included) do not import each other in a cycle, and no module imports itself round a cycle of modules (imports
inside functions count: a lazy import is still an arrow); no module takes a private (`_name`) from another module.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "tiller"

# ground to top; keep in step with docs/internals.md
FLOORS = [
    ("ground", ("errors", "protocol", "hostinfo", "entry", "httpguard", "cache", "stand_ins", "__init__")),
    ("math, config and data", ("algos", "config", "data", "models", "tracking")),
    ("rewards and rollout", ("rewards", "rollout", "tasks")),
    ("workers", ("distributed", "workers")),
    ("drivers and the server", ("trainer", "evaluation", "serve")),
    ("command lines", ("openrlhf", "trl", "cli", "env_cli", "data_cli")),
]
LAYER = {name: i for i, (_, names) in enumerate(FLOORS) for name in names}
TOP = len(FLOORS) - 1

# module cycles not yet broken, each with why: {frozenset of modules: reason}
KNOWN_MODULE_CYCLES: dict = {}


def _floor(i: int) -> str:
    return f"floor {i + 1} ({FLOORS[i][0]})"


def _unit(path: Path) -> tuple[str, int]:
    """(package, layer) of a source file: `tiller/<package>/...` or a top-level module `tiller/<module>.py`."""
    rel = path.relative_to(PKG)
    name = rel.parts[0].removesuffix(".py")
    assert name in LAYER, f"{rel}: package {name!r} has no floor in tests/test_layers.py (and docs/internals.md)"
    return name, TOP if rel.name == "cli.py" else LAYER[name]


def _imports():
    """(file, line, imported module, imported names) for every `import tiller...` / `from tiller... import`."""
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tiller."):
                yield path, node.lineno, node.module, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("tiller."):
                        yield path, node.lineno, alias.name, []


def test_imports_point_down():
    upward = []
    for path, line, module, _ in _imports():
        src, src_layer = _unit(path)
        dst = module.split(".")[1]
        dst_layer = TOP if module.endswith(".cli") else LAYER.get(dst, TOP)
        if dst != src and dst_layer > src_layer:
            upward.append(f"{path.relative_to(PKG.parent)}:{line} imports {module} "
                          f"({_floor(dst_layer)} above {_floor(src_layer)})")
    assert not upward, "imports of a higher floor:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _arrows(graph: dict[str, set[str]], comp: list[str], where: dict) -> str:
    return "; ".join(f"{a} -> {b} ({where[a, b]})" for a in comp for b in sorted(graph[a]) if b in comp)


def test_no_cycles_between_packages():
    graph, where = defaultdict(set), {}
    for path, line, module, _ in _imports():
        src, _ = _unit(path)
        dst = module.split(".")[1]
        if dst != src:
            graph[src].add(dst)
            where.setdefault((src, dst), f"{path.relative_to(PKG.parent)}:{line}")
    cycles = [_arrows(graph, comp, where) for comp in _cycles(graph)]
    assert not cycles, "package import cycles:\n" + "\n".join(cycles)


def _module_of(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _target(module: str, name: str, known: set[str]) -> str:
    """`from module import name`: the submodule `module.name` when there is one, else `module`."""
    return f"{module}.{name}" if f"{module}.{name}" in known else module


def test_no_cycles_between_modules():
    """No module reaches itself by following imports (at module top or inside functions). A package's
    `__init__.py` that only hands names on is a module like any other here: importing it imports what it names."""
    known = {_module_of(p) for p in PKG.rglob("*.py")}
    graph, where = defaultdict(set), {}
    for path, line, module, names in _imports():
        src = _module_of(path)
        for dst in {_target(module, n, known) for n in names} or {module}:
            if dst != src and dst in known:
                graph[src].add(dst)
                where.setdefault((src, dst), f"{path.relative_to(PKG.parent)}:{line}")
    comps = _cycles(graph)
    cycles = [_arrows(graph, comp, where) for comp in comps if frozenset(comp) not in KNOWN_MODULE_CYCLES]
    assert not cycles, "module import cycles:\n" + "\n".join(cycles)
    gone = [sorted(c) for c in KNOWN_MODULE_CYCLES if list(sorted(c)) not in comps]
    assert not gone, f"broken cycles still listed in KNOWN_MODULE_CYCLES: {gone} (take them out)"


def test_the_cycle_tests_can_fail(tmp_path, monkeypatch):
    """A cycle planted between two packages (by a lazy import) and one inside a package are both caught."""
    import shutil

    import pytest

    fake = tmp_path / "tiller"
    shutil.copytree(PKG, fake, ignore=shutil.ignore_patterns("__pycache__"))
    (fake / "errors.py").write_text((fake / "errors.py").read_text()
                                    + "\n\ndef planted():\n    from tiller.cache import x\n    return x\n")
    (fake / "cache.py").write_text((fake / "cache.py").read_text() + "\n\nfrom tiller.errors import UserError\n")
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    with pytest.raises(AssertionError, match=r"cache -> errors .*errors -> cache"):
        test_no_cycles_between_packages()
    with pytest.raises(AssertionError, match=r"tiller.cache -> tiller.errors .*tiller.errors -> tiller.cache"):
        test_no_cycles_between_modules()


def test_no_private_names_across_modules():
    """A `_name` is its module's own: another module (in any package) that needs it gets a public name."""
    taken = []
    for path, line, module, names in _imports():
        taken += [f"{path.relative_to(PKG.parent)}:{line} {module}.{n}" for n in names
                  if n.startswith("_") and not n.startswith("__")]
    assert not taken, "private names imported from another module:\n" + "\n".join(taken)


def test_the_test_can_fail(tmp_path, monkeypatch):
    """An upward import planted in a copy of a low module is caught."""
    import shutil

    fake = tmp_path / "tiller"
    shutil.copytree(PKG, fake, ignore=shutil.ignore_patterns("__pycache__"))
    (fake / "algos" / "planted.py").write_text("from tiller.trainer.rl import RLTrainer\n")
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    try:
        test_imports_point_down()
    except AssertionError as err:
        assert "algos/planted.py:1 imports tiller.trainer.rl (floor 5 (drivers and the server) above floor 2" \
            in str(err)
    else:
        raise AssertionError("the planted upward import was not reported")


REASONS = ("import cost", "optional dependency", "cycle")


def _function_level_imports(pkg: Path):
    """(file, line, source lines) of every tiller import inside a function body."""
    for path in sorted(pkg.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text, str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                is_tiller = (isinstance(node, ast.ImportFrom) and node.level == 0
                             and (node.module or "").split(".")[0] == "tiller") or \
                            (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tiller" for a in node.names))
                if is_tiller:
                    yield path, node.lineno, lines


def test_function_level_imports_name_their_reason():
    """tiller's own modules are imported at module top, where readers and tools see the dependency graph; an
    import inside a function carries a comment (on its line or the line above) naming why: import cost, an
    optional dependency behind it, or a cycle."""
    silent = []
    for path, line, lines in _function_level_imports(PKG):
        said = lines[line - 1] + " " + (lines[line - 2].strip() if lines[line - 2].strip().startswith("#") else "")
        if "#" not in said or not any(r in said.lower() for r in REASONS):
            silent.append(f"{path.relative_to(PKG.parent)}:{line}: {lines[line - 1].strip()}")
    assert not silent, "function-level imports of tiller modules without a reason:\n" + "\n".join(silent)


def test_the_reason_test_can_fail(tmp_path, monkeypatch):
    fake = tmp_path / "tiller"
    (fake / "algos").mkdir(parents=True)
    (fake / "algos" / "planted.py").write_text(
        "def f():\n    from tiller.errors import UserError\n    return UserError\n\n\n"
        "def g():\n    # import cost: the whole RL stack\n    from tiller.trainer import rl\n    return rl\n")
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    with __import__("pytest").raises(AssertionError, match=r"planted.py:2: from tiller.errors") as err:
        test_function_level_imports_name_their_reason()
    assert "planted.py:8" not in str(err.value)


def test_no_function_shadows_a_module_level_tiller_import():
    """A function that binds a name the module imports from tiller (and reads it) reads its own local: a module-top
    import hoisted from inside such a function would silently change what the name means there."""
    clashes = []
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        imported = {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom)
                    and (node.module or "").split(".")[0] == "tiller" for a in node.names}
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs
            bound = {a.arg for a in args} | {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                                             and isinstance(n.ctx, ast.Store)}
            read = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            clashes += [f"{path.relative_to(PKG.parent)}:{fn.lineno} {fn.name}() binds {name}"
                        for name in sorted(bound & imported & read)]
    assert not clashes, "local names shadowing module-level tiller imports:\n" + "\n".join(clashes)
