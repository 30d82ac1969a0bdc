# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Unit tests of the torchair converter reader (npu_testkit.torchair_converters), on hand-written modules and on
torch_npu 2.8.0's wheel."""

from __future__ import annotations

import textwrap

from npu_testkit.torchair_converters import (
    IMPLEMENTED,
    NOT_IMPLEMENTED,
    PARTIAL,
    converter_table,
    missing_converters,
    parse_converters,
)


def test_the_three_kinds_of_converter_are_told_apart() -> None:
    source = textwrap.dedent(
        '''
        @register_fx_node_ge_converter(torch.ops.npu.npu_a.default)
        def conv_a(x: Tensor, meta_outputs: TensorSpec = None):
            """NB: npu_a(Tensor x) -> Tensor"""
            return ge.A(x)

        @register_fx_node_ge_converter(torch.ops.aten.b.Tensor)
        def conv_b(x: Tensor, meta_outputs: TensorSpec = None):
            """NB: aten::b.Tensor(Tensor x) -> Tensor"""
            raise NotImplementedError("torch.ops.aten.b.Tensor ge_converter is not implemented!")

        @register_fx_node_ge_converter(torch.ops.npu.npu_c.default)
        def conv_c(x: Tensor, mode: str = "x", meta_outputs: TensorSpec = None):
            if mode != "x":
                raise NotImplementedError("only mode x")
            return ge.C(x)

        @declare_supported([])
        def not_a_converter(x):
            raise NotImplementedError

        def conv_d(x: Tensor, meta_outputs: TensorSpec = None):
            return ge.D(x)

        d_reg = register_fx_node_ge_converter(torch.ops.npu.npu_d.default)(conv_d)
        d_list_reg = register_fx_node_ge_converter(torch.ops.npu.npu_d.List)(conv_d)
        '''
    )
    assert parse_converters(source) == {
        "npu.npu_a.default": IMPLEMENTED,
        "aten.b.Tensor": NOT_IMPLEMENTED,
        "npu.npu_c.default": PARTIAL,
        "npu.npu_d.default": IMPLEMENTED,  # registered by a call, not a decorator
        "npu.npu_d.List": IMPLEMENTED,
    }


def test_the_wheel_has_converters_for_the_gqa_decode_graph_and_none_for_the_unpermute() -> None:
    # docs/torchair.md's claims about torch_npu 2.8.0's torchair, read again from the wheel.
    table = converter_table()
    for op in (
        "npu.npu_fused_infer_attention_score.default",
        "npu.npu_scatter_nd_update.default",
        "npu.npu_rms_norm.default",
        "npu.npu_add_rms_norm.default",
        "npu.npu_swiglu.default",
        # the MoE decode graph (npu-ops) and the dense quant schemes' forward (npu-quant)
        "npu.npu_moe_gating_top_k_softmax.default",
        "npu.npu_moe_gating_top_k.default",
        "npu.npu_moe_init_routing_v2.default",
        "npu.npu_grouped_matmul.default",
        "npu.npu_grouped_matmul.List",
        "npu.npu_moe_finalize_routing.default",
        "aten.scatter.src",
        "npu.npu_quantize.default",
        "npu.npu_dynamic_quant.default",
        "npu.npu_quant_matmul.default",
        "npu.npu_weight_quant_batchmatmul.default",
        "npu.npu_kronecker_quant.default",
    ):
        assert table[op] == IMPLEMENTED, op
    # why the graph paths avoid these: index assignment and repeat_interleave have refusing converters
    for op in ("aten.index_put.default", "aten.repeat_interleave.self_int", "aten.repeat_interleave.Tensor"):
        assert table[op] == NOT_IMPLEMENTED, op
    assert table["npu.npu_rotary_mul.default"] == PARTIAL  # refuses some rotary modes only
    assert missing_converters(["npu.npu_moe_token_unpermute.default", "aten._local_scalar_dense.default"]) == [
        "aten._local_scalar_dense.default: its GE converter raises NotImplementedError",
        "npu.npu_moe_token_unpermute.default: no GE converter in torch_npu's torchair",
    ]
