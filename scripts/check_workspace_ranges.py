#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Check that every sibling range in every member's pyproject admits the in-tree version of that sibling.

uv resolves workspace siblings from the tree and never compares the declared range with the tree's version
(astral-sh/uv#4604): ``npu-platform[quant]`` asking for ``npu-quant>=0.1,<0.2`` passes ``uv lock`` and ``uv sync``
even when npu-quant is 0.2.0, and the skew only surfaces when users install the published wheels. This script
makes it a CI error. It also rejects sibling requirements without an upper bound and siblings that are not
resolved from the workspace (no ``[tool.uv.sources] <name> = { workspace = true }``).

Usage: python scripts/check_workspace_ranges.py [--root DIR]   (exit 1 on any error)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _workspace import REPO_ROOT, Workspace  # noqa: E402


def check(workspace: Workspace) -> list[str]:
    """Every problem, one line each (empty = the ranges are consistent)."""
    errors = []
    for sib in workspace.sibling_requirements():
        req, target = sib.requirement, workspace.members[sib.target]
        label = f"{sib.owner} ({sib.where}): requires {str(req)!r}"
        if not req.specifier:
            errors.append(f"{label} without a version range -> pin a range that admits {target.name} {target.version}")
            continue
        if not any(spec.operator in ("<", "<=", "==", "~=", "===") for spec in req.specifier):
            errors.append(f"{label} has no upper bound -> add one (e.g. <{_next_minor(target.version)})")
        if not req.specifier.contains(target.version, prereleases=True):
            errors.append(f"{label} but workspace {target.name} is {target.version} -> bump the range or the version")
        if sib.target not in workspace.members[sib.owner].workspace_sources:
            errors.append(
                f"{label} but [tool.uv.sources] of {sib.owner} lacks {target.name} = {{ workspace = true }} "
                "-> uv would resolve it from the index instead of the tree"
            )
    return errors


def _next_minor(version: str) -> str:
    parts = (version.split(".") + ["0", "0"])[:2]
    return f"{parts[0]}.{int(parts[1]) + 1}" if parts[1].isdigit() else version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="workspace root (default: this repository)")
    args = parser.parse_args(argv)
    workspace = Workspace(args.root)
    errors = check(workspace)
    for error in errors:
        print(f"ERROR {error}")
    if not errors:
        pairs = len(workspace.sibling_requirements())
        print(f"OK: {pairs} sibling requirements across {len(workspace.members)} members admit the in-tree versions")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
