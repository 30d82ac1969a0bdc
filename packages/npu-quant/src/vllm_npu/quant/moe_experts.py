# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Quantized expert MLPs for npu-ops' MoE forward, and the grouped-matmul kernels they run (each torch_npu call
beside its reference twin).

Each class is an :data:`vllm_npu.ops.moe.ExpertsFn` ``(rows [N, H] sorted by expert, group_counts [E_local])
-> [N, H]`` over the weights that :mod:`vllm_npu.quant.moe_method` processed at load. Maths for the rows routed to
expert e:

- W8A8_DYNAMIC (``dq`` = per-token dynamic int8 quant)::

    xq, s  = dq(x);   h = (xq @ W13[e]ᵀ) * s13[e] * s           (int8 grouped matmul, per-token dequant)
    hq, s' = dq(silu(h_gate) * h_up);   y = (hq @ W2[e]ᵀ) * s2[e] * s'

- W4A8_DYNAMIC: int8 rows x int4 weights as vllm-ascend runs them on hardware, in :mod:`vllm_npu.quant.moe_w4a8`;
- static W8A8: per-row (the row's expert's) static int8 input quant, int8 grouped matmul with int32 quant bias and
  per-channel dequant scale (see :class:`vllm_npu.quant.moe_method.AscendW8A8FusedMoEMethod`).

All of it can be traced into a compiled decode graph (the torchair mode): the experts read nothing on the host, the
NPU twins call ops with GE converters, and each grouped-matmul reference twin (a loop over the experts that reads the
counts) runs inside a registered op (``torch.ops.vllm_npu.quant_grouped_matmul_int8``, and ``_a8w4`` for W4A8), one
opaque node as the NPU kernel is. The grouped matmuls accept more rows than the counts cover (the expert-parallel
graph path hands every row over): rows past the counts are zeros in the twins, undefined on the NPU, and dropped by
the combine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from vllm_npu.interface import Kernel, KernelContractError, opaque_reference_op

from . import kernels
from .params import param

# --------------------------------------------------------------------------------------------------------------
# the row groups of the grouped-matmul reference twins


def _group_rows(counts: torch.Tensor, num_rows: int, num_groups: int) -> list[tuple[int, slice]]:
    """``(group, rows)`` for every non-empty group of ``num_rows`` rows sorted by group, ``counts [G]`` rows each
    (rows past their sum belong to no group); ``ValueError`` unless there are ``num_groups`` counts summing to at
    most ``num_rows``. Reads the counts on the host: called only inside the registered reference ops."""
    sizes = counts.tolist()
    if len(sizes) != num_groups or sum(sizes) > num_rows:
        raise ValueError(f"grouped matmul: counts {sizes} do not fit {num_rows} rows / {num_groups} groups")
    bounds, start = [], 0
    for g, n in enumerate(sizes):
        if n:
            bounds.append((g, slice(start, start + n)))
        start += n
    return bounds


# --------------------------------------------------------------------------------------------------------------
# int8 grouped matmul with per-channel weight scales and per-token activation scales


# output dtype -> the scale dtype npu_grouped_matmul's per-token int8 mode pairs with it
_PER_TOKEN_SCALE_DTYPE = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}


def _grouped_qmm_npu(
    xq: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    pertoken: torch.Tensor,
    counts: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    # The documented per-token pairs (torch_npu 2.8.0 docs, npu_grouped_matmul data-type table with a tensor
    # group_list): bfloat16 output takes a bfloat16 scale, float16 output a float32 scale; nothing else.
    paired = _PER_TOKEN_SCALE_DTYPE.get(out_dtype)
    if paired is None or scale.dtype != paired:
        raise KernelContractError(
            f"npu_grouped_matmul (per-token int8) takes a {paired} scale for {out_dtype} output, got {scale.dtype}"
            if paired is not None
            else f"npu_grouped_matmul (per-token int8) has no {out_dtype} output; serve W8A8_DYNAMIC MoE models with "
            "--dtype bfloat16 or float16"
        )
    import torch_npu

    return torch_npu.npu_grouped_matmul(
        [xq],
        [weight],
        scale=[scale],
        per_token_scale=[pertoken],
        group_list=counts.to(torch.int64),
        split_item=2,
        group_type=0,
        group_list_type=1,
        output_dtype=out_dtype,
    )[0]


def _grouped_int8_loop(
    xq: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    pertoken: torch.Tensor | None,
    bias: torch.Tensor | None,
    counts: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Both int8 modes: ``((xq_g @ W[g]) (+ bias[g])) * scale[g] (* pertoken_g)``, rows past the counts zeros."""
    out = torch.zeros(xq.shape[0], weight.shape[-1], dtype=out_dtype, device=xq.device)
    for g, rows in _group_rows(counts, xq.shape[0], weight.shape[0]):
        acc = xq[rows].to(torch.float64) @ weight[g].to(torch.float64)  # exact for int8
        if bias is not None:
            acc = acc + bias[g].to(torch.float64)
        y = acc.to(torch.float32) * scale[g].to(torch.float32)
        out[rows] = (y if pertoken is None else y * pertoken[rows].unsqueeze(-1)).to(out_dtype)
    return out


_GROUPED_INT8_OP = opaque_reference_op(
    "quant_grouped_matmul_int8",
    _grouped_int8_loop,
    lambda xq, weight, scale, pertoken, bias, counts, out_dtype: xq.new_empty(
        xq.shape[0], weight.shape[-1], dtype=out_dtype
    ),
)


def _grouped_qmm_ref(
    xq: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    pertoken: torch.Tensor,
    counts: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """xq int8 ``[N, K]`` (rows sorted by group), weight int8 ``[G, K, M]``, scale ``[G, M]`` (float32, or bfloat16 for
    bfloat16 output: the NPU twin's pairing), pertoken float32 ``[N]``, counts int64 ``[G]`` (sum <= N) -> ``[N, M]``:
    ``(xq_g @ W[g]) * scale[g] * pertoken_g`` (rows past the counts: zeros). Runs as the registered op
    ``torch.ops.vllm_npu.quant_grouped_matmul_int8``."""
    return cast(torch.Tensor, _GROUPED_INT8_OP(xq, weight, scale, pertoken, None, counts, out_dtype))


grouped_quant_matmul = Kernel("npu_grouped_matmul[int8,per-token]", npu=_grouped_qmm_npu, reference=_grouped_qmm_ref)


class W8A8DynamicExperts:
    """The :data:`vllm_npu.ops.moe.ExpertsFn` over processed weights (w13 [E, H, 2I], w2 [E, I, H])."""

    def __init__(self, layer: torch.nn.Module, activation: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.layer = layer
        self.activation = activation
        self._dq = kernels.dynamic_quant.select()
        self._gqmm = grouped_quant_matmul.select()
        # The scales paired with the layer's activation dtype, converted now and held as parameters of the layer
        # (``<name>_paired``, [E, N]): a compiled graph reads them as the module's static tensors, not as inputs of a
        # dynamic shape; and vLLM's dynamic EPLB, which moves every parameter of the layer expert by expert
        # (``FusedMoE.get_expert_weights``), moves them with their expert. A buffer or a cache would stay with its
        # slot while the expert moves: the slot's new expert would be scaled by the old one's scales.
        act = getattr(getattr(layer, "moe_config", None), "in_dtype", None)
        self._paired: dict[str, str] = {}
        for name in ("w13_weight_scale", "w2_weight_scale"):
            scale = param(layer, name)
            paired = _PER_TOKEN_SCALE_DTYPE.get(act) if isinstance(act, torch.dtype) else None
            if paired is not None and scale.dtype != paired:
                copy = torch.nn.Parameter(scale.detach().to(paired).contiguous(), requires_grad=False)
                layer.register_parameter(f"{name}_paired", copy)
                self._paired[name] = f"{name}_paired"

    def _scale(self, name: str, out_dtype: torch.dtype) -> torch.Tensor:
        """The float32 load-time scale in the dtype the kernel pairs with ``out_dtype`` (bfloat16 for bfloat16
        output, as vllm-ascend v0.11.0's ``w1_scale.to(w2_scale.dtype)``): the layer's ``_paired`` parameter for its
        activation dtype; for another dtype converted per call (never cached: a cache would not move with EPLB)."""
        scale = param(self.layer, name)
        paired = _PER_TOKEN_SCALE_DTYPE.get(out_dtype, scale.dtype)
        if paired == scale.dtype:
            return scale
        if name in self._paired:
            converted = param(self.layer, self._paired[name])
            if converted.dtype == paired:
                return converted
        return scale.to(paired)

    def __call__(self, rows: torch.Tensor, group_counts: torch.Tensor) -> torch.Tensor:
        xq, s = self._dq(rows)
        return self.run_int8(xq, s, group_counts, rows.dtype)

    def run_int8(
        self, xq: torch.Tensor, scales: torch.Tensor, group_counts: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """The same MLP over rows already quantised per token (xq int8 [N, H], scales float32 [N]): what MC2's
        dynamic-quant dispatch delivers (npu-ops' ``QuantizedRowsExperts``), so the rows travel as int8."""
        layer, dt = self.layer, out_dtype
        h = self._gqmm(xq, param(layer, "w13_weight"), self._scale("w13_weight_scale", dt), scales, group_counts, dt)
        hq, s2 = self._dq(self.activation(h))
        return self._gqmm(hq, param(layer, "w2_weight"), self._scale("w2_weight_scale", dt), s2, group_counts, dt)


# --------------------------------------------------------------------------------------------------------------
# static W8A8 experts: per-row (per-expert) static activation quant + int8 grouped matmul with int32 bias


def _quantize_rows_npu(x: torch.Tensor, inv_scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    import torch_npu

    # axis=-2: the scales run along the rows (one per row, i.e. the row's expert's input scale)
    return torch_npu.npu_quantize(x, inv_scale, offset, torch.qint8, -2, False)


def _quantize_rows_ref(x: torch.Tensor, inv_scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x ``[N, K]`` float, inv_scale / offset ``[N]`` in x's dtype -> int8 ``[N, K]``:
    ``clamp(round(x * inv_scale[n] + offset[n]), -128, 127)`` (round half to even, as the per-tensor twin)."""
    if inv_scale.shape != (x.shape[0],) or offset.shape != (x.shape[0],):
        raise ValueError(
            f"npu_quantize(axis=-2): scales {tuple(inv_scale.shape)} / offsets {tuple(offset.shape)} "
            f"must be [{x.shape[0]}] for x {tuple(x.shape)}"
        )
    y = x.to(torch.float32) * inv_scale.to(torch.float32).unsqueeze(-1) + offset.to(torch.float32).unsqueeze(-1)
    return torch.clamp(torch.round(y), -128, 127).to(torch.int8)


quantize_rows = Kernel("npu_quantize[per-row,multiply]", npu=_quantize_rows_npu, reference=_quantize_rows_ref)


def _grouped_static_npu(
    xq: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    counts: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_grouped_matmul(
        [xq],
        [weight],
        bias=[bias],
        scale=[scale],
        group_list=counts.to(torch.int64),
        split_item=2,
        group_type=0,
        group_list_type=1,
        output_dtype=out_dtype,
    )[0]


def _grouped_static_ref(
    xq: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    counts: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The documented per-channel int8 mode: xq int8 ``[N, K]`` (rows sorted by group), weight int8 ``[G, K, M]``,
    bias int32 ``[G, M]``, scale ``[G, M]`` (float32 or bfloat16), counts ``[G]`` (sum <= N) -> ``[N, M]``:
    ``(xq_g @ W[g] + bias[g]) * scale[g]`` (rows past the counts: zeros). Runs as the registered op
    ``torch.ops.vllm_npu.quant_grouped_matmul_int8``."""
    return cast(torch.Tensor, _GROUPED_INT8_OP(xq, weight, scale, None, bias, counts, out_dtype))


grouped_static_matmul = Kernel(
    "npu_grouped_matmul[int8,per-channel,int32 bias]", npu=_grouped_static_npu, reference=_grouped_static_ref
)


class W8A8StaticExperts:
    """Static W8A8 experts over processed weights: w13 [E, H, 2I] / w2 [E, I, H] int8, ``*_deq_scale [E, N]``
    float32, ``*_quant_bias [E, N]`` int32, ``*_input_inv_scale`` / ``*_input_offset`` ``[E]`` float32."""

    def __init__(self, layer: torch.nn.Module, activation: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.layer = layer
        self.activation = activation
        self._q = quantize_rows.select()
        self._gmm = grouped_static_matmul.select()

    def _stage(self, x: torch.Tensor, w: str, experts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        # one scale per row: the row's expert's input scale, gathered by the row's expert
        inv = getattr(layer, f"{w}_input_inv_scale")[experts].to(x.dtype)
        off = getattr(layer, f"{w}_input_offset")[experts].to(x.dtype)
        xq = self._q(x, inv, off)
        # the documented pairing: bfloat16 output takes a bfloat16 scale, float16 (and the reference) float32
        scale = getattr(layer, f"{w}_deq_scale")
        scale = scale.to(torch.bfloat16) if x.dtype == torch.bfloat16 else scale
        return self._gmm(xq, getattr(layer, f"{w}_weight"), scale, getattr(layer, f"{w}_quant_bias"), counts, x.dtype)

    def __call__(self, rows: torch.Tensor, group_counts: torch.Tensor) -> torch.Tensor:
        counts = group_counts.to(torch.int64)
        experts = row_experts(counts, rows.shape[0])
        return self._stage(self.activation(self._stage(rows, "w13", experts, counts)), "w2", experts, counts)


def row_experts(counts: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The expert of each of ``num_rows`` rows sorted by expert, ``counts [E]`` rows each: int64 ``[num_rows]``.

    The number of counts' prefix sums at or below the row's index (``searchsorted(cumsum, row, right=True)``), on
    the device, without a host read: ``aten.cumsum`` and ``aten.searchsorted.Tensor`` have GE converters,
    ``repeat_interleave`` has a refusing one. Rows past the counts' sum (the expert-parallel graph path's undefined
    rows) get the last expert: their values are dropped by the combine.
    """
    ends = torch.cumsum(counts, 0)
    rows = torch.arange(num_rows, device=counts.device, dtype=ends.dtype)
    return torch.searchsorted(ends, rows, right=True).clamp(max=counts.shape[0] - 1)
