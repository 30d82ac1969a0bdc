# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""W4A8_DYNAMIC for linear layers: int4 weights with two-level scales, run weight-only (as vllm-ascend does).

Weights: ``W[n, k] ≈ W4[n, k] * weight_scale[n] * weight_scale_second[n, k // group_size]`` with W4 in [-8, 7]
(symmetric: ``weight_offset``/``weight_offset_second`` must be zero). The forward is
``npu_weight_quant_batchmatmul(x, W4 packed, antiquant_scale=(weight_scale * weight_scale_second)ᵀ, group_size)``,
i.e. activations stay in floating point (the W4A8_DYNAMIC MoE experts run weight-only as well).
Unlike vllm-ascend, the layer bias is added (it drops it).

Two disk formats:

- version "0" (default): ``weight [N, K] int8``, one int4 value per byte;
- version "1.0.0": ``weight [N/2, K] int8`` with two int4 values per byte along N (row 2i in the low nibble) and an
  extra ``scale_bias`` (``[N, 16]`` for row-parallel layers, ``[N, 1]`` otherwise, float32), unused by the symmetric
  kernels but validated when present.

``group_size == 0`` means per-channel (no ``*_second`` tensors).
"""

from __future__ import annotations

import torch

from .. import kernels
from ..params import FLOATS, QuantLoadError, TensorSpec, drop_param, loaded_names, param, replace_param
from .base import LinearScheme, LinearShape, flat2d, require_int_range, require_positive, require_zero_if_loaded


class W4A8DynamicScheme(LinearScheme):
    name = "W4A8_DYNAMIC"

    def __init__(self, group_size: int, version: str) -> None:
        self.group_size = group_size
        self.packed = version == "1.0.0"
        self._wqbmm = kernels.weight_quant_batchmatmul.select()
        self._pack = kernels.int4pack.select()

    def specs(self, shape: LinearShape) -> list[TensorSpec]:
        n, k, g = shape.n, shape.k, self.group_size
        if n % 8:
            raise QuantLoadError(
                f"{shape.prefix}: W4A8_DYNAMIC packs 8 int4 values along the output dim; N={n} is not a multiple of 8"
            )
        if g and k % g:
            raise QuantLoadError(
                f"{shape.prefix}: input size {k} (per rank) is not a multiple of group_size {g}; use a smaller "
                "tensor-parallel size or a checkpoint exported with a group size dividing it"
            )
        specs = [
            TensorSpec("weight", (n // 2, k), torch.int8, output_dim=0, input_dim=1, packed_dim=0, packed_factor=2)
            if self.packed
            else TensorSpec("weight", (n, k), torch.int8, output_dim=0, input_dim=1),
            TensorSpec("weight_scale", (n, 1), torch.float32, accept=FLOATS, output_dim=0),
            TensorSpec("weight_offset", (n, 1), torch.float32, accept=FLOATS, output_dim=0, required=False),
        ]
        if g:
            specs += [
                TensorSpec("weight_scale_second", (n, k // g), torch.float32, accept=FLOATS, output_dim=0, input_dim=1),
                TensorSpec(
                    "weight_offset_second",
                    (n, k // g),
                    torch.float32,
                    accept=FLOATS,
                    output_dim=0,
                    input_dim=1,
                    required=False,
                ),
            ]
        if self.packed:
            specs.append(
                TensorSpec(
                    "scale_bias",
                    (n, 16 if shape.row_parallel else 1),
                    torch.float32,
                    accept=FLOATS,
                    output_dim=0,
                    required=False,
                )
            )
        return specs

    def process(self, layer: torch.nn.Module, shape: LinearShape) -> None:
        p, dt = shape.prefix, shape.params_dtype
        loaded = loaded_names(layer)
        require_positive(param(layer, "weight_scale").data, f"{p}.weight_scale")
        require_zero_if_loaded(layer, "weight_offset", loaded, f"{p}.weight_offset")
        if self.group_size:
            require_positive(param(layer, "weight_scale_second").data, f"{p}.weight_scale_second")
            require_zero_if_loaded(layer, "weight_offset_second", loaded, f"{p}.weight_offset_second")
            scale = (
                param(layer, "weight_scale").data.float() * param(layer, "weight_scale_second").data.float()
            )  # [N, G]
        else:
            scale = param(layer, "weight_scale").data.float()  # [N, 1]
        if self.packed:
            # Two int4 per byte along N: after the transpose, 4 bytes in a row are 8 consecutive outputs -> int32.
            w_kn = param(layer, "weight").data.t().contiguous()  # [K, N/2]
            if w_kn.shape[-1] % 4:
                raise QuantLoadError(f"{p}.weight: packed width {w_kn.shape[-1]} is not a multiple of 4")
            packed = w_kn.view(torch.int32)  # [K, N/8]
        else:
            require_int_range(param(layer, "weight").data, -8, 7, f"{p}.weight (int4 values)")
            packed = self._pack(param(layer, "weight").data.t().contiguous().to(torch.int32))  # [K, N/8]
        replace_param(layer, "weight", packed)
        replace_param(layer, "antiquant_scale", scale.t().contiguous().to(dt))  # [G, N] (or [1, N])
        for name in ("weight_scale", "weight_offset", "weight_scale_second", "weight_offset_second", "scale_bias"):
            drop_param(layer, name)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2, lead = flat2d(x)
        out = self._wqbmm(x2, param(layer, "weight"), param(layer, "antiquant_scale").to(x.dtype), self.group_size)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.reshape(*lead, out.shape[-1])
