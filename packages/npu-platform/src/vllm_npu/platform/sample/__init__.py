# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Samplers that replace vLLM's Triton-only sampling steps with device-neutral torch (NPU and emulated device).

Import-light: the implementation lives in :mod:`.rejection_sampler` and is loaded on first attribute access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_npu.interface.lazy import lazy_exports

if TYPE_CHECKING:
    from .rejection_sampler import NPURejectionSampler

_EXPORTS = {"NPURejectionSampler": ".rejection_sampler:NPURejectionSampler"}
__all__ = ["NPURejectionSampler"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
