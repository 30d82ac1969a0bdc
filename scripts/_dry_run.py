# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A release of one package, end to end, without publishing (``release.py dry-run``; used by release.py).

The steps are the release workflow's ``build`` job, in its order, so that CI runs what a tag push would:

1. version: the tag ``<dist>-v<version>`` matches release.yml's tag pattern and ``release.py tag`` accepts it
   (a public package of the workspace, the in-tree ``_version.py``); an existing tag of that version is reported
   (with ``--tagged`` it must point at the commit being built);
2. sibling ranges admit the in-tree versions (check_workspace_ranges.py);
3. the changelog entry: the ``## <version>`` section, or (before the release commit moved them) the Unreleased
   entries as the release will show them; empty is an error;
4. build: ``uv build --package <dist> --no-sources`` (sdist, then the wheel from the sdist) and the built version;
5. smoke installs into fresh venvs, siblings from wheels of the same commit: the wheel alone, then with each extra
   whose requirements are workspace packages; each runs ``scripts/smoke_wheel.py`` (imports, entry points, no
   torch / vLLM imported), checks the installed versions and runs every console script with ``--help``. Extras that
   pull a host-specific third-party build (torch-npu, vLLM, a Mooncake build) are named, not installed.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import _changelog
import _workflow_rules as rules
from _workspace import Member, Workspace
from packaging.utils import canonicalize_name, parse_sdist_filename

SMOKE = Path(__file__).resolve().parent / "smoke_wheel.py"


class DryRunError(Exception):
    """A release step failed; the message names the step and the fix."""


def run_uv(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """uv from its cache first (everything is there after ``uv sync``), from the network if the cache is cold."""
    uv = shutil.which("uv")
    if uv is None:
        raise DryRunError("uv is not on PATH (https://docs.astral.sh/uv/; .ci/run installs it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_PROJECT"))}
    proc = subprocess.run([uv, *args, "--offline"], cwd=cwd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 and ("offline" in proc.stderr.lower() or "network" in proc.stderr.lower()):
        proc = subprocess.run([uv, *args], cwd=cwd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise DryRunError(f"uv {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
    return proc


def extra_targets(member: Member, extra: str | None, workspace: Workspace) -> tuple[set[str], list[str]]:
    """The workspace packages ``member[extra]`` (``extra=None``: ``member`` alone) installs besides ``member``,
    followed through their requirements and the extras they ask of each other, and the third-party requirements
    that come with extras (``torch-npu``, a Mooncake build)."""
    siblings: set[str] = set()
    others: list[str] = []
    todo: list[tuple[str, str | None]] = [(member.name, extra), (member.name, None)]
    seen: set[tuple[str, str | None]] = set()
    while todo:
        item = todo.pop()
        if item in seen:
            continue
        seen.add(item)
        name, wanted = item
        current = workspace.members[name]
        for req in current.extras.get(wanted, []) if wanted is not None else current.requirements:
            target = canonicalize_name(req.name)
            if target in workspace.members:
                if target != member.name:
                    siblings.add(target)
                todo.append((target, None))
                todo.extend((target, e) for e in sorted(req.extras))
            elif wanted is not None:
                others.append(str(req))
    return siblings, sorted(others)


def console_scripts(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next((n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")), None)
        if name is None:
            return []
        text = archive.read(name).decode()
    scripts, in_group = [], False
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            in_group = line == "[console_scripts]"
        elif in_group and "=" in line:
            scripts.append(line.split("=", 1)[0].strip())
    return scripts


def _smoke(
    wheel: Path, extra: str | None, expect: dict[str, str], links: Path, work: Path, say: Callable[[str], None]
) -> None:
    label = f"{wheel.name}[{extra}]" if extra else wheel.name
    venv = work / f"venv-{extra or 'alone'}"
    run_uv("venv", "-q", "--python", sys.executable, str(venv), cwd=work)
    python = venv / "bin" / "python"
    spec = f"{expect_name(wheel)}[{extra}] @ {wheel.resolve().as_uri()}" if extra else str(wheel.resolve())
    run_uv("pip", "install", "-q", "--python", str(python), "--find-links", str(links), spec, cwd=work)
    smoke = subprocess.run(
        [str(python), "-I", str(SMOKE), *[a for d in expect for a in ("--expect", d)]],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON", "VIRTUAL_ENV"))},
    )
    if smoke.returncode != 0:
        raise DryRunError(f"smoke test of {label} failed:\n{smoke.stdout}{smoke.stderr}")
    listed = subprocess.run(
        [
            str(python),
            "-I",
            "-c",
            "import importlib.metadata as m\nfor d in m.distributions(): print(d.metadata['Name'] + '==' + d.version)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    ours = {canonicalize_name(n): v for n, _, v in (x.partition("==") for x in listed) if n.startswith("npu-")}
    if ours != expect:
        raise DryRunError(f"{label} installed {ours}, expected exactly {expect}")
    for script in console_scripts(wheel):
        proc = subprocess.run([str(venv / "bin" / script), "--help"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise DryRunError(f"{label}: `{script} --help` exited {proc.returncode}:\n{proc.stderr}")
    say(f"  smoke install {label}: {', '.join(f'{k} {v}' for k, v in sorted(ours.items()))} -- OK")


def expect_name(wheel: Path) -> str:
    return wheel.name.split("-", 1)[0].replace("_", "-")


def dry_run(
    package: str,
    workspace: Workspace,
    dist: Path,
    version: str | None = None,
    siblings: Path | None = None,
    released: bool = False,
    say: Callable[[str], None] = print,
) -> Path:
    """Run the release of ``package`` up to (not including) publishing; returns the built wheel. ``released``: the
    release workflow for a pushed tag (the changelog must already be in its released shape)."""
    import check_workspace_ranges

    member = workspace.members.get(canonicalize_name(package))
    if member is None:
        raise DryRunError(f"{package!r} is not a workspace member")
    version = version or member.version
    dist = dist.resolve()  # uv builds from the workspace root; the caller's relative path is from its cwd
    tag = _step_version(member, version, workspace, released, say)
    problems = check_workspace_ranges.check(workspace)
    if problems:
        raise DryRunError("sibling ranges do not admit the in-tree versions:\n" + "\n".join(problems))
    say("2. sibling ranges admit the in-tree versions")
    _step_changelog(member, version, tag, workspace.root, released, say)
    wheel = _step_build(member, version, workspace.root, dist, say)
    with tempfile.TemporaryDirectory(prefix="release-dry-run-") as tmp:
        _step_smoke(member, version, wheel, workspace, siblings, Path(tmp), say)
    say(f"dry run of {tag}: every step passed; nothing was published ({wheel.name} is in {dist})")
    return wheel


def _step_version(
    member: Member, version: str, workspace: Workspace, released: bool, say: Callable[[str], None]
) -> str:
    """1. The tag starts release.yml and ``release.py tag`` accepts it; returns the tag."""
    import release

    root = workspace.root
    tag = f"{member.name}-v{version}"
    patterns = rules.release_tag_patterns(rules.Workflow.load(root / ".github" / "workflows" / "release.yml"))
    if not any(rules.glob_to_regex(p).match(tag) for p in patterns):
        raise DryRunError(f"the tag {tag} matches no tag pattern of release.yml {patterns}: no release would start")
    try:
        release.parse_tag(tag, workspace)
    except release.ReleaseError as exc:  # `release` here may be another copy of the module than the caller's
        raise DryRunError(str(exc)) from None
    say(f"1. version: tag {tag} starts release.yml and names {member.name} {version} (== {_where(member, root)})")
    if _changelog.git(root, "tag", "--list", tag).split():
        tagged = _changelog.git(root, "rev-list", "-n", "1", tag).strip()
        if tagged == _changelog.git(root, "rev-parse", "HEAD").strip():
            say(f"   {tag} points at this commit (the release being built)")
        elif released:
            raise DryRunError(f"{tag} points at {tagged[:12]}, not at the commit being built")
        else:
            say(f"   note: {tag} already exists (at {tagged[:12]}): a real release needs a version bump first")
    return tag


def _step_changelog(
    member: Member, version: str, tag: str, root: Path, released: bool, say: Callable[[str], None]
) -> None:
    """3. The changelog rule holds for the package, and the release has notes."""
    finding = _changelog.check_member(root, member, None)
    if finding.problem:
        raise DryRunError(finding.problem)
    notes = _release_notes(member, version, released)
    shape = "as pushed" if released else "after the release commit moves the Unreleased entries"
    say(f"3. changelog: every code change since {finding.since} has a line; the release notes of {tag} ({shape}):")
    say("\n".join(f"   | {line[:110]}" for line in notes.splitlines()[:12]))
    if len(notes.splitlines()) > 12:
        say(f"   | ... ({len(notes.splitlines())} lines)")


def _step_build(member: Member, version: str, root: Path, dist: Path, say: Callable[[str], None]) -> Path:
    """4. ``uv build --package <dist> --no-sources``: one sdist and one wheel of the version; returns the wheel."""
    import release

    dist.mkdir(parents=True, exist_ok=True)
    run_uv("build", "--package", member.name, "--no-sources", "-o", str(dist), cwd=root)
    try:
        wheel = release.check_built(member.name, version, dist)
    except release.ReleaseError as exc:
        raise DryRunError(str(exc)) from None
    sdists = [p for p in dist.glob("*.tar.gz") if parse_sdist_filename(p.name)[0] == member.name]
    if len(sdists) != 1 or str(parse_sdist_filename(sdists[0].name)[1]) != str(release.Version(version)):
        raise DryRunError(f"expected one sdist of {member.name} {version} in {dist}, found {[s.name for s in sdists]}")
    say(f"4. built {sdists[0].name} and, from it, {wheel.name}")
    return wheel


def _step_smoke(
    member: Member,
    version: str,
    wheel: Path,
    workspace: Workspace,
    siblings: Path | None,
    work: Path,
    say: Callable[[str], None],
) -> None:
    """5. Fresh venvs: the wheel alone, then with each extra of workspace packages (siblings: wheels of this tree)."""
    import release

    links = work / "links"
    links.mkdir()
    if siblings is None:
        siblings = work / "siblings"
        run_uv("build", "--all-packages", "--no-sources", "--wheel", "-o", str(siblings), cwd=workspace.root)
    for other in siblings.glob("*.whl"):
        if canonicalize_name(expect_name(other)) != member.name:
            shutil.copy(other, links)
    say(f"5. smoke installs (siblings from {siblings})")
    base = {member.name: str(release.Version(version))}
    base |= {t: workspace.members[t].version for t in extra_targets(member, None, workspace)[0]}
    _smoke(wheel, None, base, links, work, say)
    for extra in sorted(member.extras):
        targets, others = extra_targets(member, extra, workspace)
        if others:
            say(f"  [{extra}] not installed: it pulls {', '.join(others)} (host-specific builds)")
            continue
        _smoke(wheel, extra, base | {t: workspace.members[t].version for t in targets}, links, work, say)


def _where(member: Member, root: Path) -> str:
    return str(member.version_file.relative_to(root)) if member.version_file else "pyproject.toml"


def _release_notes(member: Member, version: str, released: bool) -> str:
    """The notes the GitHub release of ``version`` gets. ``released``: the tag is pushed, so the changelog must be in
    its released shape; otherwise the release commit is simulated (Unreleased entries moved under the version)."""
    import release

    text = (member.path / "CHANGELOG.md").read_text()
    pending = _changelog.entries(text)
    if released:
        if pending:
            raise DryRunError(
                f"{member.name}: {len(pending)} entries are still under '## Unreleased' of its CHANGELOG.md: the "
                f"release commit moves them under '## {version}' (CONTRIBUTING.md, Releasing)"
            )
        notes = release.notes_from_text(text, version)
        if notes is None:
            raise DryRunError(f"{member.name}: its CHANGELOG.md has no '## {version}' section")
        return notes
    moved = _changelog.move_unreleased(text, version, datetime.date.today().isoformat()) if pending else text
    notes = release.notes_from_text(moved, version)
    if not (notes or "").strip():
        raise DryRunError(
            f"{member.name}: no entries under '## Unreleased' of its CHANGELOG.md and no '## {version}' section: "
            "a release without notes"
        )
    assert notes is not None
    return notes
