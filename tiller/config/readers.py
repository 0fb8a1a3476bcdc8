"""Which config keys the package reads: a static scan of tiller's source for attribute reads of the config.

`config_reads(schema)` parses every module of the `tiller` package (never imports it) and follows config
objects through the code: `cfg.actor_rollout_ref.actor.ppo_epochs` is a read of that key, and so is
`a.ppo_epochs` after `a = self.actor_cfg` and `self.actor_cfg = config.actor_rollout_ref.actor`. It tracks

- roots: parameters or attributes named `cfg` / `config` (outside the SFT / RM / DPO job modules, whose
  `cfg` is a job config), and anything annotated with a schema class (`r: RolloutConfig`);
- aliases: `x = <section>`, `self.x = <section>` (per class, to a fixed point), `a if c else b`, `a or b`,
  and loops over literal tuples (`for name, section in (("a", cfg.a), ("b", cfg.b))`);
- calls: a section passed to a function or method of the package binds that parameter (by the callee's
  name, over the whole package, to a fixed point); `getattr(section, "name")` is a read.

Handing a whole section to `asdict` / `to_dict` (logging, checkpoints) reads no key.

Reads inside `tiller/config/` (the schema, validation, this edge) do not count: checking a key is not
honouring it. The scan over-approximates where names collide and misses reads through strings; the edge
registry (`tiller.config.edge`) declares what it cannot see, and the schema-walk test keeps both honest.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import typing
from collections import defaultdict
from pathlib import Path

from tiller.config.schema import RLConfig

PACKAGE_DIR = Path(__file__).resolve().parents[1]
# modules whose `cfg` / `config` is an SFT / RM / DPO / KTO job config, not an RLConfig
JOB_MODULES = ("trainer/sft.py", "trainer/rm.py", "trainer/preference.py", "trainer/loop.py", "trainer/spin.py",
               "data/sft.py", "data/preference.py")
ROOT_NAMES = ("cfg", "config")

Paths = frozenset  # a set of dotted section paths ("" = the root)


def schema_sections(schema: type) -> tuple[dict[str, type], dict[str, set[str]], set[str]]:
    """(section path -> class, class name -> section paths, every key path) of a dataclass tree."""
    sections: dict[str, type] = {"": schema}
    by_class: dict[str, set[str]] = defaultdict(set)
    keys: set[str] = set()
    by_class[schema.__name__].add("")

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            path = prefix + f.name
            keys.add(path)
            tp = hints[f.name]
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            inner = args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp
            if dataclasses.is_dataclass(inner):
                sections[path] = inner
                by_class[inner.__name__].add(path)
                walk(inner, path + ".")

    walk(schema, "")
    return sections, by_class, keys


class _Scanner:
    """One pass over a module: evaluates expressions to section paths, records reads and call bindings."""

    def __init__(self, rel: str, tree: ast.Module, index: "_Index"):
        self.rel, self.tree, self.ix = rel, tree, index
        self.roots_by_name = rel not in JOB_MODULES

    # --------------------------------------------------------------------------- evaluation
    def child(self, base: Paths, attr: str) -> Paths:
        out = set()
        for p in base:
            path = f"{p}.{attr}" if p else attr
            if path in self.ix.keys:
                out.add(path)
        return frozenset(out)

    def eval(self, node: ast.AST, env: dict[str, Paths], cls_env: dict[str, Paths] | None) -> Paths:
        if isinstance(node, ast.Name):
            return env.get(node.id, frozenset())
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and cls_env is not None:
                found = cls_env.get(node.attr, frozenset())
                if not found and self.roots_by_name and node.attr in ROOT_NAMES:
                    found = frozenset({""})
                return found
            base = self.eval(node.value, env, cls_env)
            paths = self.child(base, node.attr)
            for p in paths:
                self.ix.read(p, self.rel, node.lineno)
            return paths
        if isinstance(node, ast.IfExp):
            self.eval(node.test, env, cls_env)
            return self.eval(node.body, env, cls_env) | self.eval(node.orelse, env, cls_env)
        if isinstance(node, ast.BoolOp):
            out: Paths = frozenset()
            for v in node.values:
                out |= self.eval(v, env, cls_env)
            return out
        if isinstance(node, ast.Call):
            return self.call(node, env, cls_env)
        self.expr(node, env, cls_env)  # any other expression: the config reads inside it
        return frozenset()

    def call(self, node: ast.Call, env, cls_env) -> Paths:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        args = [self.eval(a, env, cls_env) for a in node.args]
        kwargs = {k.arg: self.eval(k.value, env, cls_env) for k in node.keywords if k.arg}
        if isinstance(func, ast.Attribute):
            self.eval(func.value, env, cls_env)
        if name == "getattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            paths = self.child(args[0], node.args[1].value)
            for p in paths:
                self.ix.read(p, self.rel, node.lineno)
            return paths
        if name:
            for i, paths in enumerate(args):
                if paths:
                    self.ix.bind(name, i, None, paths)
            for k, paths in kwargs.items():
                if paths:
                    self.ix.bind(name, None, k, paths)
        return frozenset()

    # ----------------------------------------------------------------------------- bodies
    def params(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, env: dict[str, Paths], method: bool,
               owner: str | None = None) -> None:
        # a constructor is called by its class's name: `Worker(config=cfg)` binds `Worker.__init__`
        name = owner if owner and fn.name == "__init__" else fn.name
        args = fn.args.posonlyargs + fn.args.args
        positional = args[1:] if method else args
        for i, a in enumerate(positional):
            env[a.arg] = env.get(a.arg, frozenset()) | self.param_paths(name, a, i)
        for a in fn.args.kwonlyargs:
            env[a.arg] = env.get(a.arg, frozenset()) | self.param_paths(name, a, None)

    def param_paths(self, fn_name: str, a: ast.arg, position: int | None) -> Paths:
        out = set(self.ix.bound(fn_name, position, a.arg))
        if a.annotation is not None:
            for n in ast.walk(a.annotation):
                ident = n.id if isinstance(n, ast.Name) else n.value if isinstance(n, ast.Constant) else None
                if isinstance(ident, str):
                    out |= self.ix.by_class.get(ident.split(".")[-1], set())
        if self.roots_by_name and a.arg in ROOT_NAMES:
            out.add("")
        return frozenset(out)

    def body(self, stmts: list[ast.stmt], env: dict[str, Paths], cls_env: dict[str, Paths] | None) -> None:
        for stmt in stmts:
            self.stmt(stmt, env, cls_env)

    def stmt(self, stmt: ast.stmt, env, cls_env) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner = dict(env)
            self.params(stmt, inner, method=False)
            self.body(stmt.body, inner, cls_env)
            return
        if isinstance(stmt, ast.ClassDef):
            return  # nested classes: scanned by the module pass
        if isinstance(stmt, ast.For) and isinstance(stmt.iter, (ast.Tuple, ast.List)):
            # for a, s in ((x, cfg.sec1), (y, cfg.sec2)): `s` is either section
            for elt in stmt.iter.elts:
                if isinstance(stmt.target, ast.Tuple) and isinstance(elt, ast.Tuple) \
                        and len(elt.elts) == len(stmt.target.elts):
                    for t, v in zip(stmt.target.elts, elt.elts):
                        self.assign(t, self.eval(v, env, cls_env), env, cls_env)
                else:
                    self.assign(stmt.target, self.eval(elt, env, cls_env), env, cls_env)
            self.body(stmt.body + stmt.orelse, env, cls_env)
            return
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            value = stmt.value
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if value is None:
                return
            if isinstance(value, ast.Tuple):
                vals = [self.eval(v, env, cls_env) for v in value.elts]
                for t in targets:
                    if isinstance(t, ast.Tuple) and len(t.elts) == len(vals):
                        for tt, v in zip(t.elts, vals):
                            self.assign(tt, v, env, cls_env)
                return
            paths = self.eval(value, env, cls_env)
            for t in targets:
                self.assign(t, paths, env, cls_env)
            return
        for child in ast.iter_child_nodes(stmt):
            if isinstance(child, ast.stmt):
                self.stmt(child, env, cls_env)
            elif isinstance(child, ast.expr):
                self.expr(child, env, cls_env)
            elif isinstance(child, (ast.excepthandler, ast.withitem, ast.match_case)):
                for sub in ast.iter_child_nodes(child):
                    if isinstance(sub, ast.stmt):
                        self.stmt(sub, env, cls_env)
                    elif isinstance(sub, ast.expr):
                        self.expr(sub, env, cls_env)
            elif isinstance(child, ast.comprehension):
                self.expr(child.iter, env, cls_env)

    def expr(self, node: ast.expr, env, cls_env) -> None:
        """Evaluate every outermost config expression inside `node` (records the reads)."""
        if isinstance(node, (ast.Attribute, ast.Call, ast.Name, ast.IfExp, ast.BoolOp)):
            self.eval(node, env, cls_env)
            if isinstance(node, ast.Call):
                return
            if isinstance(node, (ast.IfExp, ast.BoolOp)):
                for sub in ast.iter_child_nodes(node):
                    if isinstance(sub, ast.expr):
                        self.expr(sub, env, cls_env)
            return
        if isinstance(node, ast.Lambda):
            return
        for sub in ast.iter_child_nodes(node):
            if isinstance(sub, ast.expr):
                self.expr(sub, env, cls_env)
            elif isinstance(sub, ast.comprehension):
                self.expr(sub.iter, env, cls_env)
                for cond in sub.ifs:
                    self.expr(cond, env, cls_env)

    def assign(self, target: ast.expr, paths: Paths, env, cls_env) -> None:
        if not paths:
            return
        if isinstance(target, ast.Name):
            env[target.id] = env.get(target.id, frozenset()) | paths
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                and target.value.id == "self" and cls_env is not None:
            if not paths <= cls_env.get(target.attr, frozenset()):
                cls_env[target.attr] = cls_env.get(target.attr, frozenset()) | paths
                self.ix.changed = True

    def run(self) -> None:
        module_env: dict[str, Paths] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ClassDef):
                cls_env = self.ix.class_env[(self.rel, node.name)]
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        env = dict(module_env)
                        is_static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in item.decorator_list)
                        self.params(item, env, method=not is_static, owner=node.name)
                        self.body(item.body, env, cls_env)
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                env = dict(module_env)
                self.params(node, env, method=False)
                self.body(node.body, env, None)


class _Index:
    def __init__(self, schema: type):
        self.sections, by_class, self.keys = schema_sections(schema)
        self.by_class = dict(by_class)
        self.reads: dict[str, set[str]] = defaultdict(set)  # key -> {"rel/path.py:line"}
        self.bindings: dict[tuple[str, int | None, str | None], frozenset] = {}
        self.class_env: dict[tuple[str, str], dict[str, Paths]] = defaultdict(dict)
        self.changed = False

    def read(self, path: str, rel: str, line: int) -> None:
        self.reads[path].add(f"{rel}:{line}")

    def bind(self, fn: str, position: int | None, keyword: str | None, paths: Paths) -> None:
        k = (fn, position, keyword)
        old = self.bindings.get(k, frozenset())
        if not paths <= old:
            self.bindings[k] = old | paths
            self.changed = True

    def bound(self, fn: str, position: int | None, name: str) -> Paths:
        out = self.bindings.get((fn, None, name), frozenset())
        if position is not None:
            out |= self.bindings.get((fn, position, None), frozenset())
        return out


def _modules(package_dir: Path) -> list[tuple[str, ast.Module]]:
    out = []
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir).as_posix()
        if rel.startswith("config/"):
            continue
        out.append((rel, ast.parse(path.read_text(), filename=str(path))))
    return out


def config_reads(schema: type | None = None, package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """Every key of `schema` (default `RLConfig`) read somewhere in the package -> its read sites
    (`"workers/actor.py:123"`, relative to the package). Sections count as read when a key below is.
    Scanned once per process (about a second)."""
    if schema is None:
        schema = RLConfig
    return {k: set(v) for k, v in _scan(schema, Path(package_dir)).items()}


@functools.lru_cache(maxsize=4)
def _scan(schema: type, package_dir: Path) -> dict[str, frozenset[str]]:
    ix = _Index(schema)
    modules = _modules(package_dir)
    for _ in range(8):  # fixed point of aliases and call bindings (converges in 2-3 passes)
        ix.changed = False
        ix.reads.clear()
        for rel, tree in modules:
            _Scanner(rel, tree, ix).run()
        if not ix.changed:
            break
    return {k: frozenset(v) for k, v in ix.reads.items()}


__all__ = ["config_reads", "JOB_MODULES"]
