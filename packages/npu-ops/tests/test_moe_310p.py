# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""MoE on an Ascend 310P: the chip picks the torch gate, the torch token permutation (vllm-ascend v0.11.0's MoGE
dispatcher) and the torch combine, so the NPU path calls only ops torch_npu 2.8.0 documents for the 310P
(``npu_grouped_matmul`` in float16 with its 310P constraints, ``npu_swiglu``). Checked with a stand-in ``torch_npu``
that has only those two ops and enforces the documented 310P constraints; the twins are checked against it."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from vllm_npu.interface import ConfigError, reset_chip
from vllm_npu.ops.moe.experts import grouped_matmul_npu, grouped_matmul_reference
from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
from vllm_npu.ops.moe.gating import RoutingConfig, gate_path
from vllm_npu.ops.moe.layer import _check_310p_widths  # imports vLLM (and transformers) before torch_npu is stood in
from vllm_npu.ops.moe.routing import (
    INIT_ROUTING,
    INIT_ROUTING_310P,
    build_unpermute,
    combine_masked,
    init_routing_310p_npu,
    init_routing_kernel,
    init_routing_reference,
    unpermute_npu,
)

CALLS: list[str] = []


def _npu_grouped_matmul(x, weight, *, group_list, split_item, group_type, group_list_type, **kw):
    """``npu_grouped_matmul`` with the "Atlas 推理系列产品" constraints of ``_op_plugin_docs.py:4572-4576``."""
    CALLS.append("npu_grouped_matmul")
    (x,), (w,) = x, weight
    assert x.dtype == w.dtype == torch.float16, "310P: float16 only"
    assert (split_item, group_type) in ((2, 0), (3, 0)) and w.dim() == 3 and x.dim() == 2
    assert w.shape[-1] % 16 == 0, "310P: the output's n axis must be a multiple of 16"
    assert isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and group_list_type == 1
    assert int(group_list.sum()) == x.shape[0], "group_list_type 1: the counts must sum to x's rows"
    return [grouped_matmul_reference(x, w, group_list)]


def _npu_swiglu(x, dim=-1):
    CALLS.append("npu_swiglu")
    assert x.dtype == torch.float32  # 310P: in float32 (vllm-ascend ops/moe/moe_mlp.py:211-213)
    a, b = x.chunk(2, dim)
    return F.silu(a) * b


@pytest.fixture
def p310(monkeypatch):
    """The emulated 310P, with a stand-in torch_npu holding only the ops the 310P MoE path may call."""
    CALLS.clear()
    monkeypatch.setenv("VLLM_NPU_EMULATED_SOC", "310P")
    reset_chip()
    fake = types.SimpleNamespace(npu_grouped_matmul=_npu_grouped_matmul, npu_swiglu=_npu_swiglu)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    yield
    monkeypatch.delenv("VLLM_NPU_EMULATED_SOC", raising=False)
    reset_chip()


def test_the_chip_picks_the_torch_gate_permutation_and_combine(p310, monkeypatch):
    softmax = RoutingConfig(top_k=2)
    grouped = RoutingConfig(
        top_k=2, use_grouped_topk=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid", renormalize=True
    )
    assert init_routing_kernel() is INIT_ROUTING_310P
    assert gate_path(softmax, 16) == gate_path(grouped, 16) == "native"
    assert build_unpermute(torch.bfloat16, "npu") is combine_masked
    monkeypatch.delenv("VLLM_NPU_EMULATED_SOC")
    reset_chip()
    assert init_routing_kernel() is INIT_ROUTING
    assert (gate_path(softmax, 16), gate_path(grouped, 16)) == ("topk_softmax", "grouped_topk")
    assert build_unpermute(torch.bfloat16, "npu") is unpermute_npu


@pytest.mark.parametrize("expert_range", [(0, 16), (4, 12), (0, 0), (15, 16)])
def test_310p_permutation_equals_its_twin(expert_range):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(11, 48, generator=g).half()
    ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(11)]).int()
    ids[3] = ids[5]  # equal rows: the stable order is part of the contract
    got = init_routing_310p_npu(hidden, ids, 16, expert_range)
    want = init_routing_reference(hidden, ids, 16, expert_range)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _expert_weights(experts: int, inter: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).half()
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).half()
    return w13, w2


@pytest.mark.parametrize("ep_rank", [None, 0, 1])
def test_310p_moe_forward_calls_only_310p_ops_and_matches_the_twins(p310, ep_rank):
    experts, top_k, inter, hidden_size, tokens = 8, 2, 32, 64, 13
    expert_map = None
    if ep_rank is not None:  # linear placement over two ranks that hold the same tokens
        expert_map = torch.full((experts,), -1)
        expert_map[ep_rank * 4 : ep_rank * 4 + 4] = torch.arange(4)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden_size, generator=g).half()
    logits = torch.randn(tokens, experts, generator=g).half()
    w13, w2 = _expert_weights(experts, inter, hidden_size)
    if expert_map is not None:
        w13, w2 = w13[ep_rank * 4 : ep_rank * 4 + 4], w2[ep_rank * 4 : ep_rank * 4 + 4]
    out = {}
    for backend in ("npu", "reference"):
        plan = build_moe_plan(
            RoutingConfig(top_k=top_k), experts, act_dtype=torch.float16, expert_map=expert_map, backend=backend
        )
        out[backend] = moe_forward(x, logits, plan=plan, experts=plan.unquantized_experts(w13, w2))
    assert CALLS == ["npu_grouped_matmul", "npu_swiglu", "npu_grouped_matmul"]
    assert plan.gate_path == "native"
    torch.testing.assert_close(out["npu"], out["reference"], atol=0, rtol=0)


def test_310p_grouped_matmul_refuses_widths_the_chip_cannot_write(p310):
    x = torch.randn(4, 32).half()
    with pytest.raises(AssertionError, match="multiple of 16"):
        grouped_matmul_npu(x, torch.randn(2, 32, 24).half(), torch.tensor([1, 3]))


def test_310p_refuses_moe_widths_off_the_16_grid(p310):
    layer = types.SimpleNamespace(layer_name="model.layers.0.mlp.experts", hidden_size=64)
    layer.intermediate_size_per_partition = 16  # 2 x 16 = 32: fine
    _check_310p_widths(layer)  # type: ignore[arg-type]
    layer.intermediate_size_per_partition = 12  # 24 wide
    with pytest.raises(ConfigError, match=r"gate/up width per tensor-parallel rank is 24.*--enable-expert-parallel"):
        _check_310p_widths(layer)  # type: ignore[arg-type]
    layer.hidden_size, layer.intermediate_size_per_partition = 72, 16
    with pytest.raises(ConfigError, match=r"MoE hidden size 72 cannot run on a 310P: .*multiples of 16"):
        _check_310p_widths(layer)  # type: ignore[arg-type]
