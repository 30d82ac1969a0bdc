# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm_npu.attention: the public API of the attention layer.

Importing this package is cheap (exports load on first access): vLLM imports it in every process when it
discovers plugins.
"""

from vllm_npu.interface.lazy import lazy_exports

from ._version import __version__ as __version__

_EXPORTS: dict[str, str] = {
    "selftest_cases": ".selftest:selftest_cases",
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
    # The sparse-attention (DeepSeek-V3.2) pieces npu-models' model override builds on.
    "AscendSFAImpl": ".backends.sfa:AscendSFAImpl",
    "AscendSFAIndexerBackend": ".backends.sfa:AscendSFAIndexerBackend",
    "AscendLightningIndexer": ".backends.sfa:AscendLightningIndexer",
    "ascend_indexer_forward": ".backends.sfa:ascend_indexer_forward",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted([*_EXPORTS, "__version__"])
