# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Qwen vision-language models on Ascend: overrides of vLLM 0.11's Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE.

Each class is vLLM's model class with one difference: its vision tower's attention runs the NPU path of
:mod:`vllm_npu.models.vision` (vision rotary through npu-ops' ``rotary_mul_qk``, attention through npu-attention's
``vision_attention``), and for Qwen2-VL / Qwen2.5-VL the tower's head dim is padded to 128 after the weights load,
as vllm-ascend v0.11.0 does (it runs Qwen3-VL's tower unpadded, and so do we). Everything else is vLLM's: the
processor, the patch embedding and merger, the language model, whose MRoPE already runs through npu-ops'
``NPUMRotaryEmbedding`` (a CustomOp override), the multimodal embedding merge and the weight loading.

A tower that vLLM does not build here (``limit_mm_per_prompt`` of 0 for every modality: ``visual`` is None) is left
alone.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration
from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration
from vllm.model_executor.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration

from .vision import adopt_vision_attention, pad_vision_heads


class _NPUVisionTower:
    """The override's two steps: convert the tower after vLLM built the model, pad its heads after the load."""

    #: Whether the vision head dim is padded to 128 after loading (vllm-ascend v0.11.0's choice per architecture).
    pad_vision_head_dim: bool = False

    def _tower(self) -> nn.Module | None:
        visual: nn.Module | None = getattr(self, "visual", None)  # vLLM's attribute (None: no modality enabled)
        return visual

    def _adopt_npu_vision(self) -> None:
        tower = self._tower()
        if tower is not None:
            adopt_vision_attention(tower, pad_head_dim=self.pad_vision_head_dim)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = super().load_weights(weights)  # type: ignore[misc]
        tower = self._tower()
        if tower is not None:
            pad_vision_heads(tower)
        return loaded


class AscendQwen2VLForConditionalGeneration(_NPUVisionTower, Qwen2VLForConditionalGeneration):
    """Qwen2-VL (``Qwen2VLForConditionalGeneration``) with the NPU vision attention, head dim padded to 128."""

    pad_vision_head_dim = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._adopt_npu_vision()


class AscendQwen2_5_VLForConditionalGeneration(_NPUVisionTower, Qwen2_5_VLForConditionalGeneration):
    """Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``) with the NPU vision attention (window and full blocks),
    head dim padded to 128."""

    pad_vision_head_dim = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._adopt_npu_vision()


class AscendQwen3VLForConditionalGeneration(_NPUVisionTower, Qwen3VLForConditionalGeneration):
    """Qwen3-VL (``Qwen3VLForConditionalGeneration``) with the NPU vision attention (DeepStack mergers unchanged)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._adopt_npu_vision()


class AscendQwen3VLMoeForConditionalGeneration(_NPUVisionTower, Qwen3VLMoeForConditionalGeneration):
    """Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``) with the NPU vision attention; its MoE layers are
    vLLM's FusedMoE, which npu-ops overrides."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._adopt_npu_vision()
