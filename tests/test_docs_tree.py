# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The docs say what the tree holds: the wheel lists match the workspace members, and every module the text names
exists.

Checked text: ``docs/*.md``, ``README.md``, ``CONTRIBUTING.md``, ``packages/*/README.md``. Names checked:

- dotted names ``vllm_npu.<pkg>[.<module>...][.<attr>]`` and ``"vllm_npu.<module>:<attr>"`` targets: the longest
  prefix that is a module or package of the tree, then at most one attribute, which that module's source must name;
- file paths ending in ``.py`` rooted where only this repository can be meant: ``packages/``, ``scripts/``,
  ``tests/``, ``testkit/``, ``benchmarks/``, ``vllm_npu/``, ``npu-<pkg>/`` and the sub-packages whose names no
  reference tree shares (``interface/``, ``platform/``, ``quant/``, ``patches/``, ``kv/``), resolved as a suffix of a
  file of the tree. ``attention/``, ``ops/``, ``models/`` and ``sample/`` paths are left alone: vllm-ascend v0.11.0
  has folders of those names, and docs/npu-calls.md cites its files by them.
"""

from __future__ import annotations

import os
import re
import sys
from functools import cache
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [*ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md", *ROOT.glob("packages/*/README.md")]
)
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]

DOTTED = re.compile(r"(?<![\w.])vllm_npu((?:\.[A-Za-z_]\w*)+)(?::([A-Za-z_]\w*))?")
PATH = re.compile(r"(?<![\w./-])([\w.-]+(?:/[\w.-]+)+\.py)\b")
OUR_ROOTS = ("packages", "scripts", "tests", "testkit", "benchmarks", "vllm_npu", "interface", "platform", "quant")
OUR_ROOTS += ("patches", "kv")
#: Names that are not modules: the plugin's entry-point group, and the placeholder layer of a how-to example.
NOT_MODULES = {"vllm_npu.components"}
EXAMPLE_PACKAGES = {"mylayer"}  # packages/npu-patches/README.md: "replacement="vllm_npu.mylayer._fix:make""


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@cache
def wheels() -> dict[str, str]:
    """Workspace member distributions under packages/ -> their import package (``npu-ops`` -> ``ops``)."""
    members = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]["members"]
    assert "packages/*" in members, members
    found = {}
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
        (pkg,) = [
            p.name for p in (pyproject.parent / "src" / "vllm_npu").iterdir() if p.is_dir() and p.name != "__pycache__"
        ]
        found[name] = pkg
    return found


@cache
def tree_files() -> list[str]:
    """Every file of the tree, relative to the root (the venv, git and the caches pruned, not walked)."""
    skip = {
        ".git",
        ".venv",
        "__pycache__",
        ".mypy_cache",
        ".ruff_cache",
        ".pytest_cache",
        "node_modules",
        "build",
        "dist",
    }
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip]
        rel = Path(folder).relative_to(ROOT)
        out += [(rel / f).as_posix() for f in files]
    return out


def module_source(dotted: list[str]) -> Path | None:
    """The source file of ``vllm_npu.<dotted>`` in the tree (a package's ``__init__.py``), or None."""
    if not dotted or dotted[0] not in wheels().values():
        return None
    (wheel,) = [w for w, p in wheels().items() if p == dotted[0]]
    base = ROOT / "packages" / wheel / "src" / "vllm_npu" / Path(*dotted)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def dotted_problem(parts: list[str], attr: str | None) -> str | None:
    """Why ``vllm_npu.<parts>[:attr]`` names nothing in the tree, or None."""
    for cut in range(len(parts), 0, -1):
        source = module_source(parts[:cut])
        if source is None:
            continue
        rest = parts[cut:] + ([attr] if attr else [])
        if len(rest) > 1 and attr is None:
            return f"no module vllm_npu.{'.'.join(parts[: cut + 1])}"
        if rest and not re.search(rf"\b{re.escape(rest[0])}\b", source.read_text()):
            return f"{source.relative_to(ROOT)} defines no {rest[0]}"
        return None
    return f"no package vllm_npu.{parts[0]}"


def path_problem(token: str) -> str | None:
    """Why a ``.py`` path of ours names no file of the tree, or None (None too for paths of other trees)."""
    head = token.split("/", 1)[0]
    if token.endswith("vllm_npu/__init__.py"):  # the docs say there is none (PEP 420); tests/test_workspace.py checks
        return f"{token} exists" if (ROOT / token).exists() else None
    if head not in OUR_ROOTS and not (head.startswith("npu-") and head in wheels()):
        return None
    if head in wheels():  # `npu-attention/ops/x.py`: the wheel's folder, as a reader would shorten it
        ok = any(f.startswith(f"packages/{head}/") and f.endswith("/" + token.split("/", 1)[1]) for f in tree_files())
    else:
        ok = any(f == token or f.endswith("/" + token) for f in tree_files())
    return None if ok else f"no file {token}"


def names_in(doc: Path) -> list[tuple[str, str]]:
    """(name as written, problem) for every stale name of ``doc``."""
    text = doc.read_text()
    problems = []
    for m in DOTTED.finditer(text):
        parts = m.group(1).lstrip(".").split(".")
        if m.group(0) in NOT_MODULES or parts[0] in EXAMPLE_PACKAGES:
            continue
        if (why := dotted_problem(parts, m.group(2))) is not None:
            problems.append((m.group(0), why))
    for m in PATH.finditer(text):
        if (why := path_problem(m.group(1))) is not None:
            problems.append((m.group(1), why))
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_module_a_doc_names_exists(doc: Path) -> None:
    assert names_in(doc) == []


def test_the_resolver_catches_stale_names() -> None:
    """The checks above would pass on any text if the resolver accepted everything."""
    assert dotted_problem(["platform", "graphs", "_npu"], None) is None
    assert dotted_problem(["platform", "platform"], "NPUPlatform") is None
    assert dotted_problem(["kv", "scheduler", "PDScheduler"], None) is None
    assert dotted_problem(["platform", "graphs", "_acl"], None).endswith("graphs/__init__.py defines no _acl")
    assert dotted_problem(["platform", "graphs", "_acl", "capture"], None) == "no module vllm_npu.platform.graphs._acl"
    assert dotted_problem(["ops", "layernorm", "NoSuchKernel"], None) is not None
    assert dotted_problem(["cuda", "x"], None) == "no package vllm_npu.cuda"
    assert path_problem("platform/graphs/_npu.py") is None
    assert path_problem("platform/graphs/_gone.py") == "no file platform/graphs/_gone.py"
    assert path_problem("packages/npu-kv/src/vllm_npu/kv/engine.py") is None
    assert path_problem("npu-attention/ops/graph_decode.py") is None
    assert path_problem("npu-attention/ops/gone.py") is not None
    assert path_problem("vllm/platforms/__init__.py") is None  # vLLM's, not checked here
    assert path_problem("attention/attention_v1.py") is None  # vllm-ascend's folder name, left alone


def _number_claims(text: str) -> list[int]:
    """Every "<number> [independently versioned] wheels under" (the workspace's size) the text states."""
    found = re.findall(r"\b(\w+)\s+(?:independently\s+versioned\s+)?wheels\s+under\b", text, flags=re.IGNORECASE)
    return [
        NUMBERS.index(w.lower()) if w.lower() in NUMBERS else int(w)
        for w in found
        if w.lower() in NUMBERS or w.isdigit()
    ]


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_wheel_counts_match_the_workspace(doc: Path) -> None:
    assert set(_number_claims(doc.read_text())) <= {len(wheels())}, f"{_doc_id(doc)}: the workspace has {len(wheels())}"


def test_readme_packages_table_lists_every_wheel() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("## The packages", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(npu-[\w-]+)` \| `vllm_npu\.(\w+)` \|", section, flags=re.MULTILINE))
    assert rows == wheels()


def test_architecture_lists_and_draws_every_wheel() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    layers = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    diagram = layers.split("```", 2)[1]
    for wheel in wheels():
        assert wheel in diagram, f"{wheel} missing from the layer diagram"
        assert f"**{wheel}**" in layers or wheel in diagram.split("layers", 1)[1], wheel
    assert f"{NUMBERS[len(wheels())].capitalize()} wheels" in layers
    extras = re.search(r"extras: ((?:\[\w+\] ?)+)", diagram)
    assert extras, "the diagram names npu-platform's layer extras"
    declared = tomllib.loads((ROOT / "packages/npu-platform/pyproject.toml").read_text())["project"]
    layer_extras = {
        e for e, reqs in declared["optional-dependencies"].items() if any(r.startswith(f"npu-{e}>") for r in reqs)
    }
    assert set(re.findall(r"\[(\w+)\]", extras.group(1))) == layer_extras


def test_contributing_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    test_command = re.findall(r"```bash\n(.+?)\n```", readme)[1]
    assert test_command in (ROOT / "CONTRIBUTING.md").read_text()
