# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The repository's hygiene rules, enforced where CI runs them (`.ci/run` is the README's pytest command): the tree
is ruff-formatted and lint-clean, every source file carries the SPDX header, and every wheel ships the LICENSE."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p.parent for p in REPO.glob("packages/*/pyproject.toml"))
SPDX_HEADER = (
    "# SPDX-License-Identifier: Apache-2.0",
    "# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project",
)


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    # The ruff of this environment: uv.lock pins the version CI's lint job runs (`uvx ruff@<same>`).
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_tree_is_ruff_formatted() -> None:
    proc = _ruff("format", "--check", ".")
    assert proc.returncode == 0, f"run `uv run --frozen ruff format .`:\n{proc.stdout}{proc.stderr}"


def test_tree_passes_ruff_check() -> None:
    proc = _ruff("check", ".")
    assert proc.returncode == 0, f"run `uv run --frozen ruff check .` (--fix for the fixable ones):\n{proc.stdout}"


def _source_files() -> list[Path]:
    """Tracked and new (not ignored) Python and shell sources, as git and ruff see the tree."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py", "*.sh", ".ci/run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return sorted(REPO / name for name in set(listed) if (REPO / name).is_file())


def test_every_source_file_starts_with_the_spdx_header() -> None:
    files = _source_files()
    assert len(files) > 100, "git ls-files found almost nothing: is this a checkout?"
    missing = []
    for path in files:
        lines = path.read_text(encoding="utf-8").splitlines()
        if lines and lines[0].startswith("#!"):
            lines = lines[1:]  # a shebang comes first
        if tuple(lines[:2]) != SPDX_HEADER:
            missing.append(str(path.relative_to(REPO)))
    assert missing == [], "start these files with the two SPDX lines (see CONTRIBUTING.md): " + ", ".join(missing)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_every_wheel_declares_the_repository_license(package: Path) -> None:
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    # PEP 639 license files live beside the pyproject: each package holds a copy of the root LICENSE.
    assert (package / "LICENSE").read_bytes() == (REPO / "LICENSE").read_bytes(), f"cp LICENSE {package.name}/"


def _ci_workflow() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((REPO / ".github" / "workflows" / "ci.yml").read_text())


def test_ci_unit_matrix_covers_every_supported_python() -> None:
    from packaging.specifiers import SpecifierSet

    supported = SpecifierSet(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"])
    minors = [f"3.{m}" for m in range(8, 20) if f"3.{m}.0" in supported]
    unit = _ci_workflow()["jobs"]["unit"]
    assert unit["strategy"]["matrix"]["python"] == minors
    run = "\n".join(step.get("run", "") for step in unit["steps"])
    assert '-m "not engine and not selective_install"' in run and "--frozen" in run


def test_ci_lint_runs_the_locked_ruff_for_check_and_format() -> None:
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    (ruff,) = [p["version"] for p in lock["package"] if p["name"] == "ruff"]
    lint = "\n".join(step.get("run", "") for step in _ci_workflow()["jobs"]["lint"]["steps"])
    assert f"uvx ruff@{ruff} check ." in lint and f"uvx ruff@{ruff} format --check ." in lint


def test_relative_links_in_the_docs_resolve() -> None:
    import re

    docs = [REPO / "README.md", REPO / "CONTRIBUTING.md", *REPO.glob("docs/*.md"), *REPO.glob("packages/*/README.md")]
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(REPO)} -> {target}")
    assert broken == []
