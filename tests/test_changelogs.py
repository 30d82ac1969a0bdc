# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The changelog rule (``release.py changelog``, scripts/_changelog.py): a package whose code changed since its last
release tag, or since a pull request's base, has a line under ``## Unreleased``. On throwaway git repositories,
and on this one (the suite runs from a clone with its history: .ci/run's clean `git clone`, CI's fetch-depth 0)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _script_loader import load_script  # noqa: E402

release = load_script("release")
changelog = load_script("_changelog")

REPO = Path(__file__).resolve().parent.parent
HEADER = "# Changelog\n\n"


def git(root: Path, *args: str) -> str:
    env_args = ["-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false"]
    return subprocess.run(["git", *env_args, *args], cwd=root, check=True, capture_output=True, text=True).stdout


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def package(root: Path, name: str, unreleased: str = "", released: str = "") -> None:
    sub = name.removeprefix("npu-")
    write(
        root / "packages" / name / "pyproject.toml",
        f"""
        [project]
        name = "{name}"
        dynamic = ["version"]
        [tool.hatch.version]
        path = "src/vllm_npu/{sub}/_version.py"
        """,
    )
    write(root / "packages" / name / f"src/vllm_npu/{sub}/_version.py", '__version__ = "0.1.0"\n')
    write(root / "packages" / name / f"src/vllm_npu/{sub}/core.py", "X = 1\n")
    write(root / "packages" / name / "tests/test_core.py", "def test(): pass\n")
    set_changelog(root, name, unreleased, released)


def set_changelog(root: Path, name: str, unreleased: str, released: str = "") -> None:
    text = HEADER + "## Unreleased\n\n" + unreleased + ("\n## 0.1.0\n\n" + released if released else "")
    (root / "packages" / name / "CHANGELOG.md").write_text(text)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """Two packages, committed: npu-a with one Unreleased entry, npu-b with an empty Unreleased section."""
    write(tmp_path / "pyproject.toml", '[tool.uv.workspace]\nmembers = ["packages/*"]\n')
    package(tmp_path, "npu-a", unreleased="- first\n")
    package(tmp_path, "npu-b")
    git(tmp_path, "init", "-q", "-b", "main")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "start")
    return tmp_path


def problems(root: Path, base: str | None = None) -> dict[str, str | None]:
    return {f.package: f.problem for f in changelog.check(release.Workspace(root), base)}


def commit(root: Path, message: str) -> None:
    git(root, "add", "-A")
    git(root, "commit", "-qm", message)


def release_b(root: Path) -> None:
    """npu-b 0.1.0 released: its changelog has the section, the tag points at the release commit."""
    set_changelog(root, "npu-b", "", released="- what 0.1.0 brought\n")
    commit(root, "release npu-b 0.1.0")
    git(root, "tag", "npu-b-v0.1.0")


def test_never_released_needs_unreleased_entries(repo: Path) -> None:
    found = problems(repo)
    assert found["npu-a"] is None
    assert found["npu-b"] == (
        "npu-b was never released (no tag npu-b-v*), so all of it is unreleased, but '## Unreleased' in "
        "packages/npu-b/CHANGELOG.md is empty -> list what the first release brings"
    )


def test_since_the_release_tag(repo: Path) -> None:
    release_b(repo)
    assert problems(repo)["npu-b"] is None  # nothing changed since the tag
    (repo / "packages/npu-b/tests/test_core.py").write_text("def test(): assert True\n")
    (repo / "packages/npu-b/README.md").write_text("docs\n")
    commit(repo, "tests and docs only")
    assert problems(repo)["npu-b"] is None  # not code users install
    (repo / "packages/npu-b/src/vllm_npu/b/core.py").write_text("X = 2\n")
    commit(repo, "a code change")
    assert problems(repo)["npu-b"] == (
        "npu-b: 1 code file(s) changed since npu-b-v0.1.0 (packages/npu-b/src/vllm_npu/b/core.py) but "
        "'## Unreleased' in packages/npu-b/CHANGELOG.md is empty -> add a line"
    )
    set_changelog(repo, "npu-b", "- X is 2 now\n", released="- what 0.1.0 brought\n")
    assert problems(repo)["npu-b"] is None  # uncommitted work counts too


def test_a_dependency_change_is_a_code_change(repo: Path) -> None:
    release_b(repo)
    with (repo / "packages/npu-b/pyproject.toml").open("a") as handle:
        handle.write('dependencies = ["pydantic>=2"]\n')
    assert "1 code file(s) changed since npu-b-v0.1.0 (packages/npu-b/pyproject.toml)" in problems(repo)["npu-b"]


def test_the_newest_tag_that_head_contains(repo: Path) -> None:
    release_b(repo)
    (repo / "packages/npu-b/src/vllm_npu/b/core.py").write_text("X = 2\n")
    set_changelog(repo, "npu-b", "", released="- X is 2\n")
    commit(repo, "release npu-b 0.1.1")
    git(repo, "tag", "npu-b-v0.1.1")
    git(repo, "tag", "npu-b-vnext")  # not a version: ignored
    git(repo, "checkout", "-q", "-b", "other", "HEAD~1")
    git(repo, "tag", "npu-b-v9.0.0", "main")  # on main but at the same commit as 0.1.1: HEAD (other) lacks it
    finding = {f.package: f for f in changelog.check(release.Workspace(repo))}["npu-b"]
    assert finding.since == "npu-b-v0.1.0"
    git(repo, "checkout", "-q", "main")
    finding = {f.package: f for f in changelog.check(release.Workspace(repo))}["npu-b"]
    assert finding.since == "npu-b-v9.0.0" and finding.problem is None


def test_pull_request_mode_needs_a_new_line(repo: Path) -> None:
    git(repo, "checkout", "-q", "-b", "feature")
    (repo / "packages/npu-a/src/vllm_npu/a/core.py").write_text("X = 3\n")
    commit(repo, "change npu-a")
    # npu-a already had an entry, but this change did not add one.
    found = problems(repo, base="main")
    assert found["npu-a"] is not None and "changed since main" in found["npu-a"] and "did not" in found["npu-a"]
    assert found["npu-b"] is None  # untouched (its empty section is the tag mode's business)
    set_changelog(repo, "npu-a", "- first\n- X is 3\n")
    commit(repo, "changelog")
    assert problems(repo, base="main") == {"npu-a": None, "npu-b": None}


def test_cli(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert release.main(["--root", str(repo), "changelog"]) == 1
    out, err = capsys.readouterr()
    assert "npu-a: since (never released): all of it unreleased: OK" in out
    assert "npu-b: since (never released): all of it unreleased: MISSING" in out
    assert err.startswith("ERROR npu-b was never released")


def test_a_shallow_clone_is_refused_with_the_fix(repo: Path, tmp_path: Path) -> None:
    (repo / "packages/npu-a/src/vllm_npu/a/core.py").write_text("X = 4\n")
    commit(repo, "second")
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{repo}", str(clone))
    with pytest.raises(changelog.ChangelogError, match=r"shallow clone.*fetch-depth: 0"):
        changelog.check(release.Workspace(clone))


def test_move_unreleased_is_what_the_release_commit_does() -> None:
    text = HEADER + "## Unreleased\n\n- one\n- two\n  continued\n\n## 0.1.0\n\n- old\n"
    moved = changelog.move_unreleased(text, "0.2.0", "2026-12-05")
    assert (
        moved == HEADER + "## Unreleased\n\n## 0.2.0 (2026-12-05)\n\n- one\n- two\n  continued\n\n## 0.1.0\n\n- old\n"
    )
    assert changelog.entries(moved) == []
    assert release.notes_from_text(moved, "0.2.0") == "- one\n- two\n  continued\n"
    # A version section written but never tagged (this repository's 0.1.0) takes the entries on top.
    merged = changelog.move_unreleased(text, "0.1.0", "2026-12-05")
    assert release.notes_from_text(merged, "0.1.0") == "- one\n- two\n  continued\n\n- old\n"
    assert changelog.entries(text) == ["- one", "- two\n  continued"]


def test_this_repository() -> None:
    """Every package of this tree: code changed since its last release tag (none is tagged yet: all of it) has a
    line under Unreleased."""
    findings = changelog.check(release.Workspace(REPO))
    assert len(findings) == 8
    assert [f.problem for f in findings if f.problem] == []
