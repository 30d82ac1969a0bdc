# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Workspace rules that no tool checks for us: PEP 420 namespace, sibling ranges, packaging conventions, and how vLLM
sees our plugins on this CPU host."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _script_loader import load_script  # noqa: E402

ranges = load_script("check_workspace_ranges")
workspace_mod = load_script("_workspace")

REPO = Path(__file__).resolve().parent.parent
WORKSPACE = workspace_mod.Workspace(REPO)
PACKAGES = {name: m for name, m in WORKSPACE.members.items() if m.path.parent.name == "packages"}


def test_members_are_the_eight_packages_and_the_testkit() -> None:
    assert sorted(PACKAGES) == [
        "npu-attention",
        "npu-interface",
        "npu-kv",
        "npu-models",
        "npu-ops",
        "npu-patches",
        "npu-platform",
        "npu-quant",
    ]
    assert WORKSPACE.members["npu-testkit"].private


def test_no_member_ships_a_namespace_init() -> None:
    """A stray vllm_npu/__init__.py works in wheels by accident but breaks editable installs (PEP 420)."""
    offenders = sorted(str(p.relative_to(REPO)) for p in REPO.glob("packages/*/src/vllm_npu/__init__.py"))
    offenders += sorted(str(p.relative_to(REPO)) for p in REPO.glob("testkit/src/vllm_npu/__init__.py"))
    assert offenders == []
    tracked = subprocess.run(
        ["git", "ls-files", "packages/*/src/vllm_npu/__init__.py"], cwd=REPO, capture_output=True, text=True
    ).stdout.split()
    assert tracked == []


def test_every_sibling_range_admits_the_in_tree_version() -> None:
    assert ranges.check(WORKSPACE) == []


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_member_packaging_conventions(name: str) -> None:
    member = PACKAGES[name]
    sub = name.removeprefix("npu-")
    data = tomllib.loads((member.path / "pyproject.toml").read_text())
    assert data["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["src/vllm_npu"]
    assert member.version_file == member.path / f"src/vllm_npu/{sub}/_version.py"
    keys = data["tool"]["uv"]["cache-keys"]
    assert {"file": f"src/vllm_npu/{sub}/_version.py"} in keys and {"file": "pyproject.toml"} in keys
    assert (member.path / f"src/vllm_npu/{sub}/py.typed").is_file()
    assert (member.path / "CHANGELOG.md").read_text().count("## Unreleased") == 1
    assert data["project"]["requires-python"] == ">=3.10,<3.13"  # uv intersects them: keep them identical
    # vLLM/torch are never hard dependencies (they must match torch-npu / the host's vLLM build).
    for req in data["project"].get("dependencies", []):
        assert not req.startswith(("vllm", "torch")), req
    # The installed (editable) metadata agrees with the tree.
    assert importlib.metadata.version(name) == member.version


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_entry_points_follow_the_naming_rules(name: str) -> None:
    """VLLM_PLUGINS is one flat name list across groups: every name is npu-prefixed; one component per layer."""
    eps = importlib.metadata.distribution(name).entry_points
    sub = name.removeprefix("npu-")
    groups = {(ep.group, ep.name): ep.value for ep in eps}
    for (group, ep_name), _ in groups.items():
        if group.startswith("vllm."):
            assert ep_name == "npu" or ep_name.startswith("npu_"), (group, ep_name)
    if name == "npu-interface":
        assert groups == {}
        return
    assert groups[("vllm_npu.components", sub)] == f"vllm_npu.{sub}._component:COMPONENT"
    if name == "npu-platform":
        assert groups[("vllm.platform_plugins", "npu")] == "vllm_npu.platform:register"
        assert groups[("console_scripts", "vllm-npu")] == "vllm_npu.platform.tools.cli:main"
    component = importlib.import_module(f"vllm_npu.{sub}._component").COMPONENT
    if name != "npu-platform":
        # npu-kv's plugin is `npu_kv_connector` (the name issue #17 gives it), declared in its component.
        assert component.plugin_name == ("npu_kv_connector" if sub == "kv" else f"npu_{sub}")
        assert groups[("vllm.general_plugins", component.plugin_name)] == f"vllm_npu.{sub}._component:load_plugin"
    assert (component.name, component.distribution, component.version) == (sub, name, PACKAGES[name].version)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_NPU_", "VLLM_PLUGINS"))}
    env.update(VLLM_NO_USAGE_STATS="1", **extra)
    return env


@pytest.fixture(scope="module")
def vllm_view(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One fresh interpreter (importing vLLM costs tens of seconds): first ``current_platform`` exactly as vLLM
    resolves it at start-up with a clean environment, then vLLM's resolver under several env settings."""
    code = textwrap.dedent(
        """
        import json, os
        from vllm.platforms import current_platform, resolve_current_platform_cls_qualname
        from vllm_npu.interface import reset_device_selection
        cls = type(current_platform)
        out = {"current_platform": cls.__module__ + "." + cls.__name__}
        cases = [({}, "unset"), ({"VLLM_NPU_DEVICE": "emulated"}, "emulated"),
                 ({"VLLM_NPU_DEVICE": "emulated", "VLLM_PLUGINS": "npu,npu_quant"}, "listed"),
                 ({"VLLM_NPU_DEVICE": "emulated", "VLLM_PLUGINS": "npu_quant"}, "platform filtered"),
                 ({"VLLM_NPU_DEVICE": "off"}, "off")]
        for env, label in cases:
            for key in ("VLLM_NPU_DEVICE", "VLLM_PLUGINS"):
                os.environ.pop(key, None)
            os.environ.update(env)
            reset_device_selection()
            out[label] = resolve_current_platform_cls_qualname()
        print("@@" + json.dumps(out))
        """
    )
    tmp = tmp_path_factory.mktemp("vllm")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=_clean_env(VLLM_CONFIG_ROOT=str(tmp), VLLM_CACHE_ROOT=str(tmp)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.rpartition("@@")[2])


def test_vllm_does_not_activate_our_platform_on_a_cpu_host_by_default(vllm_view: dict) -> None:
    """``from vllm.platforms import current_platform`` without VLLM_NPU_DEVICE: never ours on a host without an NPU."""
    assert not vllm_view["current_platform"].startswith("vllm_npu"), vllm_view["current_platform"]
    assert not vllm_view["unset"].startswith("vllm_npu")


def test_vllm_platform_resolution_under_vllm_plugins(vllm_view: dict) -> None:
    """vLLM's own resolver with our entry points: VLLM_PLUGINS filters the platform plugin by name too."""
    ours = "vllm_npu.platform.platform.EmulatedNPUPlatform"
    assert vllm_view["emulated"] == ours and vllm_view["listed"] == ours
    assert not vllm_view["platform filtered"].startswith("vllm_npu")
    assert not vllm_view["off"].startswith("vllm_npu")


_TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".yml", ".yaml", ".json", ".cfg", ".ini", ".sh"}
_SKIP_DIRS = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", "node_modules"}


def test_no_merge_conflict_markers_are_committed() -> None:
    """A merge resolved by `git add` on a file still holding `<<<<<<<` / `>>>>>>>` lines passes every other check
    when the file is a CHANGELOG or a doc; this one reads every text file of the tree for them."""
    offenders = []
    for dirpath, dirnames, filenames in os.walk(REPO):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for filename in filenames:
            path = Path(dirpath) / filename
            if path.suffix not in _TEXT_SUFFIXES and filename != "run":
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if line.startswith(("<<<<<<< ", ">>>>>>> ")):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line}")
    assert not offenders, "merge conflict markers committed:\n" + "\n".join(offenders)
