# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Facts about the host, read without importing torch, torch_npu or vLLM.

Importing torch where torch-npu is installed but CANN is not raises inside ``import torch`` itself: torch
auto-loads every ``torch.backends`` entry point (torch_npu registers one) unless ``TORCH_DEVICE_BACKEND_AUTOLOAD``
is set to something other than ``1``. So versions come from distribution metadata and CANN's version from the files
its installer writes.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_npu.interface.cann import CANN_DEFAULT_HOMES, find_cann_home
from vllm_npu.interface.versions import distribution_version

AUTOLOAD_VAR = "TORCH_DEVICE_BACKEND_AUTOLOAD"


@dataclass(frozen=True)
class CannInstall:
    """Where CANN was looked for and what was found. ``home`` is None when no CANN directory exists."""

    home: str | None
    home_source: str | None  # the variable that named ``home``, or "default location"
    version: str | None
    version_file: str | None
    searched: tuple[str, ...]


def _parse_version_file(path: str) -> str | None:
    """``version=8.0.RC2`` (``*_install.info``) or ``runtime_running_version=[7.0.0.5.242:7.0.0]`` (version.cfg)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return None
    match = re.search(r"^\s*version\s*=\s*(\S+)", text, re.MULTILINE)
    if match:
        return match.group(1).strip("\"'")
    match = re.search(r"^\s*\w*version\s*=\s*\[([^\]]+)\]", text, re.MULTILINE)
    if match:
        inner = match.group(1)
        return inner.rsplit(":", 1)[-1] if ":" in inner else inner
    return None


def find_cann(
    environ: Mapping[str, str] | None = None, default_homes: tuple[str, ...] = CANN_DEFAULT_HOMES
) -> CannInstall:
    """CANN's home as the device probe finds it (:func:`vllm_npu.interface.cann.find_cann_home`), and its version
    from the files its installer writes there."""
    found = find_cann_home(environ, default_homes)
    if found.home is None:
        return CannInstall(None, None, None, None, found.searched)
    home = found.home
    files = [
        *sorted(glob.glob(os.path.join(home, "*-linux", "ascend_toolkit_install.info"))),
        os.path.join(home, "ascend_toolkit_install.info"),
        os.path.join(home, "version.cfg"),
        *sorted(glob.glob(os.path.join(home, "*-linux", "version.cfg"))),
    ]
    for path in files:
        if os.path.isfile(path):
            version = _parse_version_file(path)
            if version:
                return CannInstall(home, found.source, version, path, found.searched)
    return CannInstall(home, found.source, None, None, found.searched)


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
