# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""scripts/release.py and scripts/check_workspace_ranges.py on throwaway workspaces (and on this one)."""

from __future__ import annotations

import json
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _script_loader import load_script  # noqa: E402

release = load_script("release")
ranges = load_script("check_workspace_ranges")
Workspace = release.Workspace


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def member(
    root: Path,
    dirname: str,
    name: str,
    version: str,
    deps: list[str] = (),
    extras: dict | None = None,
    sources: list[str] = (),
    private: bool = False,
    where: str = "packages",
) -> None:
    sub = name.removeprefix("npu-").replace("-", "_")
    extras_toml = "".join(f"{k} = {json.dumps(v)}\n" for k, v in (extras or {}).items())
    classifiers = '["Private :: Do Not Upload"]' if private else "[]"
    sources_toml = "".join(f"{s} = {{ workspace = true }}\n" for s in sources)
    write(
        root / where / dirname / "pyproject.toml",
        f"""
        [project]
        name = "{name}"
        dynamic = ["version"]
        classifiers = {classifiers}
        dependencies = {json.dumps(list(deps))}
        [project.optional-dependencies]
        {extras_toml}
        [tool.hatch.version]
        path = "src/vllm_npu/{sub}/_version.py"
        [tool.uv.sources]
        {sources_toml}
    """,
    )
    write(root / where / dirname / f"src/vllm_npu/{sub}/_version.py", f'__version__ = "{version}"\n')


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    """iface <- impl <- plat[impl] (extra), plus a second impl and a private test helper."""
    write(
        tmp_path / "pyproject.toml",
        """
        [tool.uv.workspace]
        members = ["packages/*", "kit"]
    """,
    )
    member(tmp_path, "npu-iface", "npu-iface", "0.3.0", deps=["pydantic>=2"])
    member(tmp_path, "npu-impl", "npu-impl", "0.1.0", deps=["npu-iface>=0.3,<0.4"], sources=["npu-iface"])
    member(tmp_path, "npu-vision", "npu-vision", "1.2.0", deps=["npu-iface>=0.3,<0.4"], sources=["npu-iface"])
    member(
        tmp_path,
        "npu-plat",
        "npu-plat",
        "0.2.0.dev0",
        deps=["npu-iface>=0.3,<0.4"],
        extras={"impl": ["npu-impl>=0.1,<0.2"], "all": ["npu-plat[impl]"]},
        sources=["npu-iface", "npu-impl"],
    )
    write(
        tmp_path / "kit" / "pyproject.toml",
        """
        [project]
        name = "npu-kit"
        version = "0.0.0"
        classifiers = ["Private :: Do Not Upload"]
    """,
    )
    return tmp_path


# --- check_workspace_ranges -----------------------------------------------------------------------------------


def test_consistent_ranges_pass(ws: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ranges.main(["--root", str(ws)]) == 0
    assert "OK: 4 sibling requirements across 5 members" in capsys.readouterr().out


def test_version_outside_a_sibling_range_is_an_error(ws: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(ws / "packages/npu-impl/src/vllm_npu/impl/_version.py", '__version__ = "0.2.0"\n')
    assert ranges.main(["--root", str(ws)]) == 1
    out = capsys.readouterr().out
    assert (
        "ERROR npu-plat (extra 'impl'): requires 'npu-impl<0.2,>=0.1' but workspace npu-impl is 0.2.0 "
        "-> bump the range or the version"
    ) in out


def test_dev_versions_count_as_their_release(ws: Path) -> None:
    write(ws / "packages/npu-iface/src/vllm_npu/iface/_version.py", '__version__ = "0.3.1.dev0"\n')
    assert ranges.check(Workspace(ws)) == []


def test_unbounded_and_unsourced_siblings(ws: Path) -> None:
    member(ws, "npu-extra", "npu-extra", "0.1.0", deps=["npu-iface>=0.3", "npu-impl"])
    errors = ranges.check(Workspace(ws))
    assert any(
        "npu-extra (dependencies): requires 'npu-iface>=0.3' has no upper bound -> add one (e.g. <0.4)" in e
        for e in errors
    )
    assert any("requires 'npu-impl' without a version range" in e for e in errors)
    assert any("lacks npu-iface = { workspace = true }" in e for e in errors)


def test_this_workspace_is_consistent() -> None:
    assert ranges.check(Workspace()) == []


# --- release.py tag -------------------------------------------------------------------------------------------


def test_tag_is_split_at_the_last_dash_v(ws: Path) -> None:
    workspace = Workspace(ws)
    assert release.parse_tag("npu-vision-v1.2.0", workspace) == {
        "package": "npu-vision",
        "version": "1.2.0",
        "dir": "packages/npu-vision",
    }
    assert release.parse_tag("refs/tags/npu-plat-v0.2.0.dev0", workspace)["package"] == "npu-plat"
    assert release.parse_tag("npu-iface-v0.3", workspace)["version"] == "0.3"  # 0.3 == 0.3.0 in PEP 440


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("npu-iface-0.3.0", "does not look like <package>-v<version>"),
        ("npu-iface-v", "does not look like <package>-v<version>"),
        ("npu-nope-v1.0", "names package 'npu-nope', which is not a workspace package; known: npu-iface, npu-impl"),
        ("npu-kit-v0.0.0", "not a workspace package"),
        ("npu-iface-vbanana", "'banana' is not a PEP 440 version"),
        ("npu-iface-v0.3.1", "says npu-iface 0.3.1 but packages/npu-iface/src/vllm_npu/iface/_version.py says 0.3.0"),
    ],
)
def test_bad_tags(ws: Path, tag: str, message: str) -> None:
    with pytest.raises(release.ReleaseError, match=None) as info:
        release.parse_tag(tag, Workspace(ws))
    assert message in str(info.value)


def test_private_member_under_packages_is_never_released(ws: Path) -> None:
    member(ws, "npu-secret", "npu-secret", "0.1.0", private=True)
    with pytest.raises(release.ReleaseError, match="is private"):
        release.parse_tag("npu-secret-v0.1.0", Workspace(ws))


def test_tag_cli(ws: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert release.main(["--root", str(ws), "tag", "npu-impl-v0.1.0"]) == 0
    assert capsys.readouterr().out.splitlines() == ["package=npu-impl", "version=0.1.0", "dir=packages/npu-impl"]
    assert release.main(["--root", str(ws), "tag", "npu-impl-v9"]) == 1
    assert capsys.readouterr().err.startswith("ERROR tag 'npu-impl-v9' says npu-impl 9")


# --- release.py check-built -----------------------------------------------------------------------------------


def fake_wheel(dist: Path, name: str, file_version: str, meta_version: str | None = None) -> Path:
    dist.mkdir(exist_ok=True)
    norm = name.replace("-", "_")
    path = dist / f"{norm}-{file_version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(
            f"{norm}-{file_version}.dist-info/METADATA",
            f"Metadata-Version: 2.4\nName: {name}\nVersion: {meta_version or file_version}\n",
        )
    return path


def test_check_built(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    wheel = fake_wheel(dist, "npu-impl", "0.1.0")
    fake_wheel(dist, "npu-iface", "0.3.0")
    assert release.check_built("npu-impl", "0.1.0", dist) == wheel
    assert release.check_built("npu_impl", "0.1", dist) == wheel
    with pytest.raises(release.ReleaseError, match=r"tag version 0.1.1 does not match the built wheel npu_impl-0.1.0"):
        release.check_built("npu-impl", "0.1.1", dist)
    with pytest.raises(release.ReleaseError, match="expected exactly one npu-plat wheel"):
        release.check_built("npu-plat", "0.2.0", dist)
    fake_wheel(dist, "npu-impl", "0.0.9")
    with pytest.raises(release.ReleaseError, match="found \\['npu_impl-0.0.9"):
        release.check_built("npu-impl", "0.1.0", dist)


def test_check_built_reads_metadata(tmp_path: Path) -> None:
    fake_wheel(tmp_path, "npu-impl", "0.1.0", meta_version="0.1.1")
    with pytest.raises(release.ReleaseError, match="METADATA says npu-impl 0.1.1, expected npu-impl 0.1.0"):
        release.check_built("npu-impl", "0.1.0", tmp_path)


# --- release.py affected / dependents -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("paths", "expected"),
    [
        (["packages/npu-iface/src/vllm_npu/iface/x.py"], ["npu-iface", "npu-impl", "npu-plat", "npu-vision"]),
        (["packages/npu-impl/tests/test_x.py"], ["npu-impl", "npu-plat"]),
        (["./packages/npu-plat/README.md"], ["npu-plat"]),
        (["packages/npu-vision/pyproject.toml", "packages/npu-impl/x"], ["npu-impl", "npu-plat", "npu-vision"]),
        (["README.md", "CONTRIBUTING.md"], []),
        (["uv.lock"], ["npu-iface", "npu-impl", "npu-plat", "npu-vision"]),
        ([".github/workflows/ci.yml"], ["npu-iface", "npu-impl", "npu-plat", "npu-vision"]),
        (["kit/src/x.py"], ["npu-iface", "npu-impl", "npu-plat", "npu-vision"]),
        (["tests/test_e2e.py"], ["npu-iface", "npu-impl", "npu-plat", "npu-vision"]),
        (["some/new/thing.py"], ["npu-iface", "npu-impl", "npu-plat", "npu-vision"]),
        ([], []),
    ],
)
def test_affected(ws: Path, paths: list[str], expected: list[str]) -> None:
    assert release.affected(paths, Workspace(ws)) == expected


def test_unknown_package_path_is_an_error(ws: Path) -> None:
    with pytest.raises(release.ReleaseError, match="packages/npu-new is not a workspace member"):
        release.affected(["packages/npu-impl/x.py", "packages/npu-new/src/x.py"], Workspace(ws))


def test_dependents(ws: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert release.dependents("npu-iface", Workspace(ws)) == ["npu-impl", "npu-plat", "npu-vision"]
    assert release.dependents("npu-impl", Workspace(ws)) == ["npu-plat"]
    assert release.main(["--root", str(ws), "dependents", "npu-iface"]) == 0
    assert capsys.readouterr().out.strip() == 'packages=["npu-impl", "npu-plat", "npu-vision"]'


def test_graph_cli_prints_the_declared_sideways_edges(capsys: pytest.CaptureFixture[str]) -> None:
    assert release.main(["graph"]) == 0
    lines = set(capsys.readouterr().out.splitlines())
    assert "npu-quant -> npu-interface, npu-ops" in lines  # the extra `moe`
    assert "npu-models -> npu-attention, npu-interface, npu-ops" in lines
    assert "npu-interface -> (none)" in lines


def test_this_workspace_graph() -> None:
    workspace = Workspace()
    assert release.dependents("npu-interface", workspace) == [
        "npu-attention",
        "npu-kv",
        "npu-models",
        "npu-ops",
        "npu-patches",
        "npu-platform",
        "npu-quant",
    ]
    assert release.affected(["packages/npu-quant/src/vllm_npu/quant/__init__.py"], workspace) == [
        "npu-platform",
        "npu-quant",
    ]
    # the sideways edges the sources import (tests/test_layering.py checks that every import edge is declared)
    assert release.affected(["packages/npu-ops/src/vllm_npu/ops/moe/layer.py"], workspace) == [
        "npu-models",
        "npu-ops",
        "npu-platform",
        "npu-quant",
    ]
    assert release.affected(["packages/npu-attention/src/vllm_npu/attention/backends/sfa.py"], workspace) == [
        "npu-attention",
        "npu-models",
        "npu-platform",
    ]
    for name, m in workspace.members.items():
        if not m.private:
            assert release.parse_tag(f"{name}-v{m.version}", workspace)["dir"] == f"packages/{name}"


# --- release.py admits / notes --------------------------------------------------------------------------------


def wheel_requiring(dist: Path, *requires: str) -> Path:
    dist.mkdir(exist_ok=True)
    path = dist / "npu_impl-0.1.0-py3-none-any.whl"
    lines = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(
            "npu_impl-0.1.0.dist-info/METADATA", f"Metadata-Version: 2.4\nName: npu-impl\nVersion: 0.1.0\n{lines}"
        )
    return path


def test_admits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheel = wheel_requiring(tmp_path, "safetensors>=0.4", "npu-interface<0.2,>=0.1", "npu-other; extra == 'x'")
    assert release.admits(wheel, "npu-interface", "0.1.7")
    assert release.admits(wheel, "npu_interface", "0.1.8.dev0")
    assert not release.admits(wheel, "npu-interface", "0.2.0")
    with pytest.raises(release.ReleaseError, match="does not require npu-other"):
        release.admits(wheel, "npu-other", "1.0")  # only through an extra
    assert release.main(["admits", "--wheel", str(wheel), "--requirement", "npu-interface", "--version", "0.2"]) == 0
    assert capsys.readouterr().out.strip() == "admits=false"


def test_release_notes(ws: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(
        ws / "packages/npu-impl/CHANGELOG.md",
        """
        # Changelog

        ## Unreleased

        - next thing

        ## Version 0.1.0 (2026-11-30)

        - first thing
        - second thing

        ## 0.0.9

        - old
    """,
    )
    assert release.release_notes("npu-impl", "0.1.0", Workspace(ws)) == "- first thing\n- second thing\n"
    assert release.release_notes("npu-impl", "0.0.9", Workspace(ws)) == "- old\n"
    with pytest.raises(release.ReleaseError, match=r"has no '## 0.2.0' section"):
        release.release_notes("npu-impl", "0.2.0", Workspace(ws))
    assert release.main(["--root", str(ws), "notes", "--package", "npu-impl", "--version", "0.1"]) == 0
    assert capsys.readouterr().out == "- first thing\n- second thing\n"


# --- the workflows wire the scripts up as intended ------------------------------------------------------------

WORKFLOWS = Path(__file__).resolve().parent.parent / ".github" / "workflows"


def _workflow(name: str) -> dict:
    yaml = pytest.importorskip("yaml")
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def test_release_workflow_shape() -> None:
    import fnmatch

    wf = _workflow("release.yml")
    (pattern,) = wf["on"]["push"]["tags"]
    for name, m in Workspace().members.items():
        if not m.private:
            assert fnmatch.fnmatch(f"{name}-v{m.version}", pattern), name
    assert wf["permissions"] == {"contents": "read"}
    jobs = wf["jobs"]
    publish = jobs["publish"]
    assert publish["permissions"] == {"id-token": "write"}
    assert publish["environment"]["name"] == "pypi-${{ needs.meta.outputs.package }}"
    assert set(publish["needs"]) == {"meta", "build", "compat"}
    assert any(step.get("uses", "").startswith("pypa/gh-action-pypi-publish") for step in publish["steps"])
    for name, job in jobs.items():  # only the publish job may mint an OIDC token
        if name != "publish":
            assert "id-token" not in job.get("permissions", {}), name
    # The build job is the release dry run (scripts/_dry_run.py: ranges, changelog, uv build --no-sources,
    # check-built, smoke installs) for the pushed tag; CI runs the same dry run without a tag.
    build = "\n".join(step.get("run", "") for step in jobs["build"]["steps"])
    assert "scripts/release.py dry-run --tagged" in build and '--package "$PACKAGE" --version "$VERSION"' in build
    assert jobs["build"]["steps"][0].get("with", {}).get("fetch-depth") == 0  # the changelog rule needs the tags
    assert jobs["compat"]["if"].startswith("needs.meta.outputs.package == 'npu-interface'")
    meta = "\n".join(step.get("run", "") for step in jobs["meta"]["steps"])
    assert 'scripts/release.py tag "$GITHUB_REF_NAME"' in meta


def test_ci_workflow_runs_lint_and_the_readme_command() -> None:
    wf = _workflow("ci.yml")
    assert "pull_request" in wf["on"]
    runs = {name: "\n".join(s.get("run", "") for s in job["steps"]) for name, job in wf["jobs"].items()}
    assert "ruff" in runs["lint"] and "check_workspace_ranges.py" in runs["lint"]
    assert "scripts/check_layering.py" in runs["lint"]  # the layering, also run by tests/test_layering.py
    assert runs["test"].strip() == "bash .ci/run"
    assert "scripts/release.py affected --base" in runs["changes"]
    assert 'scripts/release.py changelog --base "origin/$BASE_REF"' in runs["changes"]
    assert "scripts/check_workflows.py" in runs["lint"]
    assert 'scripts/release.py dry-run --package "$PACKAGE"' in runs["release-dry-run"]
    matrix = wf["jobs"]["release-dry-run"]["strategy"]["matrix"]
    assert matrix == {"package": "${{ fromJSON(needs.changes.outputs.packages) }}"}  # every affected package
    assert "release-dry-run" in wf["jobs"]["all-green"]["needs"]


def test_workflows_reference_existing_scripts() -> None:
    import re

    root = WORKFLOWS.parent.parent
    for wf in WORKFLOWS.glob("*.yml"):
        for script in re.findall(r"scripts/[\w./-]+\.py", wf.read_text()):
            assert (root / script).is_file(), f"{wf.name} runs {script}, which does not exist"


# --- the release dry run's refusals (they stop before building anything) -------------------------------------

dry_run = load_script("_dry_run")


def test_dry_run_refuses_a_version_that_is_not_in_the_tree(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    version = Workspace().members["npu-quant"].version
    assert release.main(["dry-run", "--package", "npu-quant", "--version", "99.0", "--dist", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert (
        f"tag 'npu-quant-v99.0' says npu-quant 99.0 but packages/npu-quant/src/vllm_npu/quant/_version.py "
        f"says {version}" in err
    )
    assert list(tmp_path.iterdir()) == []  # nothing built


def test_dry_run_refuses_the_private_testkit(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert release.main(["dry-run", "--package", "npu-testkit", "--dist", str(tmp_path)]) == 1
    # Its tag npu-testkit-v0.0.0 matches release.yml's pattern; release.py tag refuses it (it is not under packages/).
    assert "tag 'npu-testkit-v0.0.0' names package 'npu-testkit', which is not a workspace package" in (
        capsys.readouterr().err
    )


def test_a_pushed_tag_needs_the_changelog_in_released_shape(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """release.yml runs the dry run with --tagged: entries still under Unreleased would be left out of the release."""
    assert release.main(["dry-run", "--tagged", "--package", "npu-quant", "--dist", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "entries are still under '## Unreleased' of its CHANGELOG.md: the release commit moves them" in err
    assert list(tmp_path.iterdir()) == []


def test_which_extras_the_dry_run_installs() -> None:
    ws = Workspace()
    platform = ws.members["npu-platform"]
    layers = {"npu-ops", "npu-attention", "npu-quant", "npu-models", "npu-patches", "npu-kv"}
    assert dry_run.extra_targets(platform, "all", ws) == (layers | {"npu-interface"}, [])
    assert dry_run.extra_targets(platform, "quant", ws) == ({"npu-quant", "npu-interface"}, [])
    assert dry_run.extra_targets(platform, "ascend", ws) == ({"npu-interface"}, ["torch-npu==2.8.0", "torch==2.8.0"])
    siblings, others = dry_run.extra_targets(platform, "kv-emulated", ws)  # npu-kv[emulated]: a Mooncake build
    assert siblings == {"npu-kv", "npu-interface"} and others == ["mooncake-transfer-engine-non-cuda==0.3.13.post1"]
    assert dry_run.extra_targets(ws.members["npu-quant"], "moe", ws) == ({"npu-ops", "npu-interface"}, [])
    assert dry_run.extra_targets(ws.members["npu-quant"], None, ws) == ({"npu-interface"}, [])
    # npu-models requires npu-ops and npu-attention, which require npu-interface: followed through.
    assert dry_run.extra_targets(platform, "models", ws)[0] >= {"npu-models", "npu-ops", "npu-interface"}
