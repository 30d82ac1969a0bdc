# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The ops layer's CustomOp override table and its idempotent registration with vLLM.

``OOT_OPS`` maps the name of a vLLM CustomOp class (``CustomOp.register_oot`` keys on the exact class name, so
subclasses with other names keep vLLM's class) to the ``"module:Class"`` that replaces it. Nothing is imported
until :func:`register_oot_ops` runs (from the ops layer's load hook), through the interface's guarded
``register_custom_ops``.
"""

from __future__ import annotations

from vllm_npu.interface import register_custom_ops

OOT_OPS: dict[str, str] = {
    # norms
    "RMSNorm": "vllm_npu.ops.layernorm:NPURMSNorm",
    "GemmaRMSNorm": "vllm_npu.ops.layernorm:NPUGemmaRMSNorm",
    # activations
    "SiluAndMul": "vllm_npu.ops.activation:NPUSiluAndMul",
    "QuickGELU": "vllm_npu.ops.activation:NPUQuickGELU",
    # rotary embeddings
    "RotaryEmbedding": "vllm_npu.ops.rotary_embedding:NPURotaryEmbedding",
    "DeepseekScalingRotaryEmbedding": "vllm_npu.ops.rotary_embedding:NPUDeepseekScalingRotaryEmbedding",
    "YaRNScalingRotaryEmbedding": "vllm_npu.ops.rotary_embedding:NPUYaRNScalingRotaryEmbedding",
    "MRotaryEmbedding": "vllm_npu.ops.mrope:NPUMRotaryEmbedding",
    # Linear layers: vLLM's own classes and UnquantizedLinearMethod (F.linear, which torch_npu serves). Float weights
    # stay ND, as in vllm-ascend v0.11.0 (its is_enable_nz() is False for fp16/bf16/fp32, PR #4495), rather than being
    # cast to FRACTAL_NZ after loading: the NZ matmul kernel rejects N == 1 or K == 1 weights (score/reward heads),
    # float32 NZ is unsupported, vLLM reshapes some weights after loading (MLA's kv_b_proj -> W_UK_T/W_UV), and
    # whether the cast takes effect at all depends on allow_internal_format (the platform sets it False).
    # embedding, LM head, logits
    "VocabParallelEmbedding": "vllm_npu.ops.vocab_parallel_embedding:NPUVocabParallelEmbedding",
    "ParallelLMHead": "vllm_npu.ops.vocab_parallel_embedding:NPUParallelLMHead",
    "LogitsProcessor": "vllm_npu.ops.vocab_parallel_embedding:NPULogitsProcessor",
    # MoE
    "FusedMoE": "vllm_npu.ops.moe.layer:AscendFusedMoE",
    "SharedFusedMoE": "vllm_npu.ops.moe.layer:AscendSharedFusedMoE",
}


def register_oot_ops(table: dict[str, str] | None = None) -> list[str]:
    """Register every override of ``table`` (default :data:`OOT_OPS`) with ``CustomOp.register_oot``, once per
    process. Returns the vLLM class names registered by this call (already-registered ones are not repeated)."""
    return register_custom_ops(OOT_OPS if table is None else table, owner="vllm_npu.ops")
