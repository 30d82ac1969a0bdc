# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``MiniCPMVImageProcessor`` of MiniCPM-V 2.6: LLaVA-UHD slicing and the placeholder text of each image.

An image becomes a *source* slice (the whole image resized so its area is about ``scale_resolution**2``, sides
multiples of ``patch_size``) plus, when its area exceeds ``scale_resolution**2``, a ``cols x rows`` grid of slices
of a refined resize (the grid whose aspect ratio is nearest the image's among the splits into ``n - 1``, ``n``,
``n + 1`` slices, ``n = ceil(area / scale_resolution**2)`` capped at ``max_slice_nums``). Each slice is normalised and
laid out "by patch": ``[3, patch, n_patches * patch]`` (patch ``k`` of the row-major patch grid in columns
``k * patch ...``), with ``tgt_size = (rows of patches, cols of patches)``.

Text: ``<image_id>i</image_id>`` (when ``use_image_id``), ``<image>`` + ``image_feature_size`` x ``<unk>`` +
``</image>`` for the source, then the grid's rows (``\\n``-separated) of ``<slice>`` + ``<unk>`` x n + ``</slice>``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_processing_utils import BaseImageProcessor


def _round_to_patches(length: float, patch_size: int) -> int:
    return max(round(length / patch_size) * patch_size, patch_size)


class MiniCPMVImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values"]

    def __init__(
        self,
        max_slice_nums: int = 9,
        scale_resolution: int = 448,
        patch_size: int = 14,
        use_image_id: bool = True,
        image_feature_size: int = 64,
        im_start: str = "<image>",
        im_end: str = "</image>",
        slice_start: str = "<slice>",
        slice_end: str = "</slice>",
        unk: str = "<unk>",
        im_id_start: str = "<image_id>",
        im_id_end: str = "</image_id>",
        slice_mode: bool = True,
        norm_mean: list[float] | None = None,
        norm_std: list[float] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.max_slice_nums = max_slice_nums
        self.scale_resolution = scale_resolution
        self.patch_size = patch_size
        self.use_image_id = use_image_id
        self.image_feature_size = image_feature_size
        self.im_start, self.im_end = im_start, im_end
        self.slice_start, self.slice_end = slice_start, slice_end
        self.unk = unk
        self.im_id_start, self.im_id_end = im_id_start, im_id_end
        self.slice_mode = slice_mode
        self.norm_mean = list(norm_mean or [0.5, 0.5, 0.5])
        self.norm_std = list(norm_std or [0.5, 0.5, 0.5])
        # vLLM reads (and list-converts) ``mean`` / ``std``.
        self.mean, self.std = self.norm_mean, self.norm_std

    # --- geometry ---------------------------------------------------------------------------------------------

    def get_sliced_grid(
        self, image_size: tuple[int, int], max_slice_nums: int | None = None, never_split: bool = False
    ) -> list[int] | None:
        """``[cols, rows]`` of the slice grid of an image ``(width, height)``, None when it is not sliced."""
        max_slices = self.max_slice_nums if max_slice_nums is None else max_slice_nums
        width, height = image_size
        multiple = min(math.ceil(width * height / self.scale_resolution**2), max_slices)
        if multiple <= 1 or never_split:
            return None
        log_ratio = math.log(width / height)
        best, best_error = [1, 1], math.inf
        for count in (multiple - 1, multiple, multiple + 1):
            if count == 1 or count > max_slices:
                continue
            for cols in range(1, count + 1):
                if count % cols:
                    continue
                error = abs(log_ratio - math.log(cols / (count // cols)))
                if error < best_error:
                    best, best_error = [cols, count // cols], error
        return best

    def _best_resize(self, size: tuple[float, float], allow_upscale: bool) -> tuple[int, int]:
        width, height = size
        if width * height > self.scale_resolution**2 or allow_upscale:
            aspect = width / height
            height = int(self.scale_resolution / math.sqrt(aspect))
            width = int(height * aspect)
        return _round_to_patches(width, self.patch_size), _round_to_patches(height, self.patch_size)

    def _refine_size(self, size: tuple[int, int], grid: list[int]) -> tuple[int, int]:
        cols, rows = grid
        width, height = _round_to_patches(size[0], cols), _round_to_patches(size[1], rows)
        cell = self._best_resize((width / cols, height / rows), allow_upscale=True)
        return cell[0] * cols, cell[1] * rows

    def get_sliced_images(self, image: Image.Image, max_slice_nums: int | None = None) -> list[Image.Image]:
        """The source image then the grid's slices row by row (each resized with bicubic)."""
        if not self.slice_mode:
            return [image]
        grid = self.get_sliced_grid(image.size, max_slice_nums)
        source = image.resize(self._best_resize(image.size, allow_upscale=grid is None), Image.Resampling.BICUBIC)
        if grid is None:
            return [source]
        refined = image.resize(self._refine_size(image.size, grid), Image.Resampling.BICUBIC)
        cell_w, cell_h = refined.size[0] // grid[0], refined.size[1] // grid[1]
        slices = [
            refined.crop((x, y, x + cell_w, y + cell_h))
            for y in range(0, refined.size[1], cell_h)
            for x in range(0, refined.size[0], cell_w)
        ]
        return [source, *slices]

    # --- text -------------------------------------------------------------------------------------------------

    def get_grid_placeholder(self, grid: list[int] | None) -> str:
        if grid is None:
            return ""
        cell = self.slice_start + self.unk * self.image_feature_size + self.slice_end
        return "\n".join(cell * grid[0] for _ in range(grid[1]))

    def get_slice_image_placeholder(
        self,
        image_size: tuple[int, int],
        image_idx: int = 0,
        max_slice_nums: int | None = None,
        use_image_id: bool | None = None,
    ) -> str:
        """The text one image of ``image_size`` ``(width, height)`` stands for in the prompt (see the module doc)."""
        max_slices = self.max_slice_nums if max_slice_nums is None else max_slice_nums
        if max_slices <= 0:
            raise ValueError(f"max_slice_nums must be positive, got {max_slices}")
        text = self.im_start + self.unk * self.image_feature_size + self.im_end
        if self.use_image_id if use_image_id is None else use_image_id:
            text = f"{self.im_id_start}{image_idx}{self.im_id_end}{text}"
        if self.slice_mode:
            text += self.get_grid_placeholder(self.get_sliced_grid(image_size, max_slices))
        return text

    # --- pixels -----------------------------------------------------------------------------------------------

    def reshape_by_patch(self, image: np.ndarray) -> torch.Tensor:
        """``[3, H, W]`` -> ``[3, patch, (H / patch) * (W / patch) * patch]``, patches in row-major order."""
        p = self.patch_size
        channels, height, width = image.shape
        grid = torch.from_numpy(image).reshape(channels, height // p, p, width // p, p)
        return grid.permute(0, 2, 1, 3, 4).reshape(channels, p, -1)

    def _normalise(self, image: Image.Image) -> np.ndarray:
        pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
        pixels = (pixels - np.asarray(self.norm_mean, np.float32)) / np.asarray(self.norm_std, np.float32)
        return np.ascontiguousarray(pixels.transpose(2, 0, 1))

    def preprocess(  # type: ignore[override]
        self,
        images: Image.Image | list[Image.Image] | list[list[Image.Image]],
        do_pad: bool = True,
        max_slice_nums: int | None = None,
        return_tensors: str | None = None,
        **kwargs: Any,
    ) -> BatchFeature:
        """Per prompt (``images``: one list of images per prompt): ``pixel_values`` (list of every slice of its
        images, ``[3, patch, L]``), ``image_sizes`` (``[n_images, 2]`` width, height), ``tgt_sizes`` (``[n_slices,
        2]`` patch rows, cols)."""
        if isinstance(images, Image.Image):
            batches: list[list[Image.Image]] = [[images]]
        elif images and isinstance(images[0], Image.Image):
            batches = [list(images)]  # type: ignore[arg-type]
        else:
            batches = [list(b) for b in images]  # type: ignore[union-attr]
        pixel_values, image_sizes, tgt_sizes = [], [], []
        for batch in batches:
            slices, sizes, targets = [], [], []
            for image in batch:
                for piece in self.get_sliced_images(image, max_slice_nums):
                    array = self._normalise(piece)
                    slices.append(self.reshape_by_patch(array))
                    targets.append((array.shape[1] // self.patch_size, array.shape[2] // self.patch_size))
                sizes.append(image.size)
            pixel_values.append(slices)
            image_sizes.append(torch.tensor(sizes, dtype=torch.int64).reshape(-1, 2))
            tgt_sizes.append(torch.tensor(targets, dtype=torch.int64).reshape(-1, 2))
        return BatchFeature(data={"pixel_values": pixel_values, "image_sizes": image_sizes, "tgt_sizes": tgt_sizes})
