# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Device selection: the decision table, the probe, the per-process cache and kernel-backend selection."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from vllm_npu.interface import (
    DEVICE_SETTINGS,
    ConfigError,
    DeviceMode,
    DeviceUnavailableError,
    Kernel,
    NPUProbe,
    configure_kernels,
    current_device,
    current_mode,
    decide_device,
    kernel_backend,
    probe_npu,
    read_device_setting,
    reset_device_selection,
)

NPU_HOST = NPUProbe(torch_npu_installed=True, cann_found=True, device_nodes=("/dev/davinci0",), visible_devices=None)
CPU_HOST = NPUProbe(torch_npu_installed=False, cann_found=False, device_nodes=(), visible_devices=None)
NO_CANN = NPUProbe(torch_npu_installed=True, cann_found=False, device_nodes=("/dev/davinci0",), visible_devices=None)
NO_NODES = NPUProbe(torch_npu_installed=True, cann_found=True, device_nodes=(), visible_devices=None)
HIDDEN = NPUProbe(torch_npu_installed=True, cann_found=True, device_nodes=("/dev/davinci0",), visible_devices="")


# (VLLM_NPU_DEVICE, probe) -> (mode, error expected, words the reason must contain)
DECISION_TABLE = [
    (None, NPU_HOST, DeviceMode.NPU, False, ["auto", "/dev/davinci0"]),
    (None, CPU_HOST, None, False, ["auto", "torch_npu is not installed", "VLLM_NPU_DEVICE=emulated"]),
    ("auto", NPU_HOST, DeviceMode.NPU, False, ["auto"]),
    ("auto", CPU_HOST, None, False, ["torch_npu is not installed"]),
    ("auto", NO_CANN, None, False, ["CANN"]),
    ("auto", NO_NODES, None, False, ["/dev/davinci"]),
    ("auto", HIDDEN, None, False, ["ASCEND_RT_VISIBLE_DEVICES"]),
    ("npu", NPU_HOST, DeviceMode.NPU, False, ["VLLM_NPU_DEVICE=npu"]),
    ("npu", CPU_HOST, DeviceMode.NPU, True, ["VLLM_NPU_DEVICE=npu", "torch_npu is not installed"]),
    ("npu", NO_CANN, DeviceMode.NPU, True, ["CANN"]),
    ("emulated", NPU_HOST, DeviceMode.EMULATED, False, ["emulated"]),
    ("emulated", CPU_HOST, DeviceMode.EMULATED, False, ["emulated"]),
    ("off", NPU_HOST, None, False, ["VLLM_NPU_DEVICE=off"]),
    ("off", CPU_HOST, None, False, ["VLLM_NPU_DEVICE=off"]),
]


@pytest.mark.parametrize(("setting", "probe", "mode", "has_error", "words"), DECISION_TABLE)
def test_decision_table(
    setting: str | None, probe: NPUProbe, mode: DeviceMode | None, has_error: bool, words: list[str]
) -> None:
    environ = {} if setting is None else {"VLLM_NPU_DEVICE": setting}
    decision = decide_device(environ, probe=probe)
    assert decision.requested == (setting or "auto")
    assert decision.mode is mode
    assert (decision.error is not None) is has_error
    for word in words:
        assert word in decision.reason
    if has_error:
        with pytest.raises(DeviceUnavailableError, match="VLLM_NPU_DEVICE=emulated"):
            decision.raise_if_unusable()
    else:
        decision.raise_if_unusable()


def test_explicit_modes_never_probe() -> None:
    """emulated/off must not depend on the host: a probe that explodes is never called."""

    class Boom(NPUProbe):
        @property
        def available(self) -> bool:  # type: ignore[override]
            raise AssertionError("probed")

    boom = Boom(True, True, (), None)
    assert decide_device({"VLLM_NPU_DEVICE": "emulated"}, probe=boom).mode is DeviceMode.EMULATED
    assert decide_device({"VLLM_NPU_DEVICE": "off"}, probe=boom).mode is None


@pytest.mark.parametrize("raw", ["EMULATED", " emulated ", "Emulated"])
def test_setting_is_case_and_space_insensitive(raw: str) -> None:
    assert decide_device({"VLLM_NPU_DEVICE": raw}, probe=CPU_HOST).mode is DeviceMode.EMULATED


def test_empty_setting_means_auto() -> None:
    assert read_device_setting({"VLLM_NPU_DEVICE": ""}) == "auto"


@pytest.mark.parametrize("bad", ["gpu", "cuda", "emulate", "1", "npu0"])
def test_bad_setting_names_variable_and_allowed_values(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        decide_device({"VLLM_NPU_DEVICE": bad}, probe=NPU_HOST)
    message = str(info.value)
    assert "VLLM_NPU_DEVICE" in message
    assert repr(bad) in message
    for allowed in DEVICE_SETTINGS:
        assert repr(allowed) in message


def test_probe_reads_env_dev_nodes_and_module_presence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "davinci0").touch()
    (dev / "davinci1").touch()
    (dev / "davinci_manager").touch()  # the manager node is not a device
    # A torch_npu that explodes on import: the probe must only look for it, never import it.
    site = tmp_path / "site"
    (site / "torch_npu").mkdir(parents=True)
    (site / "torch_npu" / "__init__.py").write_text("raise RuntimeError('torch_npu must not be imported')\n")
    monkeypatch.syspath_prepend(str(site))

    cann = tmp_path / "cann"
    cann.mkdir()
    probe = probe_npu({"ASCEND_HOME_PATH": str(cann)}, dev_glob=str(dev / "davinci[0-9]*"))
    assert probe == NPUProbe(True, True, (str(dev / "davinci0"), str(dev / "davinci1")), None)
    assert probe.available
    assert "torch_npu" not in sys.modules

    hidden = probe_npu(
        {"ASCEND_TOOLKIT_HOME": str(cann), "ASCEND_RT_VISIBLE_DEVICES": ""}, dev_glob=str(dev / "davinci[0-9]*")
    )
    assert not hidden.available and "ASCEND_RT_VISIBLE_DEVICES" in hidden.reason


def test_probe_on_this_cpu_host_finds_no_npu() -> None:
    probe = probe_npu({}, dev_glob="/nonexistent/davinci[0-9]*")
    assert not probe.available
    assert probe.device_nodes == ()


def test_current_device_is_computed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NPU_DEVICE", "emulated")
    assert current_mode() is DeviceMode.EMULATED
    monkeypatch.setenv("VLLM_NPU_DEVICE", "off")
    assert current_device().mode is DeviceMode.EMULATED  # fixed for the process
    reset_device_selection()
    assert current_mode() is None


def test_current_mode_never_raises_on_bad_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NPU_DEVICE", "bogus")
    assert current_mode() is None
    with pytest.raises(ConfigError):
        current_device()


def test_kernel_backend_follows_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NPU_DEVICE", "emulated")
    assert kernel_backend() == "reference"
    assert configure_kernels("auto") == "reference"  # same answer: a no-op
    assert configure_kernels("reference") == "reference"


def test_kernel_backend_npu_needs_an_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NPU_DEVICE", "emulated")
    with pytest.raises(ConfigError, match="needs an Ascend NPU"):
        configure_kernels("npu")


def test_kernel_backend_cannot_change_within_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_npu.interface import device

    monkeypatch.setattr(device, "current_mode", lambda: DeviceMode.NPU)
    assert configure_kernels("auto") == "npu"
    with pytest.raises(ConfigError, match="already 'npu'"):
        configure_kernels("reference")


def test_bad_kernel_setting_lists_allowed_values() -> None:
    with pytest.raises(ConfigError) as info:
        configure_kernels("fast")
    assert "'fast'" in str(info.value)
    for allowed in ("auto", "npu", "reference"):
        assert repr(allowed) in str(info.value)


def _npu_add(a: int, b: int) -> str:
    return f"npu:{a + b}"


def _ref_add(a: int, b: int) -> str:
    return f"ref:{a + b}"


def test_kernel_select(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = Kernel("add", npu=_npu_add, reference=_ref_add)
    assert kernel.select("npu") is _npu_add
    assert kernel.select("reference") is _ref_add
    monkeypatch.setenv("VLLM_NPU_DEVICE", "emulated")
    assert kernel.select()(1, 2) == "ref:3"


def test_kernel_select_on_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_npu.interface import device

    monkeypatch.setattr(device, "current_mode", lambda: DeviceMode.NPU)
    assert Kernel("add", npu=_npu_add, reference=_ref_add).select()(1, 2) == "npu:3"


def test_kernel_is_immutable_and_comparable() -> None:
    kernel = Kernel("add", npu=_npu_add, reference=_ref_add)
    with pytest.raises(AttributeError, match="immutable"):
        kernel.npu = _ref_add  # type: ignore[misc]
    assert kernel == Kernel("add", _npu_add, _ref_add) and hash(kernel) == hash(Kernel("add", _npu_add, _ref_add))
    assert kernel != Kernel("add", _ref_add, _npu_add)
    assert repr(kernel).startswith("Kernel(name='add', npu=<function _npu_add")


def test_decision_and_probe_are_immutable_values() -> None:
    decision = decide_device({"VLLM_NPU_DEVICE": "off"}, probe=CPU_HOST)
    assert decision == decide_device({"VLLM_NPU_DEVICE": "off"}, probe=NPU_HOST)
    with pytest.raises(AttributeError):
        decision.mode = DeviceMode.NPU  # type: ignore[misc]
    with pytest.raises(AttributeError):
        CPU_HOST.cann_found = True  # type: ignore[misc]
