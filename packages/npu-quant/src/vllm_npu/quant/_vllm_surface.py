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
)
