# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The layering of the wheels, enforced: scripts/check_layering.py on this workspace, on throwaway workspaces that
break each rule, and against the dependency graph that scripts/release.py reads."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _script_loader import load_script  # noqa: E402

layering = load_script("check_layering")
release = load_script("release")
Workspace = layering.Workspace

NS = "lt_ns"  # the throwaway workspaces' namespace: not vllm_npu, so nothing merges with the installed packages


def test_this_workspace_is_layered() -> None:
    errors = layering.check(Workspace())
    assert not errors, "\n".join(errors)


def test_every_import_edge_is_in_the_release_graph() -> None:
    """What release.py's graph / affected read (the pyprojects) covers every import the sources make."""
    workspace = Workspace()
    dependents = workspace.dependents()
    edges = {(e.importer.member.name, e.target.member.name) for e in layering.cross_imports(workspace)}
    missing = sorted((owner, target) for owner, target in edges if owner not in dependents[target])
    assert not missing, f"imports that release.py's graph lacks: {missing}"
    # the sideways seams that stayed imports are declared, and so visible to affected()
    assert {("npu-quant", "npu-ops"), ("npu-models", "npu-attention"), ("npu-models", "npu-ops")} <= edges


# --- throwaway workspaces -------------------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def _member(root: Path, short: str, deps: list[str], extras: dict[str, list[str]] | None = None) -> None:
    name = f"npu-{short}"
    siblings = {d.split(">")[0].split("[")[0] for d in [*deps, *sum((extras or {}).values(), [])]}
    _write(
        root / "packages" / name / "pyproject.toml",
        f"""
        [project]
        name = "{name}"
        version = "0.1.0"
        dependencies = {json.dumps(deps)}
        [project.optional-dependencies]
        {"".join(f"{k} = {json.dumps(v)}{chr(10)}" for k, v in (extras or {}).items())}
        [tool.uv.sources]
        {"".join(f"{s} = {{ workspace = true }}{chr(10)}" for s in sorted(siblings))}
        """,
    )
    _write(root / "packages" / name / "src" / NS / short / "__init__.py", '"""door"""\n')


def _source(root: Path, short: str, module: str, text: str) -> None:
    _write(root / "packages" / f"npu-{short}" / "src" / NS / short / f"{module}.py", text)


@pytest.fixture
def ws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """interface <- alpha <- beta[x] (an extra) <- platform[all], each importing what it declares; the root pyproject
    holds the same import-linter layers contract as this repository's."""
    for name in [m for m in sys.modules if m == NS or m.startswith(NS + ".")]:
        monkeypatch.delitem(sys.modules, name)
    _write(
        tmp_path / "pyproject.toml",
        f"""
        [tool.uv.workspace]
        members = ["packages/*"]
        [tool.importlinter]
        root_packages = ["{NS}.interface", "{NS}.alpha", "{NS}.beta", "{NS}.platform"]
        [[tool.importlinter.contracts]]
        name = "layers"
        type = "layers"
        layers = ["{NS}.platform", "{NS}.alpha : {NS}.beta", "{NS}.interface"]
        """,
    )
    _member(tmp_path, "interface", [])
    _member(tmp_path, "alpha", ["npu-interface>=0.1,<0.2"])
    _member(tmp_path, "beta", ["npu-interface>=0.1,<0.2"], {"x": ["npu-alpha>=0.1,<0.2"]})
    _member(
        tmp_path,
        "platform",
        ["npu-interface>=0.1,<0.2"],
        {"all": ["npu-alpha>=0.1,<0.2", "npu-beta>=0.1,<0.2"]},
    )
    _source(tmp_path, "interface", "errors", "class Oops(Exception):\n    pass\n")
    _source(tmp_path, "interface", "_private", "X = 1\n")
    _source(tmp_path, "alpha", "core", f"from {NS}.interface.errors import Oops\n")
    _source(tmp_path, "alpha", "_impl", "Y = 2\n")
    _write(tmp_path / "packages/npu-alpha/src" / NS / "alpha/__init__.py", '"""door"""\nfrom .core import Oops\n')
    _source(
        tmp_path,
        "beta",
        "user",
        f'''
        """Mentions {NS}.platform.cli:main in a docstring, which is prose, not an edge."""

        def run():
            from {NS}.alpha import Oops  # a lazy import through the door of a declared (extra) sibling

            return Oops, "{NS}.alpha.core:Oops"
        ''',
    )
    _source(tmp_path, "platform", "boot", f"import {NS}.alpha\nimport {NS}.beta\n")
    return tmp_path


def _errors(root: Path, *, import_linter: bool = False) -> list[str]:
    return layering.check(Workspace(root), NS, import_linter=import_linter)


def test_a_layered_workspace_passes(ws: Path) -> None:
    assert _errors(ws, import_linter=True) == []
    graph = {(e.importer.member.name, e.target.member.name) for e in layering.cross_imports(Workspace(ws), NS)}
    assert graph == {
        ("npu-alpha", "npu-interface"),
        ("npu-beta", "npu-alpha"),
        ("npu-platform", "npu-alpha"),
        ("npu-platform", "npu-beta"),
    }


def test_an_undeclared_lazy_import_names_the_pyproject_to_fix(ws: Path) -> None:
    _source(ws, "alpha", "late", f"def f():\n    import {NS}.beta\n\n    return {NS}.beta\n")
    (error,) = _errors(ws)
    assert error.startswith("packages/npu-alpha/src/lt_ns/alpha/late.py:2 imports lt_ns.beta")
    assert 'but packages/npu-alpha/pyproject.toml does not declare npu-beta: add "npu-beta>=0.1,<0.2"' in error
    assert "vllm_npu.interface.protocols" in error  # the other way out: a contract in the interface


def test_string_imports_are_refused_and_module_strings_are_edges(ws: Path) -> None:
    _source(
        ws,
        "alpha",
        "hidden",
        f'import importlib\n\nSFA = importlib.import_module("{NS}.interface.errors")\nHOOK = "{NS}.beta.user:run"\n',
    )
    errors = _errors(ws)
    assert len(errors) == 2, errors
    assert (
        "hidden.py:3 imports 'lt_ns.interface.errors' by name (import_module); write the import statement" in errors[0]
    )
    assert (
        "hidden.py:4 names 'lt_ns.beta.user:run', but packages/npu-alpha/pyproject.toml does not declare" in errors[1]
    )


def test_sibling_imports_go_through_doors_and_never_to_private_modules(ws: Path) -> None:
    _source(ws, "beta", "deep", f"from {NS}.alpha.core import Oops\nfrom {NS}.alpha import _impl\n")
    _source(ws, "alpha", "priv", f"from {NS}.interface._private import X\nfrom {NS}.interface.errors import Oops\n")
    errors = _errors(ws)
    assert len(errors) == 3, errors
    assert any("deep.py:1 imports lt_ns.alpha.core" in e and "not a door" in e for e in errors)
    assert any("deep.py:2 imports lt_ns.alpha._impl" in e and "a private module of npu-alpha" in e for e in errors)
    # the interface's public modules are fine; its private ones are not
    assert any("priv.py:1 imports lt_ns.interface._private" in e and "private" in e for e in errors)


def test_an_upward_import_breaks_the_layers_contract(ws: Path) -> None:
    _source(ws, "alpha", "up", f"import {NS}.platform\n")
    errors = _errors(ws, import_linter=True)
    assert any("packages/npu-alpha/pyproject.toml does not declare npu-platform" in e for e in errors), errors
    (linter,) = [e for e in errors if e.startswith("import-linter")]
    assert "lt_ns.alpha is not allowed to import lt_ns.platform" in linter


def test_the_declared_graph_must_be_layered(ws: Path) -> None:
    _member(ws, "interface", ["npu-alpha>=0.1,<0.2"])
    _member(ws, "alpha", ["npu-interface>=0.1,<0.2", "npu-beta>=0.1,<0.2", "npu-platform>=0.1,<0.2"])
    errors = layering.declared_graph_errors(Workspace(ws), NS)
    assert any("npu-interface is the bottom layer and requires no sibling" in e for e in errors), errors
    assert any("npu-alpha/pyproject.toml: requires npu-platform, the top layer" in e for e in errors), errors
    assert any("form a cycle: npu-alpha -> npu-beta -> npu-alpha" in e for e in errors), errors


def test_the_layers_contract_must_place_every_package(ws: Path) -> None:
    _member(ws, "gamma", ["npu-interface>=0.1,<0.2"])
    errors = layering.layers_contract_errors(Workspace(ws), NS)
    assert any("does not place ['lt_ns.gamma']" in e for e in errors), errors
    assert any("root_packages must be the workspace packages" in e for e in errors), errors
