# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Multimodal families beyond Qwen-VL on Ascend: overrides of vLLM 0.11's Qwen2.5-Omni thinker, Gemma-3, InternVL,
MiniCPM-V and Qwen2-Audio.

Each class is vLLM's model class (processor, projector, language model, weight loading and embedding merge
unchanged) whose encoders are put on the NPU kernel after vLLM built them:

* the vLLM-built ViTs (SigLIP, Idefics2, InternViT) and the transformers-built audio encoders through the shared
  seam :func:`vllm_npu.models.encoder_attention.adopt_encoder_attention`;
* the Qwen2.5-Omni thinker's vision tower, which is vLLM's Qwen2.5-VL tower, through
  :mod:`vllm_npu.models.vision` exactly like Qwen2.5-VL (head dim 80 padded to 128 after the load, as vllm-ascend
  v0.11.0's ``AscendQwen2_5OmniThinkerForConditionalGeneration`` does by reusing its padded Qwen2.5-VL tower). Its
  TMRoPE positions are vLLM's ``MRotaryEmbedding.get_input_positions_tensor`` (host side, per request) and the
  rotation runs through npu-ops' MRoPE override like every Qwen MRoPE model.

Overrides are registered per architecture (not a global patch of ``MultiHeadAttention``): a model outside this
list keeps vLLM's encoder path, and the list is what is tested.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.gemma3_mm import Gemma3ForConditionalGeneration
from vllm.model_executor.models.interns1 import InternS1ForConditionalGeneration
from vllm.model_executor.models.internvl import InternVLChatModel
from vllm.model_executor.models.minicpmv import MiniCPMV
from vllm.model_executor.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerForConditionalGeneration
from vllm.model_executor.models.qwen2_audio import Qwen2AudioForConditionalGeneration

from .audio_input import warn_without_audio_decoder
from .encoder_attention import adopt_encoder_attention
from .vision import adopt_vision_attention, pad_vision_heads


class AscendGemma3ForConditionalGeneration(Gemma3ForConditionalGeneration):
    """Gemma-3 (``Gemma3ForConditionalGeneration``): the SigLIP tower's attention on the NPU kernel."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        adopt_encoder_attention(self)


class AscendInternVLChatModel(InternVLChatModel):
    """InternVL2 / InternVL2.5 (``InternVLChatModel``, remote-code checkpoints): InternViT's attention on the NPU
    kernel."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        adopt_encoder_attention(self)


class AscendInternS1ForConditionalGeneration(InternS1ForConditionalGeneration):
    """InternVL in transformers' format (``InternVLForConditionalGeneration``, which vLLM 0.11 serves with its
    InternS1 class) and Intern-S1: the vision tower's attention on the NPU kernel."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        adopt_encoder_attention(self)


class AscendMiniCPMV(MiniCPMV):
    """MiniCPM-V 2.x / 4.x (``MiniCPMV``): vLLM's ``MiniCPMV.__new__`` builds the class of the checkpoint's version
    (an instance of a sibling class, so no ``__init__`` of ours runs); the Idefics2/SigLIP tower of that instance is
    put on the NPU kernel here. (MiniCPM-V 2.0's timm ViT has no vLLM ``MultiHeadAttention`` and is left as is.)"""

    def __new__(cls, *, vllm_config: VllmConfig, prefix: str = "") -> Any:
        model = super().__new__(cls, vllm_config=vllm_config, prefix=prefix)
        adopt_encoder_attention(model)
        return model


class AscendQwen2AudioForConditionalGeneration(Qwen2AudioForConditionalGeneration):
    """Qwen2-Audio (``Qwen2AudioForConditionalGeneration``): the Whisper-style audio encoder (transformers'
    ``Qwen2AudioEncoder``) on the NPU kernel."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        adopt_encoder_attention(self, hf_towers=("audio_tower",))
        warn_without_audio_decoder("Qwen2AudioForConditionalGeneration", vllm_config)


class AscendQwen2_5OmniThinkerForConditionalGeneration(Qwen2_5OmniThinkerForConditionalGeneration):
    """The Qwen2.5-Omni thinker (``Qwen2_5OmniModel`` / ``Qwen2_5OmniForConditionalGeneration``: text out; vLLM 0.11
    serves no talker): the Qwen2.5-VL vision tower on :mod:`vllm_npu.models.vision` (heads padded to 128) and the
    audio encoder (transformers' ``Qwen2_5OmniAudioEncoder``) on the NPU kernel."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if self.visual is not None:
            adopt_vision_attention(self.visual, pad_head_dim=True)
        adopt_encoder_attention(self, hf_towers=("audio_tower",))
        warn_without_audio_decoder("Qwen2.5-Omni", vllm_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = super().load_weights(weights)
        if self.visual is not None:
            pad_vision_heads(self.visual)
        return loaded
