#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Check that the imports between the workspace's wheels follow the layering their pyprojects declare.

The layering: npu-interface is the bottom and imports no sibling; npu-platform is the top and nothing imports it;
every layer wheel between them (ops, attention, quant, models, patches, and the ones to come) imports the interface
and only the siblings its pyproject declares (``[project] dependencies`` or an extra) with a version range. That
declaration is also what ``scripts/release.py graph`` / ``affected`` read, so an import the pyproject does not
declare is a dependency the release and CI logic cannot see. Checked here, over ``packages/*/src`` (never the
tests):

1. every import of another workspace package, at module level or inside a function (read from the source by
   grimp, nothing is imported), is declared in the importer's pyproject; so is every ``"vllm_npu.<pkg>...[:attr]"``
   string literal (the lazy ``"module:Class"`` registrations name modules the same way);
2. no ``importlib.import_module("vllm_npu...")`` / ``__import__("vllm_npu...")`` with a literal name: such an edge
   is invisible to linters and type checkers; write the import statement;
3. an import of another package names no private (``_``-prefixed) module, and an import of a sibling layer (not
   the interface) goes through a door: the package or one of its subpackages (``__init__.py``), never a module;
4. the declared graph itself is layered (the interface requires no sibling, no wheel requires npu-platform, no
   cycle), and import-linter's ``layers`` contract of the root pyproject (``[tool.importlinter]``) holds and names
   every workspace package.

Usage: python scripts/check_layering.py [--root DIR]   (exit 1 on any error; needs grimp / import-linter, not the
workspace installed: the ``src`` folders are put on ``sys.path`` here).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import logging
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _workspace import REPO_ROOT, Member, Workspace  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the workspace pins 3.11 for development
    import tomli as tomllib

NAMESPACE = "vllm_npu"
INTERFACE = "npu-interface"
PLATFORM = "npu-platform"
_IMPORT_CALLS = {"import_module", "__import__"}


@dataclass(frozen=True)
class Layer:
    """One workspace package: its distribution, top-level module (``vllm_npu.ops``) and source folder."""

    member: Member
    module: str
    src: Path  # the folder that holds the namespace directory

    @property
    def pyproject(self) -> str:
        return f"{self.member.path.parent.name}/{self.member.path.name}/pyproject.toml"


def layers_of(workspace: Workspace, namespace: str = NAMESPACE) -> dict[str, Layer]:
    """module name -> :class:`Layer` for every member with exactly one package under ``src/<namespace>/``."""
    found = {}
    for member in workspace.members.values():
        packages = sorted(p for p in (member.path / "src" / namespace).glob("*/__init__.py"))
        if len(packages) == 1:
            module = f"{namespace}.{packages[0].parent.name}"
            found[module] = Layer(member, module, member.path / "src")
    return found


def _owner(module: str, layers: dict[str, Layer]) -> Layer | None:
    for name, layer in layers.items():
        if module == name or module.startswith(name + "."):
            return layer
    return None


def _source_file(module: str, layer: Layer) -> Path:
    base = layer.src.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _declared(workspace: Workspace) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in workspace.members}
    for sib in workspace.sibling_requirements():
        edges[sib.owner].add(sib.target)
    return edges


def _range_hint(target: Member) -> str:
    major, _, rest = target.version.partition(".")
    minor = rest.split(".")[0]
    if major.isdigit() and minor.isdigit():
        return f'"{target.name}>={major}.{minor},<{major}.{int(minor) + 1}"'
    return f'"{target.name}>={target.version}"'


def _undeclared(importer: Layer, target: Layer, what: str) -> str:
    return (
        f"{what}, but {importer.pyproject} does not declare {target.member.name}: add {_range_hint(target.member)} "
        f"to its [project] dependencies (or to an extra, guarded by vllm_npu.interface.require()) and "
        f"[tool.uv.sources], or move the shared contract into npu-interface (vllm_npu.interface.protocols)"
    )


@contextlib.contextmanager
def _on_path(paths: list[Path]) -> Iterator[None]:
    """The ``src`` folders on ``sys.path`` (grimp finds packages through it), restored afterwards."""
    saved = list(sys.path)
    sys.path[:0] = [str(p) for p in paths]
    try:
        yield
    finally:
        sys.path[:] = saved


@dataclass(frozen=True)
class CrossImport:
    """One import statement in ``importer``'s source of a module of another workspace package."""

    importer: Layer
    target: Layer
    module: str  # the importing module
    imported: str
    line: int
    code: str


def cross_imports(workspace: Workspace, namespace: str = NAMESPACE) -> list[CrossImport]:
    """Every import between two workspace packages, module level and function level alike (read by grimp)."""
    import grimp

    layers = layers_of(workspace, namespace)
    with _on_path([layer.src for layer in layers.values()]):
        graph = grimp.build_graph(*sorted(layers), cache_dir=None)
    found = []
    for module in sorted(graph.modules):
        importer = _owner(module, layers)
        if importer is None:
            continue
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            target = _owner(imported, layers)
            if target is None or target is importer:
                continue
            for detail in graph.get_import_details(importer=module, imported=imported):
                found.append(
                    CrossImport(importer, target, module, imported, detail["line_number"], detail["line_contents"])
                )
    return found


def import_errors(workspace: Workspace, namespace: str = NAMESPACE) -> list[str]:
    """Rules 1 (imports) and 3 over the import graph of every layer's source."""
    declared = _declared(workspace)
    errors = []
    for edge in cross_imports(workspace, namespace):
        importer, target, module, imported = edge.importer, edge.target, edge.module, edge.imported
        where = f"{_source_file(module, importer).relative_to(workspace.root)}:{edge.line}"
        what = f"{where} imports {imported} (`{edge.code}`)"
        if target.member.name not in declared[importer.member.name]:
            errors.append(_undeclared(importer, target, what))
        tail = imported[len(target.module) + 1 :].split(".") if imported != target.module else []
        if any(part.startswith("_") and not part.startswith("__") for part in tail):
            errors.append(f"{what}: a private module of {target.member.name}; import what {target.module} exports")
        elif target.member.name != INTERFACE and _source_file(imported, target).name != "__init__.py":
            errors.append(
                f"{what}: a module of {target.member.name}, not a door; import the name from {target.module} "
                "(or the subpackage that exports it), adding the export there if needed"
            )
    return errors


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def string_errors(workspace: Workspace, namespace: str = NAMESPACE) -> list[str]:
    """Rules 1 (module-path strings) and 2, by reading every source file's syntax tree."""
    layers = layers_of(workspace, namespace)
    declared = _declared(workspace)
    module_path = re.compile(rf"^{re.escape(namespace)}(\.\w+)+(:[\w.]+)?$")
    errors = []
    for layer in sorted(layers.values(), key=lambda x: x.module):
        root = layer.src.joinpath(*layer.module.split("."))
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            rel = path.relative_to(workspace.root)
            docstrings = _docstrings(tree)
            named_in_calls: set[int] = set()  # reported as a by-name import, not again as a module-path string
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    func = node.func
                    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                    arg = node.args[0] if node.args else None
                    if (
                        name in _IMPORT_CALLS
                        and isinstance(arg, ast.Constant)
                        and isinstance(arg.value, str)
                        and (arg.value == namespace or arg.value.startswith(namespace + "."))
                    ):
                        named_in_calls.add(id(arg))
                        errors.append(
                            f"{rel}:{node.lineno} imports {arg.value!r} by name ({name}); write the import statement "
                            "(a declared sibling's door, or the interface) so that linters and type checkers see it"
                        )
                elif (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and id(node) not in docstrings | named_in_calls
                ):
                    if not module_path.match(node.value):
                        continue
                    target = _owner(node.value.partition(":")[0], layers)
                    if (
                        target is not None
                        and target is not layer
                        and target.member.name not in declared[layer.member.name]
                    ):
                        errors.append(_undeclared(layer, target, f"{rel}:{node.lineno} names {node.value!r}"))
    return errors


def declared_graph_errors(workspace: Workspace, namespace: str = NAMESPACE) -> list[str]:
    """Rule 4, first half: the pyprojects' sibling requirements are themselves layered and acyclic."""
    layered = {layer.member.name for layer in layers_of(workspace, namespace).values()}
    declared = {name: targets & layered for name, targets in _declared(workspace).items() if name in layered}
    errors = []
    for owner, targets in sorted(declared.items()):
        pyproject = (workspace.members[owner].path / "pyproject.toml").relative_to(workspace.root)
        if owner == INTERFACE and targets:
            errors.append(
                f"{pyproject}: npu-interface is the bottom layer and requires no sibling; drop {sorted(targets)}"
            )
        if PLATFORM in targets:
            errors.append(f"{pyproject}: requires npu-platform, the top layer; move what it needs down a layer")
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(declared.get(name, ())):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target] if target in path else [name, target]
                errors.append(f"the declared sibling requirements form a cycle: {' -> '.join(cycle)}")
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(declared):
        if name not in state:
            visit(name, [name])
    return errors


def layers_contract_errors(workspace: Workspace, namespace: str = NAMESPACE) -> list[str]:
    """Rule 4, second half: import-linter's contracts of the root pyproject hold, and the layers contract places
    every workspace package (a new layer wheel has to be put in the middle layer)."""
    from importlinter.cli import lint_imports

    layers = layers_of(workspace, namespace)
    config_file = workspace.root / "pyproject.toml"
    with config_file.open("rb") as handle:
        config = tomllib.load(handle).get("tool", {}).get("importlinter", {})
    contracts = [c for c in config.get("contracts", []) if c.get("type") == "layers"]
    if not contracts:
        return [f"{config_file.name}: no [[tool.importlinter.contracts]] of type 'layers'"]
    errors = []
    for contract in contracts:
        placed = {m.strip() for layer in contract.get("layers", []) for m in re.split(r"[|:]", layer) if m.strip()}
        missing = sorted(set(layers) - placed)
        if missing:
            errors.append(
                f"{config_file.name}: import-linter contract {contract.get('name')!r} does not place {missing}: add "
                "each to the middle layer (a layer wheel) or explain why it sits elsewhere"
            )
    if sorted(config.get("root_packages", [])) != sorted(layers):
        errors.append(
            f"{config_file.name}: [tool.importlinter] root_packages must be the workspace packages {sorted(layers)}"
        )
    report = io.StringIO()
    # lint_imports configures logging with dictConfig, whose default disables every logger that exists already; in a
    # test process that silences vLLM's and our loggers for every later test, so their state is put back.
    enabled = [
        lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger) and not lg.disabled
    ]
    try:
        with _on_path([layer.src for layer in layers.values()]), contextlib.redirect_stdout(report):
            code = lint_imports(config_filename=str(config_file), no_cache=True)
    finally:
        for logger in enabled:
            logger.disabled = False
    if code != 0:
        text = report.getvalue()
        broken = text.find("Broken contracts")
        errors.append(f"import-linter's contracts are broken:\n{text[broken:] if broken >= 0 else text}".rstrip())
    return errors


def check(workspace: Workspace, namespace: str = NAMESPACE, *, import_linter: bool = True) -> list[str]:
    """Every problem, one line each (empty = the layering holds)."""
    errors = declared_graph_errors(workspace, namespace) + import_errors(workspace, namespace)
    errors += string_errors(workspace, namespace)
    if import_linter:
        errors += layers_contract_errors(workspace, namespace)
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="workspace root (default: this repository)")
    args = parser.parse_args(argv)
    workspace = Workspace(args.root)
    errors = check(workspace)
    for error in errors:
        print(f"ERROR {error}")
    if not errors:
        print(f"OK: the imports of {len(layers_of(workspace))} packages follow their declared dependencies")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
