# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Device and kernel-backend selection shared by every layer.

The device mode is decided once per process from ``VLLM_NPU_DEVICE`` and a cheap probe that never imports
torch_npu (it only looks for the module and for Ascend device nodes):

- ``npu``: torch_npu kernels on an Ascend NPU;
- ``emulated``: the pure-PyTorch reference kernels on the CPU, through exactly the same layers.

The kernel backend (``"npu"`` or ``"reference"``) follows the mode; layers pick their kernel when they are built
(:meth:`.kernels.Kernel.select`), never per call.
"""

from __future__ import annotations

import enum
import functools
import glob
import importlib.util
import os
from collections.abc import Mapping
from typing import Literal, NamedTuple

from .cann import CANN_HOME_VARS, CANN_OPP_VAR, find_cann_home
from .errors import ConfigError, DeviceUnavailableError
from .settings import KERNEL_SETTINGS, read_device_setting

KernelBackend = Literal["npu", "reference"]


class DeviceMode(str, enum.Enum):
    NPU = "npu"
    EMULATED = "emulated"


# NPUProbe and DeviceDecision are NamedTuples and Kernel a slotted class, not dataclasses: this module is on vLLM's
# platform-resolution path in every process, and each frozen dataclass costs ~1 ms of exec() at import.


class NPUProbe(NamedTuple):
    """What the cheap probe found. ``available`` means torch_npu, CANN and at least one visible NPU are present."""

    torch_npu_installed: bool
    cann_found: bool
    device_nodes: tuple[str, ...]
    visible_devices: str | None

    @property
    def available(self) -> bool:
        return self.torch_npu_installed and self.cann_found and bool(self.device_nodes) and self.visible_devices != ""

    @property
    def reason(self) -> str:
        if not self.torch_npu_installed:
            return 'torch_npu is not installed (on an Ascend host: pip install "npu-platform[ascend]")'
        if not self.cann_found:
            return (
                f"torch_npu is installed but CANN is not (no directory named by {' / '.join(CANN_HOME_VARS)} / "
                f"{CANN_OPP_VAR} and none at the default locations); source CANN's set_env.sh, or uninstall "
                "torch-npu on hosts without CANN"
            )
        if not self.device_nodes:
            return "no Ascend device node (/dev/davinci<N>) is visible"
        if self.visible_devices == "":
            return "ASCEND_RT_VISIBLE_DEVICES is set to an empty list"
        return f"Ascend NPU visible ({', '.join(self.device_nodes)})"


def probe_npu(environ: Mapping[str, str] | None = None, dev_glob: str = "/dev/davinci[0-9]*") -> NPUProbe:
    """Look for an Ascend NPU without importing torch_npu (importing it without CANN breaks ``import torch``)."""
    environ = os.environ if environ is None else environ
    return NPUProbe(
        torch_npu_installed=importlib.util.find_spec("torch_npu") is not None,
        cann_found=find_cann_home(environ).home is not None,
        device_nodes=tuple(sorted(glob.glob(dev_glob))),
        visible_devices=environ.get("ASCEND_RT_VISIBLE_DEVICES"),
    )


class DeviceDecision(NamedTuple):
    """The outcome of device selection.

    ``mode`` is None when the platform declines to activate; ``reason`` says why in either case. ``error`` is set
    when the user asked for a mode this host cannot run (``VLLM_NPU_DEVICE=npu`` without an NPU): the platform then
    activates only to raise :class:`DeviceUnavailableError` with that text, so the user sees it instead of a silent
    fallback.
    """

    requested: str
    mode: DeviceMode | None
    reason: str
    error: str | None = None

    def raise_if_unusable(self) -> None:
        if self.error is not None:
            raise DeviceUnavailableError(self.error)


def decide_device(environ: Mapping[str, str] | None = None, probe: NPUProbe | None = None) -> DeviceDecision:
    """Decide the device mode from the environment. Pure apart from the probe; raises ConfigError on bad env."""
    requested = read_device_setting(environ)
    if requested == "off":
        return DeviceDecision(requested, None, "VLLM_NPU_DEVICE=off")
    if requested == "emulated":
        return DeviceDecision(requested, DeviceMode.EMULATED, "VLLM_NPU_DEVICE=emulated: reference kernels on the CPU")
    probe = probe if probe is not None else probe_npu(environ)
    if requested == "npu":
        if probe.available:
            return DeviceDecision(requested, DeviceMode.NPU, f"VLLM_NPU_DEVICE=npu: {probe.reason}")
        return DeviceDecision(
            requested,
            DeviceMode.NPU,
            f"VLLM_NPU_DEVICE=npu but {probe.reason}",
            error=(
                f"VLLM_NPU_DEVICE=npu was requested but this host cannot run it: {probe.reason}. "
                "Run on an Ascend host, or set VLLM_NPU_DEVICE=emulated to use the reference kernels on the CPU."
            ),
        )
    # auto: never activate on a host that did not show an NPU (in particular never on a CUDA host).
    if probe.available:
        return DeviceDecision(requested, DeviceMode.NPU, f"VLLM_NPU_DEVICE=auto: {probe.reason}")
    return DeviceDecision(
        requested,
        None,
        f"VLLM_NPU_DEVICE=auto and {probe.reason}; set VLLM_NPU_DEVICE=emulated to run on the CPU",
    )


@functools.lru_cache(maxsize=1)
def current_device() -> DeviceDecision:
    """The process-wide device decision (computed on first use, then fixed)."""
    return decide_device()


def current_mode() -> DeviceMode | None:
    """The process-wide device mode, or None when the platform is not ours. Never raises."""
    try:
        return current_device().mode
    except ConfigError:
        return None


# --- kernel backend -------------------------------------------------------------------------------------------

_kernel_backend: list[KernelBackend] = []  # set once per process by configure_kernels(); a 1-slot registry


def configure_kernels(setting: str = "auto") -> KernelBackend:
    """Fix the process's kernel backend from the ``kernels`` setting of the additional config.

    ``auto`` follows the device (NPU -> ``npu``, emulated -> ``reference``). ``npu`` on the emulated device is an
    error: there is no torch_npu to call. Calling again with a setting that resolves the same way is a no-op;
    a different result raises, because the choice is per process.
    """
    mode = current_mode()
    if setting == "auto":
        backend: KernelBackend = "npu" if mode is DeviceMode.NPU else "reference"
    elif setting == "reference":
        backend = "reference"
    elif setting == "npu":
        if mode is not DeviceMode.NPU:
            raise ConfigError("npu.kernels='npu' needs an Ascend NPU; use 'auto' or 'reference' on the emulated device")
        backend = "npu"
    else:
        raise ConfigError(f"npu.kernels={setting!r} is invalid; allowed: " + ", ".join(map(repr, KERNEL_SETTINGS)))
    if _kernel_backend and _kernel_backend[0] != backend:
        raise ConfigError(
            f"the kernel backend of this process is already {_kernel_backend[0]!r}; it cannot change to {backend!r}"
        )
    if not _kernel_backend:
        _kernel_backend.append(backend)
    return backend


def kernel_backend() -> KernelBackend:
    """The process's kernel backend; defaults from the device mode if nobody configured it yet."""
    if not _kernel_backend:
        configure_kernels("auto")
    return _kernel_backend[0]


def reset_device_selection() -> None:
    """Forget the process's device decision and kernel backend. For tests that change ``VLLM_NPU_DEVICE``."""
    from .chip import reset_chip

    current_device.cache_clear()
    _kernel_backend.clear()
    reset_chip()
