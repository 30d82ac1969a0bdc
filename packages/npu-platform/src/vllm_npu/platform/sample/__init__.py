# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Samplers that replace vLLM's Triton-only sampling steps with device-neutral torch (NPU and emulated device).

Import-light: the implementation lives in :mod:`.rejection_sampler` and is loaded on first attribute access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# Lazy exports (PEP 562): name -> ".module:attr", imported on first access. The TYPE_CHECKING block and
# __all__ mirror the table for type checkers and IDEs; tests/test_doors.py checks that the three agree.
_EXPORTS = {"NPURejectionSampler": ".rejection_sampler:NPURejectionSampler"}

if TYPE_CHECKING:
    from .rejection_sampler import NPURejectionSampler
else:
    from vllm_npu.interface.lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "NPURejectionSampler",
]
