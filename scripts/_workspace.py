# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The uv workspace as data: members, their in-tree versions and the sibling requirements between them.

Shared by ``check_workspace_ranges.py`` and ``release.py``. Reads pyproject files only (nothing is built or
imported), so it runs before anything is installed.
"""

from __future__ import annotations

import glob
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the workspace pins 3.11 for development
    import tomli as tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parent.parent
_VERSION_RE = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.MULTILINE)


@dataclass(frozen=True)
class SiblingRequirement:
    """``owner`` requires ``requirement`` (a workspace member), from ``where`` (``dependencies`` or ``extra 'x'``)."""

    owner: str
    requirement: Requirement
    where: str

    @property
    def target(self) -> str:
        return canonicalize_name(self.requirement.name)


@dataclass
class Member:
    name: str
    path: Path  # the member directory
    version: str
    version_file: Path | None  # where a dynamic version lives (hatch [tool.hatch.version] path)
    private: bool  # "Private :: Do Not Upload": never released
    requires_python: str = ""
    python_classifiers: tuple[str, ...] = ()  # "3.11" for each "Programming Language :: Python :: 3.11"
    requirements: list[Requirement] = field(default_factory=list)
    extras: dict[str, list[Requirement]] = field(default_factory=dict)
    workspace_sources: set[str] = field(default_factory=set)

    def all_requirements(self) -> list[tuple[str, Requirement]]:
        found = [("dependencies", r) for r in self.requirements]
        for extra, reqs in self.extras.items():
            found += [(f"extra {extra!r}", r) for r in reqs]
        return found


def _load(path: Path) -> dict:
    with path.open("rb") as handle:
        return tomllib.load(handle)


def read_version(member_dir: Path, project: dict, tool: dict) -> tuple[str, Path | None]:
    if "version" in project:
        return str(project["version"]), None
    if "version" not in project.get("dynamic", []):
        raise ValueError(f"{member_dir}/pyproject.toml: no [project] version and version is not dynamic")
    rel = tool.get("hatch", {}).get("version", {}).get("path")
    if not rel:
        raise ValueError(f"{member_dir}/pyproject.toml: dynamic version without [tool.hatch.version] path")
    version_file = member_dir / rel
    match = _VERSION_RE.search(version_file.read_text())
    if not match:
        raise ValueError(f"{version_file}: no __version__ = '...' line")
    return match.group(1), version_file


def load_member(member_dir: Path) -> Member:
    data = _load(member_dir / "pyproject.toml")
    project, tool = data.get("project", {}), data.get("tool", {})
    version, version_file = read_version(member_dir, project, tool)
    sources = tool.get("uv", {}).get("sources", {})
    return Member(
        name=canonicalize_name(project["name"]),
        path=member_dir,
        version=version,
        version_file=version_file,
        private=any("Private :: Do Not Upload" in c for c in project.get("classifiers", [])),
        requires_python=str(project.get("requires-python", "")),
        python_classifiers=tuple(
            m.group(1)
            for c in project.get("classifiers", [])
            if (m := re.fullmatch(r"Programming Language :: Python :: (3\.\d+)", c.strip()))
        ),
        requirements=[Requirement(r) for r in project.get("dependencies", [])],
        extras={k: [Requirement(r) for r in v] for k, v in project.get("optional-dependencies", {}).items()},
        workspace_sources={
            canonicalize_name(k) for k, v in sources.items() if isinstance(v, dict) and v.get("workspace")
        },
    )


class Workspace:
    """Every member of the workspace rooted at ``root`` (the directory of the virtual root pyproject)."""

    def __init__(self, root: Path = REPO_ROOT) -> None:
        self.root = root
        config = _load(root / "pyproject.toml").get("tool", {}).get("uv", {}).get("workspace", {})
        excluded = {Path(p).resolve() for pattern in config.get("exclude", []) for p in glob.glob(str(root / pattern))}
        dirs = sorted(
            {Path(p).resolve() for pattern in config.get("members", []) for p in glob.glob(str(root / pattern))}
            - excluded
        )
        self.members: dict[str, Member] = {}
        for member_dir in dirs:
            if (member_dir / "pyproject.toml").is_file():
                member = load_member(member_dir)
                self.members[member.name] = member

    def sibling_requirements(self) -> list[SiblingRequirement]:
        """Every requirement of a member on another member (self-references such as ``pkg[a,b]`` excluded)."""
        found = []
        for member in self.members.values():
            for where, req in member.all_requirements():
                target = canonicalize_name(req.name)
                if target in self.members and target != member.name:
                    found.append(SiblingRequirement(member.name, req, where))
        return found

    def dependents(self) -> dict[str, set[str]]:
        """member -> the members that require it (directly), from dependencies and extras alike."""
        graph: dict[str, set[str]] = {name: set() for name in self.members}
        for sib in self.sibling_requirements():
            graph[sib.target].add(sib.owner)
        return graph

    def affected_by(self, name: str) -> set[str]:
        """``name`` and every member that (transitively) requires it."""
        graph, seen, todo = self.dependents(), {name}, [name]
        while todo:
            for dependent in graph[todo.pop()]:
                if dependent not in seen:
                    seen.add(dependent)
                    todo.append(dependent)
        return seen

    def member_for_dir(self, dirname: str) -> Member | None:
        for member in self.members.values():
            if member.path.name == dirname:
                return member
        return None
