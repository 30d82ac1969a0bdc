# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The packages' CHANGELOG.md files and the rule that every code change is in one (used by release.py).

A changelog has one ``## Unreleased`` section whose entries are top-level bullets (``- ...``; continuation lines are
part of the entry above), then one ``## <version> ...`` section per release, newest first. Releasing moves the
Unreleased entries under ``## <version> (<date>)`` and leaves an empty ``## Unreleased``.

The rule (``release.py changelog``): a package whose code changed must say so under ``## Unreleased``. What "changed"
is measured against:

- without ``--base`` (the suite, ``.ci/run``): the package's last release tag ``<dist>-v<version>`` reachable from
  HEAD. Code changed since that tag -> at least one Unreleased entry. A package never released has no tag: all of
  its code is unreleased, so its Unreleased section must not be empty (it is the first release's notes).
- with ``--base REF`` (ci.yml on a pull request): the merge base of REF and HEAD. Code changed since then -> the
  Unreleased section itself changed in the same diff and is not empty (OTel's / logfire's per-pull-request rule).

"Code" is what a user installs: ``src/`` and ``pyproject.toml`` of the package; tests, README and the changelog
itself are not. Both modes compare with the working tree, so uncommitted work counts. They need the history and
the tags: a shallow clone is refused with the command that fixes it (CI checks out with ``fetch-depth: 0``; a plain
``git clone``, which .ci/run runs on, has both).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from _workspace import Member, Workspace
from packaging.version import InvalidVersion, Version

UNRELEASED = "## Unreleased"
#: The parts of a package that users install: a change there needs a changelog line.
CODE_PATHS = ("src", "pyproject.toml")


class ChangelogError(Exception):
    """The changelog rule cannot be checked here (no git, a shallow clone); the message says what to do."""


def section(text: str, heading: str = UNRELEASED) -> list[str] | None:
    """The lines of the section under ``heading`` (to the next ``## `` heading), or None if it is missing."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == heading:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
            return lines[i + 1 : end]
    return None


def entries(text: str) -> list[str]:
    """The Unreleased entries, one string each (a bullet with its continuation lines)."""
    found: list[str] = []
    for line in section(text) or []:
        if line.startswith(("- ", "* ")):
            found.append(line)
        elif line.strip() and found and line.startswith(" "):
            found[-1] += "\n" + line
    return found


def version_heading(lines: list[str], version: str) -> int | None:
    """The index of the ``## <version> ...`` (or ``## Version <version> ...``) heading, if there is one."""
    wanted = Version(version)
    for i, line in enumerate(lines):
        words = line[3:].replace("Version ", "").split() if line.startswith("## ") else []
        try:
            if words and Version(words[0]) == wanted:
                return i
        except InvalidVersion:
            continue
    return None


def move_unreleased(text: str, version: str, date: str) -> str:
    """``text`` as the release commit of ``version`` leaves it: the Unreleased entries under ``## <version> (<date>)``,
    or on top of an existing ``## <version>`` section (one written but never tagged), and ``## Unreleased`` empty."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == UNRELEASED), None)
    if start is None:
        raise ChangelogError(f"no '{UNRELEASED}' section")
    end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
    body = list(lines[start + 1 : end])
    while body and not body[0].strip():
        body.pop(0)
    while body and not body[-1].strip():
        body.pop()
    rest = lines[end:]
    existing = version_heading(rest, version)
    if existing is None:
        rest = [f"## {version} ({date})", "", *body, "", *rest]
    elif body:
        rest = [*rest[: existing + 1], "", *body, *rest[existing + 1 :]]
    return "\n".join([*lines[:start], UNRELEASED, "", *rest]).rstrip("\n") + "\n"


# --- git ------------------------------------------------------------------------------------------------------


def git(root: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ChangelogError(f"git {' '.join(args)} failed in {root}: {proc.stderr.strip()}")
    return proc.stdout


def require_history(root: Path) -> None:
    try:
        shallow = git(root, "rev-parse", "--is-shallow-repository").strip()
    except ChangelogError as exc:
        raise ChangelogError(f"the changelog check needs a git checkout with its history: {exc}") from None
    if shallow == "true":
        raise ChangelogError(
            "this is a shallow clone: the changelog check needs the release tags and the history since them; run "
            "`git fetch --unshallow --tags` (GitHub Actions: actions/checkout with fetch-depth: 0)"
        )


def last_release_tag(root: Path, member: Member) -> str | None:
    """The newest tag ``<dist>-v<version>`` of ``member`` that HEAD contains, or None if it was never released."""
    best: tuple[Version, str] | None = None
    for tag in git(root, "tag", "--list", f"{member.name}-v*", "--merged", "HEAD").split():
        try:
            version = Version(tag.rpartition("-v")[2])
        except InvalidVersion:
            continue
        if best is None or version > best[0]:
            best = (version, tag)
    return best[1] if best else None


def _code_changed(root: Path, member: Member, since: str) -> list[str]:
    rel = member.path.relative_to(root)
    paths = [str(rel / p) for p in CODE_PATHS]
    return git(root, "diff", "--name-only", since, "--", *paths).split()


def _changelog_at(root: Path, member: Member, ref: str) -> str:
    rel = (member.path / "CHANGELOG.md").relative_to(root)
    try:
        return git(root, "show", f"{ref}:{rel.as_posix()}")
    except ChangelogError:
        return ""  # the package or its changelog is new since ref


@dataclass(frozen=True)
class Finding:
    package: str
    since: str  # a tag, a commit, or "(never released)"
    changed: int  # code files changed since then
    problem: str | None


def check_member(root: Path, member: Member, base: str | None) -> Finding:
    changelog = member.path / "CHANGELOG.md"
    rel = changelog.relative_to(root)
    if not changelog.is_file():
        return Finding(member.name, "-", 0, f"{rel} is missing")
    text = changelog.read_text()
    if section(text) is None:
        return Finding(member.name, "-", 0, f"{rel} has no '{UNRELEASED}' section")
    now = entries(text)
    if base is not None:
        since = git(root, "merge-base", base, "HEAD").strip()
        changed = _code_changed(root, member, since)
        if changed and (not now or entries(_changelog_at(root, member, since)) == now):
            return Finding(
                member.name,
                since[:12],
                len(changed),
                f"{member.name}: {len(changed)} code file(s) changed since {base} ({', '.join(changed[:3])}"
                f"{', ...' if len(changed) > 3 else ''}) but '{UNRELEASED}' in {rel} did not -> add a line saying "
                "what changed for users",
            )
        return Finding(member.name, since[:12], len(changed), None)
    tag = last_release_tag(root, member)
    if tag is None:
        problem = (
            None
            if now
            else (
                f"{member.name} was never released (no tag {member.name}-v*), so all of it is unreleased, but "
                f"'{UNRELEASED}' in {rel} is empty -> list what the first release brings"
            )
        )
        return Finding(member.name, "(never released)", -1, problem)
    changed = _code_changed(root, member, tag)
    if changed and not now:
        return Finding(
            member.name,
            tag,
            len(changed),
            f"{member.name}: {len(changed)} code file(s) changed since {tag} ({', '.join(changed[:3])}"
            f"{', ...' if len(changed) > 3 else ''}) but '{UNRELEASED}' in {rel} is empty -> add a line",
        )
    return Finding(member.name, tag, len(changed), None)


def check(workspace: Workspace, base: str | None = None) -> list[Finding]:
    """One finding per publishable package (``packages/*``, not private)."""
    require_history(workspace.root)
    members = [m for m in workspace.members.values() if m.path.parent.name == "packages" and not m.private]
    return [check_member(workspace.root, m, base) for m in sorted(members, key=lambda m: m.name)]
