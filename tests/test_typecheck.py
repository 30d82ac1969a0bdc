# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""mypy over packages/*/src, with the settings in the root pyproject's [tool.mypy] (CI runs only the test suite, so
the type check is a test). A cold run (no .mypy_cache) takes about a minute on a 2-core machine; a warm one seconds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # half a minute or more: scheduled with the engine modules (conftest.py)

REPO = Path(__file__).resolve().parent.parent


def test_every_package_src_is_a_namespace_root_for_mypy() -> None:
    """Each wheel's src/ must be on mypy_path: with explicit_package_bases, a src/ that is not would be checked
    under a wrong module name (or not resolve its sibling imports)."""
    import tomllib  # Python 3.11+, as in tests/test_workspace.py

    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]
    srcs = sorted(str(p.relative_to(REPO)) for p in REPO.glob("packages/*/src"))
    assert len(srcs) == 8
    assert sorted(config["mypy_path"]) == srcs
    assert config["files"] == ["packages/*/src"]


def test_mypy_reports_no_errors() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"mypy found type errors:\n{proc.stdout}{proc.stderr}"
    assert "Success: no issues found" in proc.stdout
