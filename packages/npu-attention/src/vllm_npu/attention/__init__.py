# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm_npu.attention: the public API of the attention layer.

Importing this package is cheap (exports load on first access): vLLM imports it in every process when it
discovers plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__

# Lazy exports (PEP 562): name -> ".module:attr", imported on first access. The TYPE_CHECKING block and
# __all__ mirror the table for type checkers and IDEs; tests/test_doors.py checks that the three agree.
_EXPORTS: dict[str, str] = {
    "selftest_cases": ".selftest:selftest_cases",
    # The decode kernels npu-platform's selftest captures as graph tasks (its runtime section).
    "GraphTaskCase": "._selftest_graph:GraphTaskCase",
    "graph_task_cases": "._selftest_graph:graph_task_cases",
    "select_backend": ".selector:select_backend",
    "GQA_BACKEND": ".selector:GQA_BACKEND",
    "MLA_BACKEND": ".selector:MLA_BACKEND",
    "SFA_BACKEND": ".selector:SFA_BACKEND",
    "AscendAttentionBackend": ".backends.gqa:AscendAttentionBackend",
    "AscendAttentionImpl": ".backends.gqa:AscendAttentionImpl",
    "AscendAttentionMetadataBuilder": ".metadata:AscendAttentionMetadataBuilder",
    "AscendAttentionState": ".metadata:AscendAttentionState",
    "AscendMetadata": ".metadata:AscendMetadata",
    "AttentionMaskBuilder": ".masks:AttentionMaskBuilder",
    # The sparse-attention (DeepSeek-V3.2) pieces npu-models' model override builds on: the impl and the indexer.
    "AscendSFAImpl": ".backends.sfa:AscendSFAImpl",
    "AscendSFAIndexerBackend": ".backends.sfa_indexer:AscendSFAIndexerBackend",
    "AscendLightningIndexer": ".backends.sfa_indexer:AscendLightningIndexer",
    "ascend_indexer_forward": ".backends.sfa_indexer:ascend_indexer_forward",
    # The vision-encoder attention kernel pair npu-models' Qwen VL overrides call.
    "VISION_ATTENTION": ".ops.vision_attention:VISION_ATTENTION",
}

if TYPE_CHECKING:
    from ._selftest_graph import GraphTaskCase, graph_task_cases
    from .backends.gqa import AscendAttentionBackend, AscendAttentionImpl
    from .backends.sfa import AscendSFAImpl
    from .backends.sfa_indexer import AscendLightningIndexer, AscendSFAIndexerBackend, ascend_indexer_forward
    from .masks import AttentionMaskBuilder
    from .metadata import AscendAttentionMetadataBuilder, AscendAttentionState, AscendMetadata
    from .ops.vision_attention import VISION_ATTENTION
    from .selector import GQA_BACKEND, MLA_BACKEND, SFA_BACKEND, select_backend
    from .selftest import selftest_cases
else:
    from vllm_npu.interface import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "GQA_BACKEND",
    "MLA_BACKEND",
    "SFA_BACKEND",
    "VISION_ATTENTION",
    "AscendAttentionBackend",
    "AscendAttentionImpl",
    "AscendAttentionMetadataBuilder",
    "AscendAttentionState",
    "AscendLightningIndexer",
    "AscendMetadata",
    "AscendSFAImpl",
    "AscendSFAIndexerBackend",
    "AttentionMaskBuilder",
    "GraphTaskCase",
    "__version__",
    "ascend_indexer_forward",
    "graph_task_cases",
    "select_backend",
    "selftest_cases",
]
