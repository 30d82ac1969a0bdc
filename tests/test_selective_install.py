# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Selective installs from the published-shape wheels: each install set imports what it promises, lacks what it
does not ship, exposes the right entry points to vLLM, runs ``vllm-npu doctor``, and refuses version skew.

One ``uv build --all-packages --no-sources`` for the whole module (``--no-sources``: the wheels carry the published
sibling ranges, not workspace paths), then a fresh ``uv venv`` per install set, filled from those wheels (and uv's
cache for pydantic/packaging/safetensors). Our wheels do not depend on vLLM or torch, so each venv is small.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from vllm_npu.interface import INTERFACE_VERSION

pytestmark = pytest.mark.selective_install

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scripts" / "smoke_wheel.py"
ALL_LAYERS = ("ops", "attention", "quant", "models", "patches", "kv")
#: General-plugin entry-point names that are not npu_<layer>.
PLUGIN_NAMES = {"kv": "npu_kv_connector"}
UV = shutil.which("uv")


def uv(*args: str, cwd: Path = REPO, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run uv offline first (the cache already holds everything after `uv sync`), online if the cache is cold."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_PROJECT"))}
    proc = subprocess.run([UV, *args, "--offline"], cwd=cwd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0 and ("offline" in proc.stderr.lower() or "network" in proc.stderr.lower()):
        proc = subprocess.run([UV, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"uv {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@dataclass(frozen=True)
class Case:
    spec: str
    layers: tuple[str, ...]  # installed layers besides interface

    @property
    def present(self) -> set[str]:
        return {f"vllm_npu.{m}" for m in ("interface", *self.layers)}

    @property
    def absent(self) -> set[str]:
        return {f"vllm_npu.{m}" for m in ("platform", *ALL_LAYERS)} - self.present


CASES = {
    "npu-platform": Case("npu-platform", ("platform",)),
    "npu-platform[quant]": Case("npu-platform[quant]", ("platform", "quant")),
    "npu-platform[all]": Case("npu-platform[all]", ("platform", *ALL_LAYERS)),
    "npu-quant": Case("npu-quant", ("quant",)),
    # The layer without a Mooncake build: the connector registers, and says what to install when it is used.
    "npu-platform[kv]": Case("npu-platform[kv]", ("platform", "kv")),
}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if UV is None:
        pytest.fail("uv is not on PATH; the selective-install checks need it (see .ci/run)")
    out = tmp_path_factory.mktemp("dist")
    uv("build", "--all-packages", "--no-sources", "--wheel", "-o", str(out))
    return out


def make_venv(path: Path, *install: str, find_links: Path, no_deps: bool = False) -> Path:
    # cwd outside the repo: the workspace's uv settings (compile-bytecode) are for the dev env, not these.
    uv("venv", "-q", "--python", sys.executable, str(path), cwd=path.parent)
    python = path / "bin" / "python"
    if install:
        uv(
            "pip",
            "install",
            "-q",
            "--python",
            str(python),
            "--find-links",
            str(find_links),
            *(["--no-deps"] if no_deps else []),
            *install,
            cwd=path.parent,
        )
    return python


def test_every_published_wheel_ships_the_license(dist: Path) -> None:
    import zipfile

    wheels = sorted(w for w in dist.glob("npu_*.whl") if not w.name.startswith("npu_testkit-"))
    assert len(wheels) == 8, [w.name for w in wheels]
    license_text = (REPO / "LICENSE").read_bytes()
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            dist_info = next(n.split("/")[0] for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            assert archive.read(f"{dist_info}/licenses/LICENSE") == license_text, wheel.name
            metadata = archive.read(f"{dist_info}/METADATA").decode()
        assert "License-Expression: Apache-2.0" in metadata.splitlines(), wheel.name
        assert "License-File: LICENSE" in metadata.splitlines(), wheel.name


@pytest.fixture(scope="module")
def venvs(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("venvs")
    with ThreadPoolExecutor(max_workers=2) as pool:  # the machine has 2 cores
        futures = {
            key: pool.submit(make_venv, root / re.sub(r"\W", "_", key), case.spec, find_links=dist)
            for key, case in CASES.items()
        }
        return {key: future.result() for key, future in futures.items()}


def run(python: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON", "VIRTUAL_ENV"))}
    return subprocess.run(
        [str(python), *args], capture_output=True, text=True, timeout=120, env={**clean, **(env or {})}
    )


def installed(python: Path) -> dict[str, str]:
    out = run(
        python,
        "-I",
        "-c",
        "import importlib.metadata as m, json; "
        "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))",
    ).stdout
    return json.loads(out)


@pytest.mark.parametrize("key", list(CASES))
def test_install_set(key: str, venvs: dict[str, Path], dist: Path) -> None:
    case, python = CASES[key], venvs[key]
    dists = installed(python)
    ours = {name for name in dists if name.startswith("npu-")}
    assert ours == {f"npu-{m}" for m in ("interface", *case.layers)}
    assert not {"vllm", "torch", "torch-npu", "torch_npu"} & set(dists), "our wheels must not pull vLLM or torch"
    # A Mooncake build comes only with kv-ascend / kv-emulated (it is per host kind), never with a layer or `all`.
    assert not [d for d in dists if d.startswith("mooncake")], dists

    proc = run(python, "-I", str(SMOKE))
    report = json.loads(proc.stdout)
    assert proc.returncode == 0, report["errors"]
    assert set(report["present"]) == case.present
    assert set(report["absent"]) == case.absent
    eps = report["entry_points"]
    assert eps["vllm.platform_plugins"] == (["npu"] if "platform" in case.layers else [])
    assert eps["vllm.general_plugins"] == sorted(
        PLUGIN_NAMES.get(m, f"npu_{m}") for m in case.layers if m != "platform"
    )
    assert eps["vllm_npu.components"] == sorted(case.layers)
    assert report["heavy_imported"] == []
    if "platform" in case.layers:
        assert report["platform"] == {"npu": None}  # loaded, called twice, declined: no NPU and no VLLM_NPU_DEVICE


@pytest.mark.parametrize("key", list(CASES))
def test_doctor(key: str, venvs: dict[str, Path]) -> None:
    case, python = CASES[key], venvs[key]
    script = python.parent / "vllm-npu"
    if "platform" not in case.layers:
        assert not script.exists(), "only npu-platform ships the vllm-npu command"
        return
    proc = run(script, "doctor", "--json")
    report = json.loads(proc.stdout)
    # vLLM is not in these venvs (by design our wheels do not depend on it): that is the one error doctor reports.
    assert proc.returncode == 1
    assert len(report["errors"]) == 1 and report["errors"][0].startswith("vLLM is not installed")
    assert 'pip install "npu-platform[vllm]"' in report["errors"][0]
    assert report["versions"]["vllm"] is None and report["versions"]["torch"] is None
    assert sorted(report["components"]) == sorted(case.layers)
    assert all(c["ok"] for c in report["components"].values())
    missing = {m["layer"]: m["command"] for m in report["missing"]}
    assert missing == {m: f'pip install "npu-platform[{m}]"' for m in ALL_LAYERS if m not in case.layers}
    assert report["full_install"] == ('pip install "npu-platform[all]"' if missing else None)
    assert report["device"]["mode"] is None


def test_absent_layer_gives_the_pip_command(venvs: dict[str, Path]) -> None:
    python = venvs["npu-platform"]
    proc = run(
        python,
        "-I",
        "-c",
        (
            "from vllm_npu.interface import registry\n"
            "try:\n"
            "    registry.require('quant', 'this checkpoint is W8A8-quantized')\n"
            "except ImportError as exc:\n"
            "    print(type(exc).__name__ + ': ' + str(exc))\n"
        ),
    )
    assert proc.stdout.strip() == (
        'MissingComponentError: this checkpoint is W8A8-quantized; install the quant layer: pip install "npu-platform[quant]"'
    )
    cli = run(python.parent / "vllm-npu", "quantize", "--help")
    assert cli.returncode == 2
    assert 'install the quant layer: pip install "npu-platform[quant]"' in cli.stderr
    # With the layer installed, require() passes.
    ok = run(
        venvs["npu-platform[quant]"],
        "-I",
        "-c",
        "from vllm_npu.interface import registry; registry.require('quant', 'W8A8'); print('ok')",
    )
    assert ok.stdout.strip() == "ok", ok.stderr


def _build_old_quant(tmp: Path, version: str, interface: str) -> Path:
    """A wheel of npu-quant at an older ``version`` declaring the interface range ``interface``."""
    src = tmp / "npu-quant"
    shutil.copytree(REPO / "packages" / "npu-quant", src, ignore=shutil.ignore_patterns("tests", "__pycache__"))
    (src / "src/vllm_npu/quant/_version.py").write_text(f'__version__ = "{version}"\n')
    component = src / "src/vllm_npu/quant/_component.py"
    text, count = re.subn(r'interface="[^"]*"', f'interface="{interface}"', component.read_text())
    assert count == 1
    component.write_text(text)
    out = tmp / "old"
    uv("build", "--no-sources", "--wheel", "-o", str(out), str(src), cwd=tmp)
    (wheel,) = out.glob("npu_quant-*.whl")
    return wheel


@pytest.fixture(scope="module")
def old_quant(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_old_quant(tmp_path_factory.mktemp("oldquant"), "0.0.1", ">=0.1,<1")


def test_resolver_refuses_an_old_member(dist: Path, old_quant: Path, tmp_path: Path) -> None:
    """Published metadata catches skew: only npu-quant 0.0.1 is available, npu-platform[quant] needs >=0.1,<0.2."""
    skewed = tmp_path / "dist"
    skewed.mkdir()
    for wheel in dist.glob("*.whl"):
        if not wheel.name.startswith("npu_quant-"):
            shutil.copy(wheel, skewed)
    shutil.copy(old_quant, skewed)
    uv("venv", "-q", "--python", sys.executable, str(tmp_path / "venv"), cwd=tmp_path)
    proc = uv(
        "pip",
        "install",
        "--python",
        str(tmp_path / "venv" / "bin" / "python"),
        "--find-links",
        str(skewed),
        "npu-platform[quant]",
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "npu-quant" in proc.stderr and "0.0.1" in proc.stderr and "unsatisfiable" in proc.stderr, proc.stderr


def test_runtime_refuses_an_old_member_forced_in(dist: Path, old_quant: Path, tmp_path: Path) -> None:
    """Skew that bypasses the resolver (--no-deps, PYTHONPATH, vendoring) is caught by the interface range."""
    python = make_venv(tmp_path / "venv", "npu-platform", find_links=dist)
    uv("pip", "install", "-q", "--python", str(python), "--no-deps", str(old_quant), cwd=tmp_path)
    proc = run(
        python,
        "-I",
        "-c",
        (
            "from vllm_npu.interface import ComponentSkewError, check_installed_set\n"
            "try:\n"
            "    check_installed_set()\n"
            "except ComponentSkewError as exc:\n"
            "    print(exc)\n"
        ),
    )
    interface_version = installed(python)["npu-interface"]
    assert "the installed vllm-npu components do not fit together" in proc.stdout, proc.stderr
    assert (
        f"npu-quant 0.0.1 needs interface '>=0.1,<1' but npu-interface {interface_version} provides interface "
        f"{INTERFACE_VERSION}" in proc.stdout
    )
    doctor = run(python.parent / "vllm-npu", "doctor")
    assert doctor.returncode == 1 and "npu-quant 0.0.1 needs interface" in doctor.stdout


def test_release_dry_run_of_npu_quant(dist: Path, tmp_path: Path) -> None:
    """CI's release dry run (ci.yml's release-dry-run job; release.yml's build job runs it with --tagged): tag and
    version, sibling ranges, the changelog entry, the sdist and the wheel built from it, smoke installs of the wheel
    alone and with its extra. The siblings are this module's wheels (one build for the module)."""
    out = tmp_path / "dist"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "release.py"), "dry-run", "--package", "npu-quant"]
        + ["--dist", str(out), "--siblings", str(dist)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    version = _in_tree("npu-quant")
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"1. version: tag npu-quant-v{version} starts release.yml and names npu-quant {version}")
    assert "2. sibling ranges admit the in-tree versions" in lines
    assert any(line.startswith("3. changelog: every code change since") for line in lines)
    assert f"4. built npu_quant-{version}.tar.gz and, from it, npu_quant-{version}-py3-none-any.whl" in lines
    assert sorted(p.name for p in out.iterdir() if p.name != ".gitignore") == [
        f"npu_quant-{version}-py3-none-any.whl",
        f"npu_quant-{version}.tar.gz",
    ]
    smoke = [line.strip() for line in lines if "smoke install npu_quant" in line]
    assert smoke == [
        f"smoke install npu_quant-{version}-py3-none-any.whl: npu-interface {_in_tree('npu-interface')}, "
        f"npu-quant {version} -- OK",
        f"smoke install npu_quant-{version}-py3-none-any.whl[moe]: npu-interface "
        f"{_in_tree('npu-interface')}, npu-ops {_in_tree('npu-ops')}, npu-quant {version} -- OK",
    ]
    assert lines[-1].startswith(f"dry run of npu-quant-v{version}: every step passed; nothing was published")


def _in_tree(name: str) -> str:
    """The version of a workspace package in this tree (its _version.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _script_loader import load_script

    return load_script("_workspace").Workspace(REPO).members[name].version
