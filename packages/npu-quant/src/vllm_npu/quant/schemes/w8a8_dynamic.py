# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""W8A8_DYNAMIC: int8 weights with a per-output-channel scale, int8 activations quantized per token at run time.

Maths: ``x_q, s_t = dynamic_quant(x)`` (``s_t = max|x_t| / 127``); ``y[t, n] = (x_q[t] · W_q[n]) * s_w[n] * s_t
+ bias[n]``. ``weight_offset`` must be zero (symmetric weights; the kernel has no weight zero point).
"""

from __future__ import annotations

import torch

from .. import kernels
from ..params import FLOATS, TensorSpec, drop_param, loaded_names, param, replace_param
from .base import LinearScheme, LinearShape, flat2d, require_int_range, require_positive, require_zero_if_loaded


class W8A8DynamicScheme(LinearScheme):
    name = "W8A8_DYNAMIC"

    def __init__(self) -> None:
        self._dq = kernels.dynamic_quant.select()
        self._qmm = kernels.quant_matmul.select()

    def specs(self, shape: LinearShape) -> list[TensorSpec]:
        n, k = shape.n, shape.k
        return [
            TensorSpec("weight", (n, k), torch.int8, output_dim=0, input_dim=1),
            TensorSpec("weight_scale", (n, 1), torch.float32, accept=FLOATS, output_dim=0),
            TensorSpec("weight_offset", (n, 1), torch.float32, accept=FLOATS, output_dim=0, required=False),
        ]

    def process(self, layer: torch.nn.Module, shape: LinearShape) -> None:
        p = shape.prefix
        require_positive(param(layer, "weight_scale").data, f"{p}.weight_scale")
        require_int_range(param(layer, "weight").data, -128, 127, f"{p}.weight")
        require_zero_if_loaded(layer, "weight_offset", loaded_names(layer), f"{p}.weight_offset")
        replace_param(layer, "weight", param(layer, "weight").data.t().contiguous())  # [K, N]
        replace_param(layer, "weight_scale", param(layer, "weight_scale").data.reshape(-1).float())
        drop_param(layer, "weight_offset")

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2, lead = flat2d(x)
        xq, s = self._dq(x2)
        out = self._qmm(xq, param(layer, "weight"), param(layer, "weight_scale"), s, bias, x.dtype)
        return out.reshape(*lead, out.shape[-1])
