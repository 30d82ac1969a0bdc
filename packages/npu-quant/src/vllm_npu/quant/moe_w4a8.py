# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""W4A8_DYNAMIC experts the way vllm-ascend v0.11.0 runs them on hardware: int8 rows x int4 weights ("A8W4").

The call (``vllm_ascend/ops/moe/moe_mlp.py:138-187``, the torchair twin ``torchair/quantization/
torchair_w8a8_dynamic.py:156-197``)::

    xq, s  = npu_dynamic_quant(x)                                   # int8 [M, K], float32 [M]
    h      = npu_grouped_matmul([xq], [W13 int32 [E, K, 2I/8]], scale=[S13 int64 [E, K/g, 2I]],
                                bias=[B13 float32 [E, 2I]], per_token_scale=[s], split_item=2, group_type=0,
                                group_list_type=1, group_list=counts, output_dtype=bfloat16)
    hq, s' = npu_dynamic_quant(swiglu(h));   y = the same with W2 / S2 / B2

What the kernel computes (CANN's ``grouped_matmul_antiquant_a8w4_msd*``: the int8 rows are split into two int4
halves, ``hi = floor(x / 16)`` and ``lo = (x & 15) - 8``, so ``x = 16 hi + lo + 8``), per row ``m`` of expert ``e``
and output ``n``::

    y[m, n] = s[m] * ( sum_j S[e, j, n] * sum_{k in group j} (xq[m, k] - 8) * W4[e, k, n]  +  B[e, n] )

``S`` is the float32 value in the low 32 bits of the int64 scale. The scale bias ``B = 8 * sum_k W4[k, n] *
S[k // g, n]`` gives back the ``- 8`` exactly, so ``y = s * (xq @ W_deq)``. Version "0" checkpoints get ``B``
computed at load (``quantization/w4a8_dynamic.py:415-419``); version "1.0.0" ones carry it as ``scale_bias``
(``[E, 2I, 1]`` and ``[E, H, 16/tp]``: partial sums over 16 chunks of K, summed at load, ``:436-441``).

Load-time layout (:func:`process_a8w4_expert_weight`): ``W4`` packed 8 per int32 along N (value ``j`` in bits
``4j..4j+3``, what the 1.0.0 checkpoint's bytes are when viewed as int32, ``:448-453``), ``S = fp16(s1 * s2)`` as
float32 bits in int64 (``:420-434``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from vllm_npu.interface import Kernel, KernelContractError, opaque_reference_op

from . import kernels
from .moe_experts import _group_rows
from .params import param

#: the output dtypes of the A8W4 kernel (CANN builds it for bfloat16, which vllm-ascend v0.11.0 passes, and half)
A8W4_OUTPUT_DTYPES = (torch.bfloat16, torch.float16)
#: the activation offset the kernel's int4 split introduces (``lo = (x & 15) - 8``), given back by the scale bias
A8W4_OFFSET = 8


# --------------------------------------------------------------------------------------------------------------
# load-time processing (vllm-ascend v0.11.0 quantization/w4a8_dynamic.py:399-490)


def a8w4_scale(scale: torch.Tensor, scale_second: torch.Tensor) -> torch.Tensor:
    """``weight_scale [E, N, 1]`` x ``weight_scale_second [E, N, G]`` -> int64 ``[E, G, N]``: the product rounded
    to float16 (as vllm-ascend does), its float32 bits in the low 32 bits."""
    s = (scale.float() * scale_second.float()).transpose(1, 2).contiguous()  # [E, G, N]
    return kernels.encode_scale(s.to(torch.float16).to(torch.float32))


def a8w4_bias(w4: torch.Tensor, scale: torch.Tensor, scale_second: torch.Tensor) -> torch.Tensor:
    """The scale bias of a version "0" checkpoint: ``8 * sum_k W4[e, n, k] * s1[e, n] * s2[e, n, k // g]``,
    float32 ``[E, N]`` from int4 values ``w4 [E, N, K]`` (unrounded scales, as vllm-ascend)."""
    e, n, k = w4.shape
    groups = scale_second.shape[-1]
    per_group = w4.to(torch.float32).reshape(e, n, groups, k // groups).sum(-1)  # [E, N, G]
    return A8W4_OFFSET * (per_group * scale_second.float() * scale.float()).sum(-1)


def process_a8w4_expert_weight(
    w4: torch.Tensor, scale: torch.Tensor, scale_second: torch.Tensor, scale_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 values ``w4 [E, N, K]`` (int8), ``scale [E, N, 1]``, ``scale_second [E, N, K/g]``, the checkpoint's
    ``scale_bias [E, N, c]`` (version "1.0.0") or None (version "0") -> (weight int32 ``[E, K, N/8]``, scale int64
    ``[E, K/g, N]``, bias float32 ``[E, N]``)."""
    packed = kernels.pack_int4(w4.transpose(1, 2).contiguous())
    bias = a8w4_bias(w4, scale, scale_second) if scale_bias is None else scale_bias.float().sum(-1)
    return packed, a8w4_scale(scale, scale_second), bias.contiguous()


# --------------------------------------------------------------------------------------------------------------
# the grouped matmul


def _grouped_a8w4_npu(
    xq: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    pertoken: torch.Tensor,
    counts: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    if out_dtype not in A8W4_OUTPUT_DTYPES:
        raise KernelContractError(
            f"npu_grouped_matmul (int8 x int4) has no {out_dtype} output; serve W4A8_DYNAMIC MoE models with "
            "--dtype bfloat16 (what vllm-ascend v0.11.0 runs) or float16"
        )
    import torch_npu

    return torch_npu.npu_grouped_matmul(
        [xq],
        [weight],
        scale=[scale],
        bias=[bias],
        per_token_scale=[pertoken],
        group_list=counts.to(torch.int64),
        split_item=2,
        group_type=0,
        group_list_type=1,
        output_dtype=out_dtype,
    )[0]


def _grouped_a8w4_loop(
    xq: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    pertoken: torch.Tensor,
    counts: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The kernel's maths per expert (module docstring): exact int partial sums per K group (float64 holds them
    exactly), then float32 scaling, bias and per-token scale; rows past the counts zeros."""
    groups = scale.shape[1]
    out = torch.zeros(xq.shape[0], weight.shape[-1] * 8, dtype=out_dtype, device=xq.device)
    for g, rows in _group_rows(counts, xq.shape[0], weight.shape[0]):
        w = kernels.unpack_int4(weight[g]).to(torch.float64)  # [K, N]
        k, n = w.shape
        x = xq[rows].to(torch.float64) - A8W4_OFFSET  # [m, K]
        partial = torch.einsum("mgk,gkn->mgn", x.reshape(-1, groups, k // groups), w.reshape(groups, k // groups, n))
        acc = (partial.to(torch.float32) * kernels.decode_scale(scale[g]).unsqueeze(0)).sum(1)  # [m, N]
        acc = acc + bias[g].to(torch.float32)
        out[rows] = (acc * pertoken[rows].to(torch.float32).unsqueeze(-1)).to(out_dtype)
    return out


_GROUPED_A8W4_OP = opaque_reference_op(
    "quant_grouped_matmul_a8w4",
    _grouped_a8w4_loop,
    lambda xq, weight, scale, bias, pertoken, counts, out_dtype: xq.new_empty(
        xq.shape[0], weight.shape[-1] * 8, dtype=out_dtype
    ),
)


def _grouped_a8w4_ref(
    xq: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    pertoken: torch.Tensor,
    counts: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """xq int8 ``[M, K]`` (rows sorted by expert), weight int32 ``[E, K, N/8]`` (int4), scale int64 ``[E, K/g, N]``,
    bias float32 ``[E, N]``, pertoken float32 ``[M]``, counts ``[E]`` (sum <= M) -> ``[M, N]`` in ``out_dtype``:
    ``pertoken * (sum_j S[j] * ((xq - 8) @ W4)_j + bias)`` (module docstring; rows past the counts: zeros). Runs as
    the registered op ``torch.ops.vllm_npu.quant_grouped_matmul_a8w4``."""
    if scale.dtype != torch.int64 or bias.dtype != torch.float32 or weight.dtype != torch.int32:
        raise KernelContractError(
            f"npu_grouped_matmul (int8 x int4): weight int32 / scale int64 / bias float32, got {weight.dtype} / "
            f"{scale.dtype} / {bias.dtype}"
        )
    if weight.shape[1] % scale.shape[1]:
        raise KernelContractError(
            f"npu_grouped_matmul (int8 x int4): K={weight.shape[1]} not split in {scale.shape[1]}"
        )
    return cast(torch.Tensor, _GROUPED_A8W4_OP(xq, weight, scale, bias, pertoken, counts, out_dtype))


grouped_a8w4_matmul = Kernel(
    "npu_grouped_matmul[int8 x int4,per-group int64 scale,bias]", npu=_grouped_a8w4_npu, reference=_grouped_a8w4_ref
)


class W4A8DynamicExperts:
    """The :data:`vllm_npu.ops.moe.ExpertsFn` over processed weights: ``w13_weight [E, H, 2I/8]`` / ``w2_weight
    [E, I, H/8]`` int32, ``*_weight_scale [E, K/g, N]`` int64, ``*_scale_bias [E, N]`` float32."""

    def __init__(self, layer: torch.nn.Module, activation: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.layer = layer
        self.activation = activation
        self._dq = kernels.dynamic_quant.select()
        self._gmm = grouped_a8w4_matmul.select()

    def __call__(self, rows: torch.Tensor, group_counts: torch.Tensor) -> torch.Tensor:
        xq, s = self._dq(rows)
        return self.run_int8(xq, s, group_counts, rows.dtype)

    def _stage(self, w: str, xq: torch.Tensor, s: torch.Tensor, counts: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        layer = self.layer
        return self._gmm(
            xq,
            param(layer, f"{w}_weight"),
            param(layer, f"{w}_weight_scale"),
            param(layer, f"{w}_scale_bias"),
            s,
            counts,
            dt,
        )

    def run_int8(
        self, xq: torch.Tensor, scales: torch.Tensor, group_counts: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """The MLP over rows already quantised per token (xq int8 [N, H], scales float32 [N]): what MC2's
        dynamic-quant dispatch delivers (vllm-ascend v0.11.0 quantizes W4A8 rows in the dispatch as W8A8's)."""
        h = self._stage("w13", xq, scales, group_counts, out_dtype)
        hq, s2 = self._dq(self.activation(h))
        return self._stage("w2", hq, s2, group_counts, out_dtype)
