# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The vLLM releases this plugin line is tested on, the torch / torch-npu each pairs with, and the gate that refuses
any other vLLM at plugin load.

Standard library only at import (``scripts/compat_env.py`` loads this file by path before anything is installed, and
every layer's plugin entry reaches :func:`vllm_gate` in every vLLM process); ``packaging`` is imported by the
functions that compare versions.

Two torch builds exist for each vLLM release:

- PyPI's vLLM wheel (what the emulated device and CI run) pins one torch (:attr:`Release.torch`): 2.8.0 for vLLM
  0.11.0, 2.9.0 for 0.11.1 and 0.11.2 (their ``requires_dist``).
- On an Ascend host vLLM is built from source with ``VLLM_TARGET_DEVICE=empty``, which pins no torch, and torch must
  equal torch-npu's release exactly. vllm-ascend runs vLLM 0.12.0 (its v0.12.0rc1) and 0.13.0 on torch 2.8.0 +
  torch-npu 2.8.0, and our NPU calls are checked against torch-npu 2.8.0's documented signatures (tests/contract), so
  the Ascend pair is torch 2.8.0 + torch-npu 2.8.0 for every release of the line (:attr:`Release.ascend_torch`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: Set to 1 to run on a vLLM outside the tested releases anyway (a warning instead of the refusal). The same name as
#: :data:`vllm_npu.interface.settings.ENV_ALLOW_UNTESTED_VLLM` (this module imports nothing of ours at import).
ENV_ALLOW_UNTESTED_VLLM = "VLLM_NPU_ALLOW_UNTESTED_VLLM"


@dataclass(frozen=True)
class Release:
    """One tested vLLM release: the torch its PyPI wheel pins, and the torch / torch-npu pair of an Ascend host."""

    vllm: str
    torch: str
    ascend_torch: str = "2.8.0"
    torch_npu: str = "2.8.0"


#: Every vLLM release the line is tested on (CI: the whole suite on the first, the compatibility job on the others).
#: ``SUPPORTED_VLLM`` in :mod:`.versions` admits exactly these (tests/test_vllm_line.py checks it).
TESTED_RELEASES: tuple[Release, ...] = (
    Release("0.11.0", torch="2.8.0"),
    Release("0.11.1", torch="2.9.0"),
    Release("0.11.2", torch="2.9.0"),
)

#: Releases of the line every seam is adapted to but whose compatibility job does not pass yet: they stay outside
#: ``SUPPORTED_VLLM`` (never a silent wrong answer), refused like any untested vLLM with :data:`PREVIEW_GAPS`
#: named; ``VLLM_NPU_ALLOW_UNTESTED_VLLM=1`` runs them, and ``scripts/compat_env.py`` builds their environments.
#: None today: 0.11.1 and 0.11.2 passed their jobs and moved to :data:`TESTED_RELEASES` (docs/vllm-compat.md).
PREVIEW_RELEASES: tuple[Release, ...] = ()

#: What a preview release is known to get wrong (the refusal names it).
PREVIEW_GAPS = ""

#: The release ``uv.lock`` pins (the default environment).
PINNED_RELEASE = TESTED_RELEASES[0]


def release(vllm_version: str) -> Release | None:
    """The tested release ``vllm_version`` is (local versions such as ``0.11.1+cpu`` count as their release)."""
    base = vllm_version.split("+")[0]
    return next((r for r in (*TESTED_RELEASES, *PREVIEW_RELEASES) if r.vllm == base), None)


def install_line(vllm_version: str | None = None) -> str:
    """The pip line that installs a tested vLLM (the pinned one, or the release of ``vllm_version``)."""
    found = release(vllm_version) if vllm_version else None
    chosen = found if found in TESTED_RELEASES else TESTED_RELEASES[-1]
    return f'pip install "vllm=={chosen.vllm}" (torch {chosen.torch} comes with it)'


def untested_message(vllm_version: str, supported: str) -> str:
    """The one refusal every layer gives on a vLLM outside ``supported``."""
    tested = ", ".join(r.vllm for r in TESTED_RELEASES)
    base = vllm_version.split("+")[0]
    preview = (
        f" (vLLM {base} is a preview of this line: {PREVIEW_GAPS}; see docs/vllm-compat.md)"
        if any(r.vllm == base for r in PREVIEW_RELEASES)
        else " (untested: expect failures)"
    )
    return (
        f"vLLM {vllm_version} is installed, but this vllm-npu-plugin line is tested on vLLM {tested} only "
        f"(SUPPORTED_VLLM {supported!r}): install one of them, e.g. {install_line()}, or set "
        f"{ENV_ALLOW_UNTESTED_VLLM}=1 to try vLLM {vllm_version} anyway{preview}"
    )


def allow_untested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the user asked to run on an untested vLLM (``VLLM_NPU_ALLOW_UNTESTED_VLLM=1``)."""
    env = os.environ if environ is None else environ
    return env.get(ENV_ALLOW_UNTESTED_VLLM, "").strip() == "1"


def untested_vllm(vllm_version: str | None, supported: str) -> str | None:
    """The refusal for ``vllm_version`` if it lies outside ``supported`` (a component's ``vllm`` range), else None
    (also None when vLLM is not installed: that is a missing requirement, reported as such)."""
    from .versions import in_range

    if vllm_version is None or in_range(vllm_version, supported, what="the supported vLLM range"):
        return None
    return untested_message(vllm_version, supported)


_warned: set[str] = set()


def warn_untested_once(message: str) -> None:
    """Log, once per process, that the plugin runs on an untested vLLM because the user allowed it."""
    if message in _warned:
        return
    _warned.add(message)
    from .log import get_logger

    get_logger(__name__).warning(
        "%s=1: running anyway. %s", ENV_ALLOW_UNTESTED_VLLM, message.split(": install one of them")[0]
    )


def require_tested_vllm(supported: str, vllm_version: str | None = None) -> None:
    """Raise :class:`~vllm_npu.interface.errors.ConfigError` with the one refusal message when the installed vLLM
    (or ``vllm_version``) lies outside ``supported``, unless ``VLLM_NPU_ALLOW_UNTESTED_VLLM=1`` (then warn once).
    The platform calls it first thing when vLLM instantiates it, before anything of vLLM's beyond its ``Platform``
    base class is imported."""
    from .errors import ConfigError
    from .versions import distribution_version

    message = untested_vllm(vllm_version or distribution_version("vllm"), supported)
    if message is None:
        return
    if allow_untested():
        warn_untested_once(message)
        return
    raise ConfigError(message)
