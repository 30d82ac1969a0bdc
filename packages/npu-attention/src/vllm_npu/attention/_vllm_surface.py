# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The vLLM internals the attention layer calls, with the vLLM 0.11.0 signatures. Checked by
``tests/test_vllm_surface.py`` and ``vllm-npu doctor --vllm-surface``; see :mod:`vllm_npu.interface.vllm_surface`."""

from __future__ import annotations

from vllm_npu.interface import VllmName

SURFACE: tuple[VllmName, ...] = (
    VllmName(
        "vllm.v1.attention.backends.utils:AttentionMetadataBuilder",
        "_init_reorder_batch_threshold",
        "method",
        "calls",
        ("vllm_npu.attention.backends.mla", "vllm_npu.attention.metadata"),
        "the GQA and MLA metadata builders set their decode threshold (speculative steps counted as decodes) through "
        "it; the "
        "batch reordering of the model runner reads the result",
        signature="(self, reorder_batch_threshold=1, supports_spec_as_decode=False)",
        changes=(
            (
                "0.11.1",
                "(self, reorder_batch_threshold=1, supports_spec_as_decode=False, supports_dcp_with_varlen=False)",
            ),
        ),
    ),
    VllmName(
        "vllm.v1.attention.backends.utils:AttentionMetadataBuilder",
        "_cudagraph_support",
        "attribute",
        "overrides",
        ("vllm_npu.attention.backends.mla", "vllm_npu.attention.backends.sfa", "vllm_npu.attention.metadata"),
        "vLLM 0.11.1 reads a builder's full-graph support from it (0.11.0: cudagraph_support); without it vLLM takes "
        "NEVER and turns FULL_DECODE_ONLY graphs off",
        since="0.11.1",
    ),
)
