# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``MiniCPMVConfig`` of a MiniCPM-V 2.6 checkpoint: a Qwen2 language model config plus the vision and resampler
fields vLLM 0.11's ``minicpmv.py`` reads (``version``, ``query_num``, ``image_size``, ``drop_vision_last_layer``,
``vision_config``: the SigLIP/Idefics2 navit tower)."""

from __future__ import annotations

from typing import Any

from transformers import Qwen2Config, SiglipVisionConfig


class MiniCPMVConfig(Qwen2Config):
    model_type = "minicpmv"

    def __init__(
        self,
        vision_config: dict[str, Any] | SiglipVisionConfig | None = None,
        query_num: int = 64,
        image_size: int = 448,
        drop_vision_last_layer: bool = False,
        batch_vision_input: bool = True,
        slice_mode: bool = True,
        use_image_id: bool = True,
        slice_config: dict[str, Any] | None = None,
        version: float = 2.6,
        **kwargs: Any,
    ) -> None:
        if isinstance(vision_config, SiglipVisionConfig):
            self.vision_config = vision_config
        else:
            self.vision_config = SiglipVisionConfig(**(vision_config or {}))
        self.query_num = query_num
        self.image_size = image_size
        self.drop_vision_last_layer = drop_vision_last_layer
        self.batch_vision_input = batch_vision_input
        self.slice_mode = slice_mode
        self.use_image_id = use_image_id
        self.slice_config = slice_config or {"max_slice_nums": 9, "patch_size": 14, "scale_resolution": image_size}
        self.version = version
        super().__init__(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = super().to_dict()
        out["vision_config"] = self.vision_config.to_dict()
        return out
