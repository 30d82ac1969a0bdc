# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""W4A4_FLATQUANT_DYNAMIC: int4 weights and int4 per-token activations after a Kronecker (FlatQuant) transform.

The input features K are factored as ``K = L * R`` (:func:`decompose_dim`: ``K = a² − b²``, ``L = a − b``,
``R = a + b``). With ``P = left_trans ⊗ right_trans`` the checkpoint stores ``W' = W P⁻ᵀ`` quantized per output
channel (symmetric int4, ``weight_scale [N, 1]`` float32), and the layer computes::

    x' = x P            (row-major: X'_t = left_transᵀ · X_t · right_trans, X_t = x_t viewed as [L, R])
    q, s_t = int4 per token of x' with clipping (clip_ratio)
    y = (q · W4ᵀ) * weight_scale * s_t + bias

At load ``left_trans`` is transposed (the kernel's ``p1``) and the weight is packed 8 int4 per int32 along K.
See :func:`vllm_npu.quant.kernels._kronecker_quant_ref` for the assumed order of operations of
``npu_kronecker_quant`` (undocumented beyond "two small matmuls, then quantize").
"""

from __future__ import annotations

import math

import torch

from .. import kernels
from ..params import FLOATS, QuantLoadError, TensorSpec, drop_param, loaded_names, param, replace_param
from .base import LinearScheme, LinearShape, flat2d, require_int_range, require_positive, require_zero_if_loaded


def decompose_dim(k: int) -> tuple[int, int]:
    """The (L, R) factorisation of ``k`` used by msModelSlim's FlatQuant: the smallest ``a >= sqrt(k)`` with
    ``a² − k`` a perfect square ``b²``; ``L = a − b``, ``R = a + b``."""
    a = math.isqrt(k)
    if a * a < k:
        a += 1
    while True:
        b = math.isqrt(a * a - k)
        if b * b == a * a - k:
            return a - b, a + b
        a += 1


class W4A4FlatQuantScheme(LinearScheme):
    name = "W4A4_FLATQUANT_DYNAMIC"

    def __init__(self) -> None:
        self._kq = kernels.kronecker_quant.select()
        self._qmm = kernels.quant_matmul.select()
        self._pack = kernels.int4pack.select()

    def specs(self, shape: LinearShape) -> list[TensorSpec]:
        n, k, dt = shape.n, shape.k, shape.params_dtype
        if shape.row_parallel and shape.tp_size > 1:
            raise QuantLoadError(
                f"{shape.prefix}: W4A4_FLATQUANT_DYNAMIC transforms the full input of a layer, which a row-parallel "
                f"layer splits over {shape.tp_size} ranks; run this checkpoint with tensor_parallel_size=1"
            )
        nl, nr = decompose_dim(k)
        if k % 8 or nr % 8:
            raise QuantLoadError(
                f"{shape.prefix}: input size {k} factors as L={nl} x R={nr}; the int4 kernels need K and R divisible by 8"
            )
        self.l, self.r = nl, nr
        return [
            TensorSpec("weight", (n, k), torch.int8, output_dim=0, input_dim=1),
            TensorSpec("left_trans", (nl, nl), dt, accept=FLOATS, shared=True),
            TensorSpec("right_trans", (nr, nr), dt, accept=FLOATS, shared=True),
            TensorSpec("clip_ratio", (1,), torch.float32, accept=FLOATS, shared=True),
            TensorSpec("weight_scale", (n, 1), torch.float32, accept=FLOATS, output_dim=0),
            TensorSpec("weight_offset", (n, 1), torch.float32, accept=FLOATS, output_dim=0, required=False),
        ]

    def process(self, layer: torch.nn.Module, shape: LinearShape) -> None:
        p = shape.prefix
        require_int_range(param(layer, "weight").data, -8, 7, f"{p}.weight (int4 values)")
        require_positive(param(layer, "weight_scale").data, f"{p}.weight_scale")
        require_zero_if_loaded(layer, "weight_offset", loaded_names(layer), f"{p}.weight_offset")
        clip = float(param(layer, "clip_ratio").data.reshape(-1)[0])
        if not 0.0 < clip <= 1.0:
            raise QuantLoadError(f"{p}.clip_ratio must lie in (0, 1], got {clip}")
        self.clip_ratio = clip
        replace_param(layer, "weight", self._pack(param(layer, "weight").data.to(torch.int32)))  # [N, K/8] int32
        replace_param(layer, "left_trans", param(layer, "left_trans").data.t().contiguous())  # the kernel's p1
        replace_param(layer, "weight_scale", param(layer, "weight_scale").data.reshape(-1).float())
        for name in ("weight_offset", "clip_ratio"):
            drop_param(layer, name)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2, lead = flat2d(x)
        t = x2.shape[0]
        q, s = self._kq(
            x2.reshape(t, self.l, self.r),
            param(layer, "left_trans").to(x.dtype),
            param(layer, "right_trans").to(x.dtype),
            self.clip_ratio,
        )
        out = self._qmm(
            q.reshape(t, -1), param(layer, "weight").t(), param(layer, "weight_scale"), s.reshape(-1), None, x.dtype
        )
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.reshape(*lead, out.shape[-1])
