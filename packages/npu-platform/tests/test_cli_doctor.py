# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu doctor``: each state it must explain, run in fresh interpreters with fake installs on PYTHONPATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from vllm_npu.interface import INTERFACE_VERSION, distribution_version
from vllm_npu.platform._cann import _parse_version_file, find_cann
from vllm_npu.platform.tools.cli._host import torch_state

IN_TREE = {"attention", "models", "ops", "patches", "platform", "quant"}
_CLEAN = ("VLLM_NPU_", "VLLM_PLUGINS", "ASCEND_", "TORCH_DEVICE_BACKEND_AUTOLOAD", "PYTHONPATH")

_RUNNER = textwrap.dedent(
    """
    import json, sys
    from vllm_npu.platform.tools.cli import main
    rc = main(sys.argv[1:])
    print("@@HEAVY@@" + json.dumps(sorted(m for m in ("torch", "torch_npu", "vllm") if m in sys.modules)))
    sys.exit(rc)
    """
)


def doctor(*args: str, extra_env: dict[str, str] | None = None, site: Path | None = None) -> tuple[int, str, str]:
    """Run ``vllm-npu doctor`` in a fresh interpreter; asserts it imported neither torch, torch_npu nor vLLM."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLEAN)}
    env.update(extra_env or {})
    if site is not None:
        env["PYTHONPATH"] = str(site)
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, "doctor", *args], capture_output=True, text=True, timeout=120, env=env
    )
    out, sep, heavy = proc.stdout.rpartition("@@HEAVY@@")
    assert sep, proc.stderr
    assert json.loads(heavy) == [], "doctor must read metadata, never import torch/torch_npu/vLLM"
    return proc.returncode, out, proc.stderr


def doctor_json(**kwargs: object) -> tuple[int, dict]:
    rc, out, _ = doctor("--json", **kwargs)  # type: ignore[arg-type]
    return rc, json.loads(out)


def make_dist(
    site: Path, name: str, version: str, entry_points: str = "", modules: dict[str, str] | None = None
) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    for path, source in (modules or {}).items():
        target = site / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(textwrap.dedent(source))


@pytest.fixture
def fake_torch_npu(tmp_path: Path) -> Path:
    """A torch-npu install that records (in a marker file) any attempt to import it."""
    site = tmp_path / "site"
    marker = tmp_path / "torch_npu_imported"
    make_dist(
        site,
        "torch-npu",
        "2.8.0",
        entry_points="[torch.backends]\ntorch_npu = torch_npu:_autoload\n",
        modules={
            "torch_npu/__init__.py": f"open({str(marker)!r}, 'w').close()\nraise ImportError('libhccl.so: no CANN')\n"
        },
    )
    return site


def test_healthy_dev_env() -> None:
    rc, report = doctor_json()
    assert rc == 0 and report["ok"] and report["errors"] == []
    v = report["versions"]
    assert (v["vllm"], v["torch"], v["torch_npu"], v["cann"]) == ("0.11.0", "2.8.0", None, None)
    assert v["interface"] == INTERFACE_VERSION and v["npu-interface"] == distribution_version("npu-interface")
    assert set(report["components"]) >= IN_TREE
    for name in IN_TREE:
        comp = report["components"][name]
        assert comp["ok"] and comp["enabled"] and comp["version"] == distribution_version(f"npu-{name}")
        assert comp["interface"] == ">=1.0,<2"
    assert report["missing"] == [] and report["full_install"] is None
    device = report["device"]
    assert device["requested"] == "auto" and device["mode"] is None
    assert "VLLM_NPU_DEVICE=auto" in device["reason"] and "VLLM_NPU_DEVICE=emulated" in device["reason"]
    assert report["vllm_plugins"]["value"] is None
    assert report["config"] == {
        "VLLM_NPU_DEVICE": "auto",
        "VLLM_NPU_EMULATED_KV_CACHE_GB": 0.5,
        "VLLM_NPU_PATCHES": "all",
        "VLLM_NPU_CACHE_DIR": None,
        "VLLM_NPU_ALLOW_UNTESTED_VLLM": "0",
        "VLLM_NPU_EMULATED_SOC": "none",
    }


def test_torch_autoload_follows_torch_rule() -> None:
    """torch auto-loads backends iff TORCH_DEVICE_BACKEND_AUTOLOAD is "1" (its default); "true" turns it off."""
    assert torch_state({}).autoload
    assert torch_state({"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}).autoload
    assert not torch_state({"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}).autoload
    assert not torch_state({"TORCH_DEVICE_BACKEND_AUTOLOAD": "true"}).autoload
    state = torch_state({})
    assert state.torch == "2.8.0" and state.torch_npu is None


def test_text_report() -> None:
    rc, out, _ = doctor()
    assert rc == 0
    for line in (
        "Versions",
        "vllm           0.11.0",
        "torch_npu      not installed",
        "CANN           not found",
        "VLLM_NPU_DEVICE=auto -> not activated",
        "Every layer is installed.",
        "Result: OK",
    ):
        assert line in out
    assert "OK   quant      npu-quant" in out


def test_emulated_device_is_reported() -> None:
    rc, report = doctor_json(extra_env={"VLLM_NPU_DEVICE": "emulated"})
    assert rc == 0 and report["device"]["mode"] == "emulated"
    assert "reference kernels" in report["device"]["reason"]


def test_emulated_310p_chip_is_reported() -> None:
    rc, report = doctor_json(extra_env={"VLLM_NPU_DEVICE": "emulated", "VLLM_NPU_EMULATED_SOC": "310p"})
    assert rc == 0 and report["device"]["chip"] == "emulated Ascend 310P (VLLM_NPU_EMULATED_SOC=310P)"
    rc, out, _ = doctor(extra_env={"VLLM_NPU_DEVICE": "emulated", "VLLM_NPU_EMULATED_SOC": "310P"})
    assert rc == 0 and "  chip: emulated Ascend 310P" in out
    rc, report = doctor_json(extra_env={"VLLM_NPU_DEVICE": "emulated"})
    assert report["device"]["chip"] == "none emulated"
    rc, out, _ = doctor(extra_env={"VLLM_NPU_DEVICE": "emulated", "VLLM_NPU_EMULATED_SOC": "910"})
    assert rc == 1 and "VLLM_NPU_EMULATED_SOC='910' is invalid; allowed: 'none', '310P'" in out


def test_bad_device_value_is_an_error() -> None:
    rc, out, _ = doctor(extra_env={"VLLM_NPU_DEVICE": "gpu"})
    assert rc == 1 and "Result: BROKEN" in out
    assert "VLLM_NPU_DEVICE='gpu' is invalid; allowed: 'auto', 'npu', 'emulated', 'off'" in out


def test_unknown_variable_is_an_error() -> None:
    rc, report = doctor_json(extra_env={"VLLM_NPU_DEVCE": "emulated"})
    assert rc == 1
    assert any("VLLM_NPU_DEVCE is not a known key" in e and "VLLM_NPU_DEVICE" in e for e in report["errors"])


def test_npu_requested_without_npu_is_an_error() -> None:
    rc, report = doctor_json(extra_env={"VLLM_NPU_DEVICE": "npu"})
    assert rc == 1 and report["device"]["mode"] == "npu"
    assert any("VLLM_NPU_DEVICE=npu was requested but this host cannot run it" in e for e in report["errors"])


def test_interface_skew_is_an_error_naming_both_versions(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_dist(
        site,
        "npu-future",
        "3.0.0",
        entry_points="[vllm_npu.components]\nfuture = npu_future_comp:COMPONENT\n"
        "[vllm.general_plugins]\nnpu_future = npu_future_comp:load_plugin\n",
        modules={
            "npu_future_comp.py": """
            from vllm_npu.interface import Component
            COMPONENT = Component(name="future", distribution="npu-future", version="3.0.0",
                                  interface=">=2.0,<3", vllm=">=0.11.0,<0.12")
            load_plugin = COMPONENT.plugin_entry()
        """
        },
    )
    rc, report = doctor_json(site=site)
    assert rc == 1 and not report["ok"]
    comp = report["components"]["future"]
    assert not comp["ok"] and comp["version"] == "3.0.0"
    (problem,) = comp["problems"]
    assert "npu-future 3.0.0 needs interface '>=2.0,<3'" in problem
    assert f"npu-interface {distribution_version('npu-interface')} provides interface {INTERFACE_VERSION}" in problem
    assert problem in report["errors"]
    # Filtering the skewed plugin out with VLLM_PLUGINS makes the set usable again: vLLM will not load it.
    rc, report = doctor_json(site=site, extra_env={"VLLM_PLUGINS": "npu,npu_ops"})
    assert rc == 0 and report["components"]["future"]["enabled"] is False
    assert "vllm.general_plugins:npu_future" in report["vllm_plugins"]["filtered_out"]


def test_component_that_fails_to_load(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_dist(site, "npu-broken", "0.1", entry_points="[vllm_npu.components]\nbroken = npu_no_such_module:COMPONENT\n")
    rc, out, _ = doctor(site=site)
    assert rc == 1
    assert "component 'broken' failed to load: ModuleNotFoundError" in out


def test_torch_npu_without_cann(fake_torch_npu: Path) -> None:
    rc, report = doctor_json(site=fake_torch_npu)
    assert rc == 1
    assert report["versions"]["torch_npu"] == "2.8.0"
    assert report["torch"]["import_torch_breaks"] is True
    assert "torch_npu = torch_npu:_autoload" in report["torch"]["backends"]
    (error,) = [e for e in report["errors"] if "torch-npu 2.8.0 is installed but CANN is not" in e]
    for words in (
        "`import torch` itself fails",
        "torch.backends",
        "set_env.sh",
        "pip uninstall torch-npu",
        "TORCH_DEVICE_BACKEND_AUTOLOAD=0",
    ):
        assert words in error
    assert report["device"]["mode"] is None and "CANN" in report["device"]["reason"]
    assert not (fake_torch_npu.parent / "torch_npu_imported").exists()


def test_torch_npu_without_cann_and_autoload_off(fake_torch_npu: Path) -> None:
    rc, report = doctor_json(site=fake_torch_npu, extra_env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert rc == 0 and report["torch"]["import_torch_breaks"] is False
    assert any("`import torch` still works" in w for w in report["warnings"])
    assert not (fake_torch_npu.parent / "torch_npu_imported").exists()


def test_cann_version_is_read_from_its_files(fake_torch_npu: Path, tmp_path: Path) -> None:
    toolkit = tmp_path / "Ascend" / "ascend-toolkit" / "latest"
    (toolkit / "x86_64-linux").mkdir(parents=True)
    (toolkit / "x86_64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=8.2.RC1\ninnerversion=V100R001C22\narch=x86_64\n"
    )
    rc, report = doctor_json(site=fake_torch_npu, extra_env={"ASCEND_TOOLKIT_HOME": str(toolkit)})
    assert report["versions"]["cann"] == "8.2.RC1"
    assert report["cann"]["home_source"] == "ASCEND_TOOLKIT_HOME"
    assert report["torch"]["import_torch_breaks"] is False
    # No /dev/davinci* here: CANN and torch_npu alone do not activate the NPU.
    assert report["device"]["mode"] is None and "/dev/davinci" in report["device"]["reason"]
    assert rc == 0, report["errors"]


def test_version_files(tmp_path: Path) -> None:
    cfg = tmp_path / "version.cfg"
    cfg.write_text(
        "# version: 1.0\nruntime_running_version=[7.0.0.5.242:7.0.0]\ncompiler_running_version=[7.0.0.5.242:7.0.0]\n"
    )
    assert _parse_version_file(str(cfg)) == "7.0.0"
    info = tmp_path / "ascend_toolkit_install.info"
    info.write_text("package_name=Ascend-cann-toolkit\nversion=8.0.RC2\n")
    assert _parse_version_file(str(info)) == "8.0.RC2"
    assert _parse_version_file(str(tmp_path / "absent")) is None

    home = tmp_path / "cann"
    home.mkdir()
    (home / "version.cfg").write_text(cfg.read_text())
    found = find_cann({"ASCEND_HOME_PATH": str(home)}, default_homes=())
    assert (found.home, found.version, found.home_source) == (str(home), "7.0.0", "ASCEND_HOME_PATH")
    assert find_cann({}, default_homes=(str(tmp_path / "none"),)).home is None


def test_torch_npu_for_another_torch(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_dist(site, "torch-npu", "2.7.1", modules={"torch_npu/__init__.py": "raise ImportError('not for import')\n"})
    cann = tmp_path / "cann"
    cann.mkdir()
    rc, report = doctor_json(site=site, extra_env={"ASCEND_HOME_PATH": str(cann)})
    assert rc == 1
    assert any("torch-npu 2.7.1 is built for torch 2.7.1 but torch 2.8.0 is installed" in e for e in report["errors"])


def test_vllm_plugins_effect() -> None:
    rc, report = doctor_json(extra_env={"VLLM_PLUGINS": "npu, npu_quant,npu_typo"})
    plugins = report["vllm_plugins"]
    assert rc == 0  # nothing is broken; the filter is reported
    assert "vllm.general_plugins:npu_quant" in plugins["filtered_out"]
    assert "vllm.platform_plugins:npu" not in plugins["filtered_out"]
    assert plugins["unknown_names"] == [" npu_quant", "npu_typo"]
    assert any("vLLM does not strip them" in w for w in report["warnings"])
    assert report["components"]["quant"]["enabled"] is False


def test_platform_filtered_out_while_device_requested() -> None:
    rc, report = doctor_json(extra_env={"VLLM_PLUGINS": "npu_quant", "VLLM_NPU_DEVICE": "emulated"})
    assert rc == 1
    assert "vllm.platform_plugins:npu" in report["vllm_plugins"]["filtered_out"]
    assert any("leaves out the platform plugin 'npu'" in e for e in report["errors"])


def test_vllm_ascend_variables_are_reported_as_the_platform_treats_them() -> None:
    rc, report = doctor_json(extra_env={"VLLM_ASCEND_ENABLE_MLAPO": "1", "VLLM_ASCEND_LLMDD_RPC_PORT": "6000"})
    assert rc == 1
    assert any(
        w.startswith("environment VLLM_ASCEND_ENABLE_MLAPO='1' is a vllm-ascend setting") for w in report["warnings"]
    )
    assert any("VLLM_ASCEND_LLMDD_RPC_PORT='6000'" in e and "cannot be ignored" in e for e in report["errors"])


def test_vllm_surface_check_reports_drift(monkeypatch: pytest.MonkeyPatch) -> None:
    # In this process (the check imports vLLM, which the subprocess harness forbids for the default report).
    from vllm_npu.interface import VllmName
    from vllm_npu.platform.tools.cli.doctor import collect, render

    report = collect(vllm_surface=True)
    surface = report["vllm_surface"]
    assert surface["problems"] == [] and surface["checked"] > 0 and "platform" in surface["layers"]
    assert "all present, signatures match" in render(report)

    gone = VllmName(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
        "_sync_gpu",
        "method",
        "overrides",
        ("vllm_npu.platform.model_runner",),
        "a stand-in for a renamed internal",
        signature="(self)",
    )
    monkeypatch.setattr("vllm_npu.interface.vllm_surface.installed_surface", lambda: {"platform": (gone,)})
    report = collect(vllm_surface=True)
    assert not report["ok"]
    assert any(e.startswith("vLLM ") and "no longer has GPUModelRunner._sync_gpu" in e for e in report["errors"])
    assert "1 vLLM names of platform: 1 drifted" in render(report)


@pytest.mark.parametrize(
    "layout",
    ["toolkit_var", "home_var", "opp_var_only", "var_names_a_missing_dir", "nothing"],
)
def test_doctor_and_device_probe_agree_on_cann(layout: str, tmp_path: Path) -> None:
    """The doctor's CANN report and the probe that activates the NPU use one detector: they never disagree."""
    from vllm_npu.interface import probe_npu

    home = tmp_path / "cann"
    (home / "opp").mkdir(parents=True)
    env = {
        "toolkit_var": {"ASCEND_TOOLKIT_HOME": str(home)},
        "home_var": {"ASCEND_HOME_PATH": str(home)},
        "opp_var_only": {"ASCEND_OPP_PATH": str(home / "opp")},
        "var_names_a_missing_dir": {"ASCEND_HOME_PATH": str(tmp_path / "gone")},
        "nothing": {},
    }[layout]
    doctor_home = find_cann(env).home
    assert probe_npu(env).cann_found is (doctor_home is not None)
    if layout in ("toolkit_var", "home_var", "opp_var_only"):
        assert doctor_home == str(home)
    rc, report = doctor_json(extra_env=env)
    assert report["device"]["probe"]["cann_found"] is (report["cann"]["home"] is not None)
    assert report["cann"]["home"] == doctor_home
