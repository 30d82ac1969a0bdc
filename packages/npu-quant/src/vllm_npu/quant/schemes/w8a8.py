# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""W8A8 (static): int8 weights, per-tensor static int8 activations with a zero point, int32 quant bias.

Maths (msModelSlim export; ``s_x``/``o_x`` = input_scale/input_offset, ``s_w[n]`` = weight scale)::

    x_q   = clamp(round(x / s_x + o_x), -128, 127)
    y[n]  = (sum_k x_q[k] W_q[n, k] + quant_bias[n]) * deq_scale[n]
    deq_scale[n]  = s_x * s_w[n]
    quant_bias[n] = round(bias[n] / deq_scale[n]) - o_x * sum_k W_q[n, k]

so the layer's float ``bias`` is already inside ``quant_bias`` and is not added again (as in vllm-ascend). For
row-parallel layers only TP rank 0 adds ``quant_bias`` (the partial sums are all-reduced).
``deq_scale`` is float32 for bf16/fp32 models; fp16 checkpoints store it as int64 (``npu_trans_quant_param`` form),
which is decoded at load and re-packed for the NPU kernel.

On an Ascend 310P the weight keeps its ``[N, K]`` layout, cast to FRACTAL_NZ at load, and ``npu_quant_matmul`` takes
its transposed view (vllm-ascend v0.11.0 ``quantization/w8a8.py:48`` ``transpose_weight = not is_310p()``,
``:132-140`` the transposed call, ``:168-170`` the NZ cast of int8 weights under its default ``VLLM_ASCEND_ENABLE_NZ``).
"""

from __future__ import annotations

import torch
from vllm_npu.interface import is_310p

from .. import kernels
from ..kernels import decode_scale
from ..params import FLOATS, TensorSpec, drop_param, loaded_names, param, replace_param
from .base import LinearScheme, LinearShape, flat2d, require_int_range, require_positive


class W8A8Scheme(LinearScheme):
    name = "W8A8"

    def __init__(self) -> None:
        self._quantize = kernels.quantize_per_tensor.select()
        self._qmm = kernels.quant_matmul.select()
        self._trans = kernels.trans_quant_param.select()
        self._chip_310p = is_310p()  # [N, K] weights in NZ, the matmul takes their transpose (module docstring)
        self._to_nz = kernels.weight_to_nz.select()

    def specs(self, shape: LinearShape) -> list[TensorSpec]:
        n, k, dt = shape.n, shape.k, shape.params_dtype
        return [
            TensorSpec("weight", (n, k), torch.int8, output_dim=0, input_dim=1),
            TensorSpec("input_scale", (1,), torch.float32, accept=FLOATS, shared=True),
            TensorSpec("input_offset", (1,), torch.float32, accept=(torch.int8, *FLOATS), shared=True, integral=True),
            TensorSpec("quant_bias", (n,), torch.int32, output_dim=0),
            TensorSpec(
                "deq_scale", (n,), torch.float32, accept=(*FLOATS, torch.int64), output_dim=0, convert=decode_scale
            ),
            TensorSpec("weight_scale", (n, 1), dt, accept=FLOATS, output_dim=0, required=False),
            TensorSpec("weight_offset", (n, 1), dt, accept=FLOATS, output_dim=0, required=False),
        ]

    def process(self, layer: torch.nn.Module, shape: LinearShape) -> None:
        p = shape.prefix
        require_positive(param(layer, "input_scale").data, f"{p}.input_scale")
        require_int_range(param(layer, "input_offset").data, -128, 127, f"{p}.input_offset")
        require_positive(param(layer, "deq_scale").data, f"{p}.deq_scale")
        k = param(layer, "weight").shape[1]
        dt = shape.params_dtype
        # npu_quantize runs in multiply mode with per-channel vectors: 1/s_x and o_x repeated over K.
        replace_param(
            layer, "aclnn_input_scale_reciprocal", (1.0 / param(layer, "input_scale").data.float()).repeat(k).to(dt)
        )
        replace_param(layer, "aclnn_input_offset", param(layer, "input_offset").data.float().repeat(k).to(dt))
        weight = param(layer, "weight").data
        # [K, N] for npu_quant_matmul; on a 310P [N, K] in NZ, transposed at each call
        replace_param(layer, "weight", self._to_nz(weight) if self._chip_310p else weight.t().contiguous())
        deq = param(layer, "deq_scale").data.float()
        # fp16 output takes the int64 (FP19) scale form; bf16/fp32 outputs take float32 directly.
        replace_param(layer, "deq_scale", self._trans(deq) if dt == torch.float16 else deq)
        for name in ("weight_scale", "weight_offset"):
            if name not in loaded_names(layer):
                drop_param(layer, name)
        self._params_dtype = dt
        self._rank_adds_bias = not (shape.row_parallel and getattr(layer, "tp_rank", 0) > 0)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2, lead = flat2d(x)
        out_dtype = self._params_dtype if x.dtype == torch.int8 else x.dtype
        xq = (
            x2
            if x2.dtype == torch.int8
            else self._quantize(x2, param(layer, "aclnn_input_scale_reciprocal"), param(layer, "aclnn_input_offset"))
        )
        qbias = param(layer, "quant_bias") if self._rank_adds_bias else None
        weight = param(layer, "weight")
        w = weight.transpose(1, 0) if self._chip_310p else weight
        out = self._qmm(xq, w, param(layer, "deq_scale"), None, qbias, out_dtype)
        return out.reshape(*lead, out.shape[-1])
