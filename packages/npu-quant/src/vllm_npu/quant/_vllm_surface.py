# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The vLLM internals the quant layer calls, with the vLLM 0.11.0 signatures. Checked by
``tests/test_vllm_surface.py`` and ``vllm-npu doctor --vllm-surface``; see :mod:`vllm_npu.interface.vllm_surface`."""

from __future__ import annotations

from vllm_npu.interface import VllmName

SURFACE: tuple[VllmName, ...] = (
    VllmName(
        "vllm.config:VllmConfig",
        "_get_quantization_config",
        "method",
        "calls",
        ("vllm_npu.quant.detect",),
        "claiming a ModelSlim checkpoint rebuilds VllmConfig.quant_config through it, the way VllmConfig's own "
        "__post_init__ does",
        signature="(model_config, load_config)",
    ),
    VllmName(
        "vllm.model_executor.layers.fused_moe.layer:FusedMoE",
        "_map_global_expert_id_to_local_expert_id",
        "method",
        "calls",
        ("vllm_npu.quant.moe_method",),
        "the quantized MoE weight loader drops the experts another expert-parallel rank owns through it",
        signature="(self, expert_id)",
    ),
    VllmName(
        "vllm.model_executor.layers.quantization.kv_cache:BaseKVCacheMethod",
        "create_weights",
        "method",
        "overrides",
        ("vllm_npu.quant.kv_c8",),
        "vLLM's Attention asserts its quant method is a BaseKVCacheMethod and calls create_weights(layer) in its "
        "__init__: the C8 method registers the per-channel K/V scale parameters there",
        signature="(self, layer)",
    ),
    VllmName(
        "vllm.model_executor.layers.quantization.kv_cache:BaseKVCacheMethod",
        "process_weights_after_loading",
        "method",
        "overrides",
        ("vllm_npu.quant.kv_c8",),
        "the C8 method checks the loaded scales and moves msModelSlim's k/v_proj holders onto the attention layer "
        "there; vLLM's own version would log an fp8 warning for the int8 cache",
        signature="(self, layer)",
    ),
)
