# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""CANN as installed: its home (found as the device probe finds it, :mod:`vllm_npu.interface.cann`) and its version,
read from the files its installer writes, without importing torch, torch_npu or vLLM. The torchair compile cache
keys its entries by this version (:mod:`.graphs.compile_cache`) and ``vllm-npu doctor`` reports it."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_npu.interface import CANN_DEFAULT_HOMES, find_cann_home


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
