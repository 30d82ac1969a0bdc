# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Facts about the host, read without importing torch, torch_npu or vLLM.

Importing torch where torch-npu is installed but CANN is not raises inside ``import torch`` itself: torch
auto-loads every ``torch.backends`` entry point (torch_npu registers one) unless ``TORCH_DEVICE_BACKEND_AUTOLOAD``
is set to something other than ``1``. So versions come from distribution metadata and CANN's version from the files
its installer writes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_npu.interface import distribution_version

from ..._cann import CannInstall

AUTOLOAD_VAR = "TORCH_DEVICE_BACKEND_AUTOLOAD"


@dataclass(frozen=True)
class TorchNPUState:
    """torch / torch_npu as installed, and whether ``import torch`` would break because of them."""

    torch: str | None
    torch_npu: str | None  # distribution version; "unknown" when the module exists without metadata
    autoload: bool  # torch imports its torch.backends entry points at import
    backends: tuple[str, ...]  # "name = module:attr" of every torch.backends entry point

    def import_torch_breaks(self, cann: CannInstall) -> bool:
        """True when ``import torch`` would raise: torch_npu is auto-loaded but CANN is missing."""
        npu_backend = any(b.split("=", 1)[1].strip().startswith("torch_npu") for b in self.backends)
        return (
            self.torch is not None
            and self.torch_npu is not None
            and npu_backend
            and self.autoload
            and cann.home is None
        )


def torch_state(environ: Mapping[str, str] | None = None) -> TorchNPUState:
    environ = os.environ if environ is None else environ
    torch_npu = distribution_version("torch-npu")
    if torch_npu is None and importlib.util.find_spec("torch_npu") is not None:
        torch_npu = "unknown"
    backends = tuple(f"{ep.name} = {ep.value}" for ep in importlib.metadata.entry_points(group="torch.backends"))
    # torch/__init__.py: enabled iff os.getenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "1"
    autoload = environ.get(AUTOLOAD_VAR, "1") == "1"
    return TorchNPUState(distribution_version("torch"), torch_npu, autoload, backends)


def plugin_entry_points() -> dict[str, list[tuple[str, str]]]:
    """vLLM's two plugin groups, read exactly as ``vllm.plugins.load_plugins_by_group`` reads them."""
    return {
        group: [(ep.name, ep.value) for ep in importlib.metadata.entry_points(group=group)]
        for group in ("vllm.platform_plugins", "vllm.general_plugins")
    }
