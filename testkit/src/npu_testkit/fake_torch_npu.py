# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A stand-in ``torch_npu`` for graph tests: the ops of the MoE and quant decode graphs as opaque custom ops.

Each op is a ``torch.ops.npu.<name>`` custom op (the namespace and name of the real one, so a lowered graph's node
names are those of torch_npu 2.8.0's GE converter table, :mod:`npu_testkit.torchair_converters`) with the documented
arguments it is called with, registered once per process (every graph test module shares them: a second
registration of one name would fail). The bodies compute the documented semantics: the MoE routing ops in plain
torch, the quant ops through npu-quant's reference twins (which ``packages/npu-quant/tests/test_schemes.py`` checks
against float maths); rows the docs leave undefined are NaN. :func:`fake_torch_npu` is the module the NPU twins
import (install it as ``sys.modules["torch_npu"]``, with :func:`~npu_testkit.torchair_converters.fresh_dynamo_imports`
around compiles).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from npu_testkit import npu_binding_rules as rules

NAN = float("nan")
_NS = "npu::"


def _past_counts_undefined(out: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    out[int(group_list.sum()) :] = NAN  # the docs define the rows the counts cover only
    return out


@functools.cache
def _register_moe_ops() -> None:
    @torch.library.custom_op(_NS + "npu_moe_gating_top_k_softmax", mutates_args=())
    def gating(
        x: torch.Tensor, finished: torch.Tensor | None, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert finished is None
        y, idx = torch.softmax(x, -1).topk(k, -1)
        rows = torch.arange(x.shape[0]).unsqueeze(1) + x.shape[0] * torch.arange(k)
        return y, idx.int(), rows.int()

    @gating.register_fake
    def _(x, finished, k):
        return (
            x.new_empty(x.shape[0], k),
            x.new_empty(x.shape[0], k, dtype=torch.int32),
            x.new_empty(x.shape[0], k, dtype=torch.int32),
        )

    @torch.library.custom_op(_NS + "npu_moe_init_routing_v2", mutates_args=())
    def init_routing(
        x: torch.Tensor,
        expert_idx: torch.Tensor,
        active_num: int,
        expert_num: int,
        expert_tokens_num_type: int,
        expert_tokens_num_flag: bool,
        quant_mode: int,
        active_expert_range: list[int],
        row_idx_type: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        t, k = expert_idx.shape
        assert expert_idx.dtype == torch.int32 and active_num == t * k and expert_tokens_num_type == 1
        assert expert_tokens_num_flag and quant_mode == -1 and row_idx_type == 0
        lo, hi = active_expert_range
        slots = sorted((e, f) for f, e in enumerate(expert_idx.reshape(-1).tolist()) if lo <= e < hi)
        out = torch.full((t * k, x.shape[1]), NAN, dtype=x.dtype)  # undefined past the in-range rows
        row_idx = torch.full((t * k,), -1, dtype=torch.int32)
        for i, (_, f) in enumerate(slots):
            out[i], row_idx[i] = x[f // k], f
        counts = torch.tensor([sum(1 for e, _ in slots if e == j) for j in range(lo, hi)], dtype=torch.int64)
        return out, row_idx, counts, torch.zeros(t * k)

    @init_routing.register_fake
    def _(x, expert_idx, active_num, expert_num, tnt, flag, qm, active_expert_range, rit):
        n = expert_idx.numel()
        lo, hi = active_expert_range
        return (
            x.new_empty(n, x.shape[1]),
            x.new_empty(n, dtype=torch.int32),
            x.new_empty(hi - lo, dtype=torch.int64),
            x.new_empty(n, dtype=torch.float32),
        )

    @torch.library.custom_op(
        _NS + "npu_grouped_matmul",
        mutates_args=(),
        # the documented schema's optional tensor lists, which custom_op cannot infer from annotations
        schema="(Tensor[] x, Tensor[] weight, Tensor[]? bias, Tensor[]? scale, Tensor[]? antiquant_scale, "
        "Tensor[]? per_token_scale, Tensor group_list, int split_item, int group_type, int group_list_type, "
        "ScalarType? output_dtype) -> Tensor[]",
    )
    def grouped_matmul(
        x: list[torch.Tensor],
        weight: list[torch.Tensor],
        bias: list[torch.Tensor] | None,
        scale: list[torch.Tensor] | None,
        antiquant_scale: list[torch.Tensor] | None,
        per_token_scale: list[torch.Tensor] | None,
        group_list: torch.Tensor,
        split_item: int,
        group_type: int,
        group_list_type: int,
        output_dtype: torch.dtype | None,
    ) -> list[torch.Tensor]:
        assert len(x) == len(weight) == 1 and split_item == 2 and group_type == 0 and group_list_type == 1
        (xx,), (w,) = x, weight
        assert group_list.dtype == torch.int64 and int(group_list.sum()) <= xx.shape[0]
        return [_grouped_matmul_modes(xx, w, bias, scale, antiquant_scale, per_token_scale, group_list, output_dtype)]

    @grouped_matmul.register_fake
    def _(x, weight, bias, scale, aq, pts, gl, si, gt, glt, output_dtype):
        w = weight[0]
        width = w.shape[-1] * (8 if w.dtype == torch.int32 else 1)
        return [x[0].new_empty(x[0].shape[0], width, dtype=output_dtype or x[0].dtype)]

    @torch.library.custom_op(_NS + "npu_swiglu", mutates_args=())
    def swiglu(x: torch.Tensor, dim: int) -> torch.Tensor:
        a, b = x.chunk(2, dim=dim)
        return a * torch.sigmoid(a) * b

    swiglu.register_fake(lambda x, dim: x.new_empty(*x.shape[:-1], x.shape[-1] // 2))

    @torch.library.custom_op(_NS + "npu_moe_finalize_routing", mutates_args=())
    def finalize(
        expanded_permuted_rows: torch.Tensor,
        scales: torch.Tensor,
        expanded_src_to_dst_row: torch.Tensor,
        drop_pad_mode: int,
    ) -> torch.Tensor:
        assert drop_pad_mode == 0 and expanded_src_to_dst_row.dtype == torch.int32
        assert scales.dtype == expanded_permuted_rows.dtype
        num_rows, top_k = scales.shape
        out = torch.zeros(num_rows, expanded_permuted_rows.shape[1])
        for i in range(num_rows):  # the documented formula, one row and slot at a time
            for j in range(top_k):
                row = expanded_permuted_rows[int(expanded_src_to_dst_row[i + j * num_rows])]
                out[i] += scales[i, j].float() * row.float()
        return out.to(expanded_permuted_rows.dtype)

    finalize.register_fake(lambda rows, scales, idx, mode: rows.new_empty(scales.shape[0], rows.shape[1]))


def _grouped_matmul_modes(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: list[torch.Tensor] | None,
    scale: list[torch.Tensor] | None,
    antiquant_scale: list[torch.Tensor] | None,
    per_token_scale: list[torch.Tensor] | None,
    group_list: torch.Tensor,
    output_dtype: torch.dtype | None,
) -> torch.Tensor:
    """The documented modes of ``npu_grouped_matmul`` with one x, one 3-D weight and counts (rows past: NaN)."""
    from vllm_npu.quant import moe_experts as qe
    from vllm_npu.quant import moe_w4a8

    if x.dtype == torch.int8 and w.dtype == torch.int32:  # int8 x int4 (A8W4): int64 scale, float32 bias, per token
        assert scale is not None and bias is not None and per_token_scale is not None and antiquant_scale is None
        rules.grouped_matmul_a8w4(w, scale[0], bias[0], per_token_scale[0], output_dtype)
        out = moe_w4a8._grouped_a8w4_loop(x, w, scale[0], bias[0], per_token_scale[0], group_list, output_dtype)
    elif x.dtype == torch.int8:  # int8 x int8, dequantized per channel (+ int32 bias) or per channel and token
        assert scale is not None and output_dtype is not None and antiquant_scale is None
        rules.grouped_matmul_quant_dtypes(
            scale[0], None if per_token_scale is None else per_token_scale[0], output_dtype, bias and bias[0]
        )
        pertoken = None if per_token_scale is None else per_token_scale[0]
        assert (pertoken is None) != (bias is None)  # our two int8 modes
        out = qe._grouped_int8_loop(x, w, scale[0], pertoken, bias and bias[0], group_list, output_dtype)
    else:  # float
        assert bias is None and scale is None and antiquant_scale is None and per_token_scale is None
        out, start = torch.empty(x.shape[0], w.shape[-1], dtype=x.dtype), 0
        for g, n in enumerate(group_list.tolist()):
            out[start : start + n] = x[start : start + n] @ w[g]
            start += n
    return _past_counts_undefined(out, group_list)


@functools.cache
def _register_quant_ops() -> None:
    from vllm_npu.quant import kernels as K
    from vllm_npu.quant import moe_experts as qe

    @torch.library.custom_op(_NS + "npu_quantize", mutates_args=())
    def quantize(
        x: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, dtype: torch.dtype, axis: int, div_mode: bool
    ) -> torch.Tensor:
        assert dtype == torch.qint8 and axis in (-1, -2) and not div_mode  # multiply mode
        # axis -1: one scale per channel of the last dim; -2: one per row (the converter's declared AscendQuantV2 case)
        return (K._quantize_ref if axis == -1 else qe._quantize_rows_ref)(x, scales, zero_points)

    quantize.register_fake(lambda x, s, z, dtype, axis, div: torch.empty_like(x, dtype=torch.int8))

    @torch.library.custom_op(_NS + "npu_dynamic_quant", mutates_args=())
    def dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return K._dynamic_quant_ref(x)

    dynamic_quant.register_fake(
        lambda x: (torch.empty_like(x, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32))
    )

    @torch.library.custom_op(_NS + "npu_quant_matmul", mutates_args=())
    def quant_matmul(
        x1: torch.Tensor,
        x2: torch.Tensor,
        scale: torch.Tensor,
        pertoken_scale: torch.Tensor | None,
        bias: torch.Tensor | None,
        output_dtype: torch.dtype,
    ) -> torch.Tensor:
        return K._quant_matmul_ref(x1, x2, scale, pertoken_scale, bias, output_dtype)

    @quant_matmul.register_fake
    def _(x1, x2, scale, pertoken_scale, bias, output_dtype):
        return x1.new_empty(x1.shape[0], x2.shape[-1], dtype=output_dtype)  # x2 [K, N] int8 or [K/8, N] int32

    @torch.library.custom_op(_NS + "npu_weight_quant_batchmatmul", mutates_args=())
    def weight_quant_bmm(
        x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor, antiquant_group_size: int
    ) -> torch.Tensor:
        return K._weight_quant_bmm_ref(x, weight, antiquant_scale, antiquant_group_size)

    weight_quant_bmm.register_fake(lambda x, w, s, g: x.new_empty(x.shape[0], w.shape[-1] * 8))

    @torch.library.custom_op(_NS + "npu_kronecker_quant", mutates_args=())
    def kronecker_quant(
        x: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor, clip_ratio: float, dst_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert dst_dtype == torch.int32  # the converter takes int32 only
        return K._kronecker_quant_ref(x, p1, p2, clip_ratio)

    kronecker_quant.register_fake(
        lambda x, p1, p2, c, d: (
            x.new_empty(*x.shape[:-1], x.shape[-1] // 8, dtype=torch.int32),
            x.new_empty(x.shape[0], dtype=torch.float32),
        )
    )


def _moe_functions(ops: Any) -> list[Any]:
    def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
        return ops.npu_moe_gating_top_k_softmax(x, finished, k)

    def npu_moe_init_routing_v2(
        x,
        expert_idx,
        *,
        scale=None,
        offset=None,
        active_num=-1,
        expert_capacity=-1,
        expert_num=-1,
        drop_pad_mode=0,
        expert_tokens_num_type=0,
        expert_tokens_num_flag=False,
        quant_mode=0,
        active_expert_range=(),
        row_idx_type=0,
    ):
        assert scale is None and offset is None and drop_pad_mode == 0
        return ops.npu_moe_init_routing_v2(
            x,
            expert_idx,
            active_num,
            expert_num,
            expert_tokens_num_type,
            expert_tokens_num_flag,
            quant_mode,
            list(active_expert_range),
            row_idx_type,
        )

    def npu_grouped_matmul(
        x,
        weight,
        *,
        bias=None,
        scale=None,
        antiquant_scale=None,
        per_token_scale=None,
        group_list=None,
        split_item=0,
        group_type=None,
        group_list_type=0,
        output_dtype=None,
        **kw,
    ):
        assert not any(v is not None for v in kw.values()), kw
        return ops.npu_grouped_matmul(
            x,
            weight,
            bias,
            scale,
            antiquant_scale,
            per_token_scale,
            group_list,
            split_item,
            group_type,
            group_list_type,
            output_dtype,
        )

    def npu_swiglu(x, dim=-1):
        return ops.npu_swiglu(x, dim)

    def npu_moe_finalize_routing(
        expanded_permuted_rows,
        skip1,
        skip2,
        bias,
        scales,
        expanded_src_to_dst_row,
        export_for_source_row,
        drop_pad_mode=0,
    ):
        assert skip1 is None and skip2 is None and bias is None
        return ops.npu_moe_finalize_routing(expanded_permuted_rows, scales, expanded_src_to_dst_row, drop_pad_mode)

    def npu_moe_token_unpermute(
        permuted_tokens,
        sorted_indices,
        probs=None,
        padded_mode=False,
        restore_shape=None,
    ):
        # the eager bf16 combine (not an op of the graph: the tests check the graph holds the finalize instead)
        from vllm_npu.ops.moe import routing as rt

        assert permuted_tokens.dtype == probs.dtype == torch.bfloat16 and sorted_indices.dtype == torch.int64
        return rt.unpermute_reference(permuted_tokens, sorted_indices, probs)

    return [
        npu_moe_gating_top_k_softmax,
        npu_moe_init_routing_v2,
        npu_grouped_matmul,
        npu_swiglu,
        npu_moe_finalize_routing,
        npu_moe_token_unpermute,
    ]


def _quant_functions(ops: Any) -> list[Any]:
    def npu_quantize(x, scales, zero_points, dtype, axis=1, div_mode=True):
        return ops.npu_quantize(x, scales, zero_points, dtype, axis, div_mode)

    def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=torch.int8):
        assert smooth_scales is None and group_index is None and dst_type in (None, torch.int8)
        return ops.npu_dynamic_quant(x)

    def npu_quant_matmul(
        x1,
        x2,
        scale,
        *,
        offset=None,
        pertoken_scale=None,
        bias=None,
        output_dtype=None,
    ):
        assert offset is None
        return ops.npu_quant_matmul(x1, x2, scale, pertoken_scale, bias, output_dtype)

    def npu_weight_quant_batchmatmul(
        x,
        weight,
        antiquant_scale,
        antiquant_offset=None,
        quant_scale=None,
        quant_offset=None,
        bias=None,
        antiquant_group_size=0,
        inner_precise=0,
    ):
        assert antiquant_offset is None and quant_scale is None and quant_offset is None and bias is None
        return ops.npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_group_size)

    def npu_kronecker_quant(x, kronecker_p1, kronecker_p2, clip_ratio=1.0, dst_dtype=torch.int32):
        return ops.npu_kronecker_quant(x, kronecker_p1, kronecker_p2, clip_ratio, dst_dtype)

    return [npu_quantize, npu_dynamic_quant, npu_quant_matmul, npu_weight_quant_batchmatmul, npu_kronecker_quant]


@functools.cache
def fake_torch_npu(*, quant: bool = False, checked: bool = False) -> types.ModuleType:
    """A ``torch_npu`` module whose MoE functions (and with ``quant`` the quant ones, which need npu-quant) call the
    ops above with the documented arguments. ``checked``: each call behind the documented 2.8.0 signature check
    (for eager runs only: Dynamo cannot trace the check, which parses the wheel's docs)."""
    _register_moe_ops()
    functions = _moe_functions(torch.ops.npu)
    if quant:
        _register_quant_ops()
        functions += _quant_functions(torch.ops.npu)
    m = types.ModuleType("torch_npu")  # a module: Dynamo traces the twins' `import torch_npu`
    for fn in functions:
        setattr(m, fn.__name__, rules.documented(fn) if checked else fn)
    return m
