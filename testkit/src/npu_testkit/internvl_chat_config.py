# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The configuration classes of a remote-code InternVL2 / InternVL2.5 checkpoint (``model_type: internvl_chat``,
``InternVLChatModel``), written for the testkit's tiny checkpoints.

Released InternVL2/2.5 repos ship their config class as hub code (``auto_map.AutoConfig``), which transformers 4.57
does not have and CI cannot download. :func:`npu_testkit.internvl_models.build_tiny_internvl_chat_model` copies this
file into the checkpoint dir as ``configuration_internvl_chat.py`` and names it in ``auto_map``, so vLLM loads it
with ``trust_remote_code`` exactly as it loads the hub's. The classes carry the fields those config.json files have
and vLLM 0.11's ``InternVLChatModel`` / ``InternVisionModel`` / ``InternVLProcessor`` read; the language model's
config is transformers' own class for ``llm_config.model_type``.

This file is loaded as a standalone module by transformers: it imports transformers only.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig


class InternVisionConfig(PretrainedConfig):
    """InternViT (``intern_vit_6b``: the 300M and 6B towers alike): square ``image_size`` / ``patch_size`` ints, a
    fused ``qkv`` with ``qkv_bias``, optional RMS q/k norm (``qk_normalization``), ``norm_type`` "layer_norm" or
    "rms_norm", layer scales initialised to ``initializer_factor``."""

    model_type = "intern_vit_6b"

    def __init__(
        self,
        num_channels: int = 3,
        patch_size: int = 14,
        image_size: int = 448,
        qkv_bias: bool = False,
        hidden_size: int = 1024,
        num_attention_heads: int = 16,
        intermediate_size: int = 4096,
        qk_normalization: bool = False,
        num_hidden_layers: int = 24,
        use_flash_attn: bool = False,
        hidden_act: str = "gelu",
        norm_type: str = "layer_norm",
        layer_norm_eps: float = 1e-6,
        dropout: float = 0.0,
        drop_path_rate: float = 0.0,
        attention_dropout: float = 0.0,
        initializer_range: float = 0.02,
        initializer_factor: float = 0.1,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.num_channels = num_channels
        self.patch_size = patch_size
        self.image_size = image_size
        self.qkv_bias = qkv_bias
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.qk_normalization = qk_normalization
        self.num_hidden_layers = num_hidden_layers
        self.use_flash_attn = use_flash_attn
        self.hidden_act = hidden_act
        self.norm_type = norm_type
        self.layer_norm_eps = layer_norm_eps
        self.dropout = dropout
        self.drop_path_rate = drop_path_rate
        self.attention_dropout = attention_dropout
        self.initializer_range = initializer_range
        self.initializer_factor = initializer_factor


class InternVLChatConfig(PretrainedConfig):
    """InternVL2 / 2.5: ``vision_config`` (InternViT), ``llm_config`` (any transformers text config, chosen by its
    ``model_type``), the projector's pixel-shuffle ``downsample_ratio`` and ``ps_version``, the ViT layer whose
    output is used (``select_layer``), and the dynamic tiling (``dynamic_image_size``, ``min/max_dynamic_patch``,
    ``use_thumbnail``, tile side ``force_image_size``)."""

    model_type = "internvl_chat"
    is_composition = True

    def __init__(
        self,
        vision_config: dict[str, Any] | None = None,
        llm_config: dict[str, Any] | None = None,
        use_backbone_lora: int = 0,
        use_llm_lora: int = 0,
        select_layer: int = -1,
        force_image_size: int | None = None,
        downsample_ratio: float = 0.5,
        template: str | None = None,
        dynamic_image_size: bool = False,
        use_thumbnail: bool = False,
        ps_version: str = "v1",
        min_dynamic_patch: int = 1,
        max_dynamic_patch: int = 6,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.vision_config = InternVisionConfig(**(vision_config or {}))
        llm = dict(llm_config or {})
        self.llm_config = AutoConfig.for_model(llm.pop("model_type", "qwen2"), **llm)
        self.use_backbone_lora = use_backbone_lora
        self.use_llm_lora = use_llm_lora
        self.select_layer = select_layer
        self.force_image_size = force_image_size
        self.downsample_ratio = downsample_ratio
        self.template = template
        self.dynamic_image_size = dynamic_image_size
        self.use_thumbnail = use_thumbnail
        self.ps_version = ps_version
        self.min_dynamic_patch = min_dynamic_patch
        self.max_dynamic_patch = max_dynamic_patch
