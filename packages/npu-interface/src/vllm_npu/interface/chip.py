# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The chip family of the process's device: ``"A2"`` (Atlas A2, 910B), ``"A3"`` (Atlas A3, 910_93), ``"310P"``
(Atlas 300I Duo / Pro, Ascend 310P) or ``""`` (another chip, or no NPU).

Two readings of the same device, because they run in different processes:

- :func:`chip_of_soc_version`: torch_npu 2.8.0's ``torch.npu.get_soc_version()`` code (``SocVersion`` in the wheel's
  ``include/torch_npu/csrc/core/npu/NpuVariables.h``: ``Ascend310P1 = 200`` .. ``Ascend310P7`` (205),
  ``Ascend910B1 = 220`` .. ``Ascend910B4_1`` (225), ``Ascend910_9391 = 250`` .. ``Ascend910_9362`` (255); A2/A3 are
  the ranges vllm-ascend v0.11.0 reads, ``utils.py:631-639``). ``get_soc_version`` runs torch_npu's ``_lazy_init``
  (``npu/_backends.py:96-99``), so only a worker, whose runtime is initialised anyway, may ask it.
- :func:`chip_of_device_name`: ``torch.npu.get_device_name()`` (``"Ascend310P3"``, ``"Ascend910B2"``, ...), which
  runs no ``_lazy_init`` (``npu/__init__.py:442-446``); the front-end reads this one at config time, before vLLM
  forks its engine core (an initialised runtime there would break every forked child). torchair keys its 310P
  weight casts on the same name (``dynamo/torchair/experimental/inference.py:67``).

vllm-ascend v0.11.0 itself decides 310P at build time (``utils.py:67-72``: ``_build_info.__soc_version__`` starts
with ``ascend310p``); a plugin wheel is chip-neutral, so this module asks the device.

On the emulated device the chip is ``VLLM_NPU_EMULATED_SOC`` (``none`` or ``310P``): the whole stack then takes that
chip's paths and refusals on the CPU.
"""

from __future__ import annotations

import functools
from typing import Literal

from .settings import read_emulated_soc

ChipFamily = Literal["A2", "A3", "310P", ""]
CHIP_310P: ChipFamily = "310P"

#: torch_npu 2.8.0 ``SocVersion`` code ranges (inclusive) of each family (NpuVariables.h).
SOC_VERSION_RANGES: dict[ChipFamily, tuple[int, int]] = {"310P": (200, 205), "A2": (220, 225), "A3": (250, 255)}
#: ``get_device_name()`` prefixes of each family (the ``SocVersion`` names).
DEVICE_NAME_PREFIXES: dict[ChipFamily, str] = {"310P": "Ascend310P", "A2": "Ascend910B", "A3": "Ascend910_93"}


def chip_of_soc_version(code: int) -> ChipFamily:
    """The family of a ``torch.npu.get_soc_version()`` code ("" for any other chip)."""
    for family, (low, high) in SOC_VERSION_RANGES.items():
        if low <= code <= high:
            return family
    return ""


def chip_of_device_name(name: str) -> ChipFamily:
    """The family of a ``torch.npu.get_device_name()`` answer ("" for any other chip)."""
    for family, prefix in DEVICE_NAME_PREFIXES.items():
        if name.strip().lower().startswith(prefix.lower()):
            return family
    return ""


@functools.lru_cache(maxsize=1)
def current_chip() -> ChipFamily:
    """The chip family of this process's device (fixed on first use; :func:`reset_chip` forgets it).

    NPU: from ``torch.npu.get_device_name()`` (no runtime initialisation, so the front-end may ask). Emulated device:
    ``VLLM_NPU_EMULATED_SOC`` (``none`` is ""). Not our platform: ""."""
    from .device import DeviceMode, current_mode

    mode = current_mode()
    if mode is DeviceMode.EMULATED:
        soc = read_emulated_soc()
        return "" if soc == "none" else soc
    if mode is DeviceMode.NPU:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        if not hasattr(torch, "npu"):  # a stand-in torch_npu (tests) may register no device module
            return ""
        return chip_of_device_name(str(torch.npu.get_device_name()))
    return ""


def is_310p() -> bool:
    """Whether this process's device is an Ascend 310P (real, or the emulated device with ``VLLM_NPU_EMULATED_SOC=310P``)."""
    return current_chip() == CHIP_310P


def reset_chip() -> None:
    """Forget the process's chip (tests that change the device or ``VLLM_NPU_EMULATED_SOC``)."""
    current_chip.cache_clear()
