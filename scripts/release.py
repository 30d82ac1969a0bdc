#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Release and CI logic for the workspace, kept out of YAML so that it is tested (tests/test_release_scripts.py).

Subcommands (each prints ``key=value`` lines for ``$GITHUB_OUTPUT`` unless said otherwise, exit 1 with
``ERROR ...`` on stderr):

``tag TAG``
    Parse a release tag ``<distribution>-v<version>`` (split at the LAST ``-v``: distribution names contain
    hyphens), e.g. ``npu-quant-v0.2.0`` -> ``package=npu-quant``, ``version=0.2.0``, ``dir=packages/npu-quant``.
    Fails for an unknown or private package, a non-PEP 440 version, or a version that differs from the package's
    in-tree version (``_version.py``).
``check-built --package P --version V --dist DIR``
    Fail unless DIR holds exactly one wheel of P, whose file name and METADATA both say version V.
``affected [--base REF] [PATH ...]``
    The packages a change touches, derived from the workspace dependency graph: a file under
    ``packages/<pkg>/`` affects <pkg> and every member that requires it (transitively); root configuration,
    ``uv.lock``, ``.github/``, ``.ci/``, ``scripts/``, ``tests/``, ``testkit/`` affect every package; top-level
    documentation affects none. A ``packages/<dir>`` that is not a member is an error. Prints
    ``packages=<json list>``.
``dependents PACKAGE``
    The publishable members that require PACKAGE directly (``packages=<json list>``): what a new npu-interface is
    tested against.
``admits --wheel WHEEL --requirement NAME --version V``
    Whether the wheel's ``Requires-Dist`` on NAME admits version V (``admits=true|false``): a published
    implementation whose range excludes a new npu-interface is protected by the resolver and is not tested
    against it.
``notes --package P --version V``
    The ``## <version>`` section of ``packages/P/CHANGELOG.md`` (printed as Markdown, for the GitHub release);
    fails if the changelog has no such section.
``changelog [--base REF]``
    Every package whose code (``src/``, ``pyproject.toml``) changed since its last release tag (without ``--base``;
    never released = all of it) or since the merge base with REF (``--base``, pull requests) must say so under
    ``## Unreleased`` of its CHANGELOG.md (scripts/_changelog.py has the rule). Prints one line per package.
``dry-run --package P [--version V] [--dist DIR] [--siblings DIR] [--tagged]``
    The release of P end to end without publishing: tag and version, sibling ranges, the changelog entry, the build
    (sdist and wheel into DIR, default ``dist/``), smoke installs of the wheel alone and with each extra
    (scripts/_dry_run.py has the steps). release.yml's build job runs it for the pushed tag (``--tagged``), ci.yml
    for every package a change affects.
``graph``
    The dependency graph, one ``member -> siblings`` line each (for people).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from email.message import Message
from email.parser import HeaderParser
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _changelog  # noqa: E402
import _dry_run  # noqa: E402
from _workspace import REPO_ROOT, Workspace  # noqa: E402
from packaging.requirements import Requirement  # noqa: E402
from packaging.utils import canonicalize_name, parse_wheel_filename  # noqa: E402
from packaging.version import InvalidVersion, Version  # noqa: E402


class ReleaseError(Exception):
    """A release precondition that does not hold; the message says what to fix."""


# --- tags -----------------------------------------------------------------------------------------------------


def parse_tag(tag: str, workspace: Workspace) -> dict[str, str]:
    tag = tag.removeprefix("refs/tags/")
    package, sep, version = tag.rpartition("-v")
    if not sep or not package or not version:
        raise ReleaseError(f"tag {tag!r} does not look like <package>-v<version> (e.g. npu-quant-v0.2.0)")
    name = canonicalize_name(package)
    member = workspace.members.get(name)
    if member is None or member.path.parent.name != "packages":
        known = ", ".join(sorted(m.name for m in workspace.members.values() if not m.private))
        raise ReleaseError(f"tag {tag!r} names package {package!r}, which is not a workspace package; known: {known}")
    if member.private:
        raise ReleaseError(f"tag {tag!r}: {package} is private (Private :: Do Not Upload) and is never released")
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise ReleaseError(f"tag {tag!r}: {version!r} is not a PEP 440 version") from None
    if parsed != Version(member.version):
        where = member.version_file.relative_to(workspace.root) if member.version_file else "pyproject.toml"
        raise ReleaseError(
            f"tag {tag!r} says {package} {version} but {where} says {member.version}: "
            "bump the version in the tree (and merge) before tagging, or fix the tag"
        )
    return {"package": member.name, "version": str(parsed), "dir": str(member.path.relative_to(workspace.root))}


# --- built artifacts ------------------------------------------------------------------------------------------


def check_built(package: str, version: str, dist: Path) -> Path:
    """The one wheel of ``package`` in ``dist``; raises unless its name and METADATA say ``version``."""
    name = canonicalize_name(package)
    wheels = [p for p in sorted(dist.glob("*.whl")) if parse_wheel_filename(p.name)[0] == name]
    if len(wheels) != 1:
        raise ReleaseError(f"expected exactly one {name} wheel in {dist}, found {[w.name for w in wheels] or 'none'}")
    wheel = wheels[0]
    built = parse_wheel_filename(wheel.name)[1]
    if built != Version(version):
        raise ReleaseError(f"tag version {version} does not match the built wheel {wheel.name} (version {built})")
    headers = wheel_metadata(wheel)
    if Version(headers["Version"]) != Version(version) or canonicalize_name(headers["Name"]) != name:
        raise ReleaseError(
            f"{wheel.name}: METADATA says {headers['Name']} {headers['Version']}, expected {name} {version}"
        )
    return wheel


def wheel_metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as archive:
        metadata_path = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA")), None)
        if metadata_path is None:
            raise ReleaseError(f"{wheel.name} has no METADATA")
        return HeaderParser().parsestr(archive.read(metadata_path).decode())


def admits(wheel: Path, requirement: str, version: str) -> bool:
    """Whether ``wheel`` requires ``requirement`` with a range that contains ``version`` (unconditionally)."""
    name = canonicalize_name(requirement)
    for raw in wheel_metadata(wheel).get_all("Requires-Dist") or []:
        req = Requirement(raw)
        if canonicalize_name(req.name) == name and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return req.specifier.contains(version, prereleases=True)
    raise ReleaseError(f"{wheel.name} does not require {requirement}")


def notes_from_text(text: str, version: str) -> str | None:
    """The section of ``version`` in a changelog's text (heading ``## <version>`` or ``## Version <version> ...``)."""
    lines = text.splitlines()
    wanted = Version(version)
    start = None
    for i, line in enumerate(lines):
        if line.startswith("## "):
            if start is not None:
                return "\n".join(lines[start:i]).strip() + "\n"
            words = line[3:].replace("Version ", "").split()
            try:
                if words and Version(words[0]) == wanted:
                    start = i + 1
            except InvalidVersion:
                continue
    return None if start is None else "\n".join(lines[start:]).strip() + "\n"


def release_notes(package: str, version: str, workspace: Workspace) -> str:
    """The CHANGELOG section of ``version`` (heading ``## <version>`` or ``## Version <version> ...``)."""
    member = workspace.members.get(canonicalize_name(package))
    if member is None:
        raise ReleaseError(f"{package!r} is not a workspace member")
    changelog = member.path / "CHANGELOG.md"
    notes = notes_from_text(changelog.read_text(), version)
    if notes is None:
        raise ReleaseError(
            f"{changelog.relative_to(workspace.root)} has no '## {version}' section: move the Unreleased entries "
            "under a heading for this version before tagging"
        )
    return notes


# --- affected packages ----------------------------------------------------------------------------------------

# Changes here can break any package: the workspace config and lock, CI, release logic, shared tests and test support.
_EVERYTHING_FILES = ("pyproject.toml", "uv.lock")
_EVERYTHING_DIRS = (".github/", ".ci/", "scripts/", "tests/", "testkit/", "benchmarks/")
_DOC_SUFFIXES = (".md", ".rst", ".txt")


def affected(paths: list[str], workspace: Workspace) -> list[str]:
    publishable = sorted(m.name for m in workspace.members.values() if m.path.parent.name == "packages")
    result: set[str] = set()
    for raw in paths:
        path = raw.strip()
        path = path[2:] if path.startswith("./") else path
        if not path:
            continue
        parts = path.split("/")
        if parts[0] == "packages" and len(parts) >= 2:
            member = workspace.member_for_dir(parts[1])
            if member is None:
                raise ReleaseError(
                    f"{path}: packages/{parts[1]} is not a workspace member (no pyproject.toml with a [project] name); "
                    "add it to the workspace or fix the path"
                )
            result |= workspace.affected_by(member.name)
        elif path in _EVERYTHING_FILES or path.startswith(_EVERYTHING_DIRS):
            return publishable
        elif "/" not in path and path.endswith(_DOC_SUFFIXES):
            continue  # top-level docs
        else:
            return publishable  # anything unexpected at the root: test everything rather than nothing
    return sorted(n for n in result if n in publishable)


def changed_files(base: str, root: Path) -> list[str]:
    out = subprocess.run(
        ["git", "diff", "--name-only", f"{base}...HEAD"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    return [line for line in out.splitlines() if line]


def dependents(package: str, workspace: Workspace) -> list[str]:
    name = canonicalize_name(package)
    if name not in workspace.members:
        raise ReleaseError(f"{package!r} is not a workspace member")
    return sorted(d for d in workspace.dependents()[name] if not workspace.members[d].private)


# --- command line ---------------------------------------------------------------------------------------------


def _emit(values: dict[str, str]) -> None:
    for key, value in values.items():
        print(f"{key}={value}")


def build_parser() -> argparse.ArgumentParser:
    """The command line (check_workflows.py parses the workflows' calls with it)."""
    parser = argparse.ArgumentParser(prog="release.py", description="Release and CI logic of the workspace.")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    p_tag = sub.add_parser("tag", help="parse and validate a release tag")
    p_tag.add_argument("tag")
    p_built = sub.add_parser("check-built", help="check the built wheel's version against the tag")
    p_built.add_argument("--package", required=True)
    p_built.add_argument("--version", required=True)
    p_built.add_argument("--dist", type=Path, required=True)
    p_aff = sub.add_parser("affected", help="packages affected by a change")
    p_aff.add_argument("--base", help="git ref to diff against (merge base ...HEAD)")
    p_aff.add_argument("paths", nargs="*")
    p_dep = sub.add_parser("dependents", help="publishable members that require PACKAGE")
    p_dep.add_argument("package")
    p_adm = sub.add_parser("admits", help="does a wheel's requirement admit a version")
    p_adm.add_argument("--wheel", type=Path, required=True)
    p_adm.add_argument("--requirement", required=True)
    p_adm.add_argument("--version", required=True)
    p_notes = sub.add_parser("notes", help="the CHANGELOG section of a version")
    p_notes.add_argument("--package", required=True)
    p_notes.add_argument("--version", required=True)
    p_log = sub.add_parser("changelog", help="every package whose code changed has an Unreleased line")
    p_log.add_argument("--base", help="git ref: changes since the merge base with it (default: since release tags)")
    p_dry = sub.add_parser("dry-run", help="release one package end to end without publishing")
    p_dry.add_argument("--package", required=True)
    p_dry.add_argument("--version", help="the version to release (default: the in-tree one)")
    p_dry.add_argument("--dist", type=Path, default=Path("dist"), help="where the sdist and wheel go")
    p_dry.add_argument("--siblings", type=Path, help="wheels of the other packages (default: built here)")
    p_dry.add_argument(
        "--tagged", action="store_true", help="the tag is pushed (release.yml): the changelog must be in released shape"
    )
    sub.add_parser("graph", help="print the dependency graph")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    try:
        workspace = Workspace(args.root)
        if args.command == "tag":
            _emit(parse_tag(args.tag, workspace))
        elif args.command == "check-built":
            wheel = check_built(args.package, args.version, args.dist)
            _emit({"wheel": str(wheel)})
        elif args.command == "affected":
            paths = list(args.paths) + (changed_files(args.base, args.root) if args.base else [])
            _emit({"packages": json.dumps(affected(paths, workspace))})
        elif args.command == "dependents":
            _emit({"packages": json.dumps(dependents(args.package, workspace))})
        elif args.command == "admits":
            _emit({"admits": str(admits(args.wheel, args.requirement, args.version)).lower()})
        elif args.command == "notes":
            print(release_notes(args.package, args.version, workspace), end="")
        elif args.command == "changelog":
            return _changelog_command(workspace, args.base)
        elif args.command == "dry-run":
            _dry_run.dry_run(args.package, workspace, args.dist, args.version, args.siblings, args.tagged)
        elif args.command == "graph":
            for sib_owner in sorted(workspace.members):
                targets = sorted({s.target for s in workspace.sibling_requirements() if s.owner == sib_owner})
                print(f"{sib_owner} -> {', '.join(targets) or '(none)'}")
    except (ReleaseError, _changelog.ChangelogError, _dry_run.DryRunError) as exc:
        print(f"ERROR {exc}", file=sys.stderr)
        return 1
    return 0


def _changelog_command(workspace: Workspace, base: str | None) -> int:
    findings = _changelog.check(workspace, base)
    for f in findings:
        changed = "all of it unreleased" if f.changed < 0 else f"{f.changed} code file(s) changed"
        print(f"{f.package}: since {f.since}: {changed}: {'OK' if f.problem is None else 'MISSING'}")
    problems = [f.problem for f in findings if f.problem]
    for problem in problems:
        print(f"ERROR {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
