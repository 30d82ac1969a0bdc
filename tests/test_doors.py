# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Every lazy package door says its API three ways, and they must agree.

A door (``__init__.py`` that calls ``lazy_exports``) keeps one literal table ``_EXPORTS``: public name ->
``".module:attr"``, which the runtime ``__getattr__`` (PEP 562) imports on first access. Type checkers and IDEs cannot
run that, so the door also carries (as ``vllm/__init__.py`` does) an ``if TYPE_CHECKING:`` block importing exactly
those names from exactly those modules, and a literal ``__all__`` (ruff's RUF022 keeps it sorted) of the table plus the names the door binds
eagerly (``__version__``, ...). This test reads the doors' source (it imports nothing) and, on a mismatch, prints
the mirror to paste. That every ``".module:attr"`` exists is then mypy's job (tests/test_typecheck.py): it checks
the TYPE_CHECKING imports, which this test holds equal to the table.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
DOORS = sorted(
    p for p in REPO.glob("packages/*/src/vllm_npu/**/__init__.py") if "lazy_exports(" in p.read_text(encoding="utf-8")
)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _bound_names(stmt: ast.stmt) -> list[str]:
    """Names a top-level statement binds in the module namespace."""
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return [a.asname or a.name.split(".")[0] for a in stmt.names]
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [stmt.name]
    targets: list[ast.expr] = []
    if isinstance(stmt, ast.Assign):
        targets = list(stmt.targets)
    elif isinstance(stmt, ast.AnnAssign):
        targets = [stmt.target]
    names: list[str] = []
    for target in targets:
        elts = target.elts if isinstance(target, ast.Tuple) else [target]
        names += [e.id for e in elts if isinstance(e, ast.Name)]
    return names


class Door:
    """What one door's source declares."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.exports: dict[str, str] | None = None
        self.mirror: dict[str, str] = {}
        self.all: list[str] | None = None
        self.all_is_literal = False
        self.has_type_checking = False
        self.getattr_outside_else = False
        self.eager: set[str] = set()
        for stmt in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
                self.has_type_checking = True
                for node in stmt.body:
                    if isinstance(node, ast.ImportFrom):
                        module = "." * node.level + (node.module or "")
                        for alias in node.names:
                            self.mirror[alias.asname or alias.name] = f"{module}:{alias.name}"
                continue  # the else branch is the runtime half (__getattr__, __dir__): not public names
            names = _bound_names(stmt)
            if "__getattr__" in names:
                self.getattr_outside_else = True
            if isinstance(stmt, ast.Assign | ast.AnnAssign) and names == ["_EXPORTS"]:
                assert stmt.value is not None
                self.exports = ast.literal_eval(stmt.value)
            elif isinstance(stmt, ast.Assign) and names == ["__all__"]:
                if isinstance(stmt.value, ast.List | ast.Tuple):
                    items = [e.value for e in stmt.value.elts if isinstance(e, ast.Constant)]
                    self.all_is_literal = len(items) == len(stmt.value.elts) and all(isinstance(i, str) for i in items)
                    self.all = items if self.all_is_literal else None
            else:
                self.eager |= {n for n in names if not n.startswith("_") or n == "__version__"}
        self.eager -= {"annotations", "TYPE_CHECKING"}  # `from __future__`/`typing` plumbing, not API

    def expected_all(self) -> list[str]:
        """The table's names plus the eagerly bound public ones, each once."""
        return sorted([*(self.exports or {}), *self.eager])

    def render_mirror(self) -> str:
        """The TYPE_CHECKING block that mirrors ``_EXPORTS`` (ruff then sorts and wraps it)."""
        by_module: dict[str, list[str]] = {}
        for name, target in (self.exports or {}).items():
            module, _, attr = target.partition(":")
            by_module.setdefault(module, []).append(attr if attr == name else f"{attr} as {name}")
        lines = [f"    from {module} import {', '.join(sorted(names))}" for module, names in sorted(by_module.items())]
        return "if TYPE_CHECKING:\n" + "\n".join(lines)


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_the_doors_are_found() -> None:
    """The eight package doors plus the lazy sub-package doors (a glob that matched nothing would pass vacuously)."""
    doors = {_rel(p).split("/src/")[1] for p in DOORS}
    packages = {f"vllm_npu/{p.name}/__init__.py" for p in REPO.glob("packages/*/src/vllm_npu/*") if p.is_dir()}
    assert len(packages) == 8
    assert packages <= doors


@pytest.mark.parametrize("path", DOORS, ids=_rel)
def test_door_mirror_and_all_agree_with_the_lazy_table(path: Path) -> None:
    door = Door(path)
    where = _rel(path)
    assert door.exports, f"{where}: no literal `_EXPORTS = {{name: '.module:attr'}}` table"
    assert door.has_type_checking, f"{where}: add the TYPE_CHECKING mirror of _EXPORTS:\n{door.render_mirror()}"
    assert door.mirror == door.exports, (
        f"{where}: the TYPE_CHECKING block and _EXPORTS disagree; the block should read:\n{door.render_mirror()}"
    )
    assert door.all_is_literal, f"{where}: __all__ must be a literal list of strings (type checkers read it)"
    assert door.all is not None and sorted(door.all) == door.expected_all(), (
        f"{where}: __all__ should hold (in ruff's RUF022 order) {door.expected_all()!r}"
    )


@pytest.mark.parametrize("path", DOORS, ids=_rel)
def test_door_hides_its_getattr_from_type_checkers(path: Path) -> None:
    """A module ``__getattr__`` visible to mypy makes every misspelt import from the door type-check as ``Any``."""
    assert not Door(path).getattr_outside_else, (
        f"{_rel(path)}: define __getattr__/__dir__ in the `else:` branch of `if TYPE_CHECKING:`"
    )


def test_every_interface_module_is_reached_only_through_the_door() -> None:
    """ruff's banned-api table (TID251, root pyproject) names every module of npu-interface, so that outside the
    package each import goes through ``vllm_npu.interface`` (CONTRIBUTING.md); a new module needs its row."""
    ruff = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "TID251" in ruff["select"]
    banned = set(ruff["flake8-tidy-imports"]["banned-api"])
    package = REPO / "packages/npu-interface/src/vllm_npu/interface"
    modules = {f"vllm_npu.interface.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"}
    modules |= {f"vllm_npu.interface.{p.name}" for p in package.iterdir() if (p / "__init__.py").is_file()}
    assert banned >= modules, f"add to [tool.ruff.lint.flake8-tidy-imports.banned-api]: {sorted(modules - banned)}"
    assert ruff["per-file-ignores"]["packages/npu-interface/**"] == ["TID251"]
