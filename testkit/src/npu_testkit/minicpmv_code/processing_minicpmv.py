# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``MiniCPMVProcessor`` of MiniCPM-V 2.6: each ``(<image>./</image>)`` of a prompt becomes the image processor's
placeholder text of that prompt's next image (numbered from 0 within the prompt), then the text is tokenized.

A video is its frames as images (vLLM passes each video's ``[T, H, W, 3]`` frames with ``max_slice_nums=1``).
``__call__(text, images, max_slice_nums, use_image_id, return_tensors)`` returns ``input_ids`` (and
``attention_mask``; right-padded when the prompts differ in length) plus the image processor's ``pixel_values``,
``image_sizes`` and ``tgt_sizes`` (per prompt, see ``image_processing_minicpmv``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin

IMAGE_PATTERN = "(<image>./</image>)"


def _is_group(item: Any) -> bool:
    """One prompt's images: a list / tuple of images, or a video (``[T, H, W, 3]`` frames)."""
    return isinstance(item, (list, tuple)) or (isinstance(item, np.ndarray) and item.ndim == 4)


def _as_images(item: Any) -> list[Image.Image]:
    """PIL images from an image, an ``[H, W, 3]`` / ``[T, H, W, 3]`` uint8 array (a video's frames) or a list."""
    if isinstance(item, Image.Image):
        return [item]
    if isinstance(item, np.ndarray):
        return [Image.fromarray(frame) for frame in (item if item.ndim == 4 else item[None])]
    return [image for part in item for image in _as_images(part)]


class MiniCPMVProcessor(ProcessorMixin):
    attributes = ["image_processor", "tokenizer"]
    image_processor_class = "AutoImageProcessor"
    tokenizer_class = "AutoTokenizer"

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, **kwargs: Any) -> None:
        super().__init__(image_processor, tokenizer, **kwargs)

    def __call__(  # type: ignore[override]
        self,
        text: str | list[str],
        images: Any = None,
        max_slice_nums: int | None = None,
        use_image_id: bool | None = None,
        return_tensors: str | None = None,
        **kwargs: Any,
    ) -> BatchFeature:
        prompts = [text] if isinstance(text, str) else list(text)
        if images is None:
            per_prompt: list[list[Image.Image]] = [[] for _ in prompts]
        elif len(images) == len(prompts) and all(_is_group(i) for i in images):
            per_prompt = [_as_images(i) for i in images]
        elif len(prompts) == 1:
            per_prompt = [_as_images(images)]
        else:
            raise ValueError(f"{len(prompts)} prompts but images for {len(images)}")
        expanded = []
        for prompt, prompt_images in zip(prompts, per_prompt):
            pieces = prompt.split(IMAGE_PATTERN)
            if len(pieces) - 1 != len(prompt_images):
                raise ValueError(f"prompt has {len(pieces) - 1} {IMAGE_PATTERN} for {len(prompt_images)} images")
            out = pieces[0]
            for idx, (image, piece) in enumerate(zip(prompt_images, pieces[1:])):
                out += self.image_processor.get_slice_image_placeholder(
                    image.size, idx, max_slice_nums=max_slice_nums, use_image_id=use_image_id
                )
                out += piece
            expanded.append(out)
        ids = [self.tokenizer.encode(p) for p in expanded]
        width = max(len(i) for i in ids)
        pad = self.tokenizer.pad_token_id or 0
        data: dict[str, Any] = {
            "input_ids": torch.tensor([i + [pad] * (width - len(i)) for i in ids]),
            "attention_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids]),
        }
        if any(per_prompt):
            data.update(self.image_processor.preprocess(per_prompt, max_slice_nums=max_slice_nums).data)
        return BatchFeature(data=data)
