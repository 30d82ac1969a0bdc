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
from vllm.model_executor.models.idefics2_vision_model import Idefics2VisionTransformer
from vllm.model_executor.models.interns1 import InternS1ForConditionalGeneration
from vllm.model_executor.models.internvl import InternVLChatModel
from vllm.model_executor.models.minicpmv import MiniCPMV
from vllm.model_executor.models.qwen2_5_omni_thinker import (
    Qwen2_5OmniThinkerDummyInputsBuilder,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2_5OmniThinkerMultiModalProcessor,
    Qwen2_5OmniThinkerProcessingInfo,
)
from vllm.model_executor.models.qwen2_audio import Qwen2AudioForConditionalGeneration
from vllm.multimodal import MULTIMODAL_REGISTRY

from .audio_input import warn_without_audio_decoder
from .encoder_attention import adopt_encoder_attention, key_padding, prefix_lengths
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


class AscendIdefics2VisionTransformer(Idefics2VisionTransformer):
    """MiniCPM-V's Idefics2/SigLIP navit tower (vLLM's, re-classed by :class:`AscendMiniCPMV`) whose encoder attention
    honours the patch mask: MiniCPM-V batches every slice of a step into one call, padded to the longest, and its
    model masks the padded patches out of attention. vLLM 0.11's tower ignores the mask there, so a slice batched
    with a longer one attends padding (a sliced 3x5-patch image next to a 4x4 one: other greedy tokens than the
    model's; vLLM fixed it later for MiniCPM only, vllm#34127 / #36206). The mask's per-row prefix lengths go to
    the seam's :func:`~vllm_npu.models.encoder_attention.key_padding` (one host read of the mask per tower call;
    vLLM's own MiniCPM-V code reads ``tgt_sizes`` back several times per call already). A mask that is no prefix
    mask, and the data-parallel encoder (which shards the batch), keep vLLM's behaviour."""

    def forward(
        self,
        pixel_values: torch.Tensor,
        patch_attention_mask: torch.BoolTensor | None = None,
        tgt_sizes: torch.IntTensor | None = None,
    ) -> torch.Tensor:
        lens = None
        if patch_attention_mask is not None and not self.use_data_parallel:
            lens = prefix_lengths(patch_attention_mask.flatten(1))
        with key_padding(self.encoder, lens):
            out: torch.Tensor = super().forward(
                pixel_values, patch_attention_mask=patch_attention_mask, tgt_sizes=tgt_sizes
            )
        return out


class AscendMiniCPMV(MiniCPMV):
    """MiniCPM-V 2.x / 4.x (``MiniCPMV``): vLLM's ``MiniCPMV.__new__`` builds the class of the checkpoint's version
    (an instance of a sibling class, so no ``__init__`` of ours runs); the Idefics2/SigLIP tower of that instance is
    put on the NPU kernel here and re-classed to :class:`AscendIdefics2VisionTransformer` (padded slices masked, as
    the model does). (MiniCPM-V 2.0's timm ViT has no vLLM ``MultiHeadAttention`` and is left as is.)"""

    def __new__(cls, *, vllm_config: VllmConfig, prefix: str = "") -> Any:
        model = super().__new__(cls, vllm_config=vllm_config, prefix=prefix)
        adopt_encoder_attention(model)
        if type(getattr(model, "vpm", None)) is Idefics2VisionTransformer:
            model.vpm.__class__ = AscendIdefics2VisionTransformer
        return model


class AscendQwen2AudioForConditionalGeneration(Qwen2AudioForConditionalGeneration):
    """Qwen2-Audio (``Qwen2AudioForConditionalGeneration``): the Whisper-style audio encoder (transformers'
    ``Qwen2AudioEncoder``) on the NPU kernel."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        adopt_encoder_attention(self, hf_towers=("audio_tower",))
        warn_without_audio_decoder("Qwen2AudioForConditionalGeneration", vllm_config)


#: Why ``use_audio_in_video`` is refused (vLLM 0.11.0-0.11.2; upstream added it to the V1 engine later, vllm#33605).
AUDIO_IN_VIDEO_REFUSAL = (
    "use_audio_in_video=True is not supported for Qwen2.5-Omni on vLLM 0.11: the video's audio is interleaved with "
    "its frames inside one placeholder, which needs overlapping audio/video placeholders that vLLM 0.11's V1 engine "
    "does not have (its processor fails to place the audio; with the processor cache off, the engine's MRoPE "
    "positions index past the audio lengths and the engine dies). Send the audio track as an audio item with its "
    "own audio placeholder instead (the model then reads audio and frames one after the other)."
)


class AscendQwen2_5OmniThinkerMultiModalProcessor(Qwen2_5OmniThinkerMultiModalProcessor):
    """vLLM's Omni thinker processor, refusing ``use_audio_in_video`` by name (:data:`AUDIO_IN_VIDEO_REFUSAL`)
    before vLLM would fail on it: an opaque ``AssertionError`` per request, or a dead engine core."""

    def apply(self, prompt: Any, mm_data: Any, hf_processor_mm_kwargs: Any, *args: Any, **kwargs: Any) -> Any:
        if hf_processor_mm_kwargs.get("use_audio_in_video"):
            raise ValueError(AUDIO_IN_VIDEO_REFUSAL)
        return super().apply(prompt, mm_data, hf_processor_mm_kwargs, *args, **kwargs)


@MULTIMODAL_REGISTRY.register_processor(
    AscendQwen2_5OmniThinkerMultiModalProcessor,
    info=Qwen2_5OmniThinkerProcessingInfo,
    dummy_inputs=Qwen2_5OmniThinkerDummyInputsBuilder,
)
class AscendQwen2_5OmniThinkerForConditionalGeneration(Qwen2_5OmniThinkerForConditionalGeneration):
    """The Qwen2.5-Omni thinker (``Qwen2_5OmniModel`` / ``Qwen2_5OmniForConditionalGeneration``: text out; vLLM 0.11
    serves no talker): the Qwen2.5-VL vision tower on :mod:`vllm_npu.models.vision` (heads padded to 128) and the
    audio encoder (transformers' ``Qwen2_5OmniAudioEncoder``) on the NPU kernel; ``use_audio_in_video`` refused by
    name (:class:`AscendQwen2_5OmniThinkerMultiModalProcessor`)."""

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
