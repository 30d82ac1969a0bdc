# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Samplers that replace vLLM's Triton-only sampling steps with device-neutral torch (NPU and emulated device), top-k /
top-p masking with the NPU's ``npu_top_k_top_p`` (kernel pair ``TOP_K_TOP_P``), the
structured-output bitmask for every logits dtype (kernel pair ``GRAMMAR_BITMASK``: on the device on an NPU), and per-request fault isolation of logits processing.

Import-light: the implementations live in the submodules and are loaded on first attribute access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# Lazy exports (PEP 562): name -> ".module:attr", imported on first access. The TYPE_CHECKING block and
# __all__ mirror the table for type checkers and IDEs; tests/test_doors.py checks that the three agree.
_EXPORTS = {
    "GRAMMAR_BITMASK": ".grammar:GRAMMAR_BITMASK",
    "NPURejectionSampler": ".rejection_sampler:NPURejectionSampler",
    "NPUTopKTopPSampler": ".topk_topp:NPUTopKTopPSampler",
    "TOP_K_TOP_P": ".topk_topp:TOP_K_TOP_P",
    "apply_grammar_bitmask": ".grammar:apply_grammar_bitmask",
    "isolated_request_logitsprocs": ".request_faults:isolated_request_logitsprocs",
}

if TYPE_CHECKING:
    from .grammar import GRAMMAR_BITMASK, apply_grammar_bitmask
    from .rejection_sampler import NPURejectionSampler
    from .request_faults import isolated_request_logitsprocs
    from .topk_topp import TOP_K_TOP_P, NPUTopKTopPSampler
else:
    from vllm_npu.interface import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "GRAMMAR_BITMASK",
    "TOP_K_TOP_P",
    "NPURejectionSampler",
    "NPUTopKTopPSampler",
    "apply_grammar_bitmask",
    "isolated_request_logitsprocs",
]
