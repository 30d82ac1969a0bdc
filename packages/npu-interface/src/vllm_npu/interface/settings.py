# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Names and allowed values of the plugin's settings, without pydantic.

The platform's register hook reads ``VLLM_NPU_DEVICE`` on vLLM's start-up path, where every millisecond counts, so
this module stays dependency-free; :mod:`vllm_npu.interface.config` builds the full pydantic schema on the same
constants.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .errors import ConfigError

ENV_PREFIX = "VLLM_NPU_"
ENV_DEVICE = "VLLM_NPU_DEVICE"
ENV_EMULATED_KV_CACHE_GB = "VLLM_NPU_EMULATED_KV_CACHE_GB"
ENV_PATCHES = "VLLM_NPU_PATCHES"

DEVICE_SETTINGS = ("auto", "npu", "emulated", "off")
GRAPH_MODES = ("auto", "eager", "piecewise")
KERNEL_SETTINGS = ("auto", "npu", "reference")

#: The key of the plugin's section inside vLLM's ``--additional-config``.
ADDITIONAL_CONFIG_KEY = "npu"


def read_device_setting(environ: Mapping[str, str] | None = None) -> str:
    """``VLLM_NPU_DEVICE``, validated; raises ConfigError naming the variable and the allowed values."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV_DEVICE, "auto").strip().lower() or "auto"
    if value not in DEVICE_SETTINGS:
        raise ConfigError(
            f"bad environment: {ENV_DEVICE}={environ.get(ENV_DEVICE)!r} is invalid; allowed: "
            + ", ".join(repr(v) for v in DEVICE_SETTINGS)
        )
    return value
