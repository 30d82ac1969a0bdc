# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Dynamic EPLB inside a compiled (torchair) decode graph, without an engine.

A MoE layer on rank 0 of 2 (vLLM's initial EPLB placement, 6 logical + 2 redundant experts, the local dispatcher over
replicated tokens) follows vLLM-shaped replica tables and counts its load, compiled as the torchair wrapper compiles
it (the reference twins, ``dynamic=False``; and the NPU strategy, ``dynamic=True`` with ``torch_npu`` as opaque ops of
the documented arguments). Between steps a rearrangement rewrites the tables and the moved slot's weights in place,
as vLLM's ``EplbState.rearrange`` does (``copy_`` into the same tensors; vllm-ascend's EPLB adaptor does the same,
``eplb/adaptor/vllm_adaptor.py``): the compiled layer equals the eager one on every step, before and after, reads the
new placement (its output changes with it), counts the same load, and compiles once: the tables are graph inputs.
"""

from __future__ import annotations

import sys

import torch
from npu_testkit.fake_torch_npu import fake_torch_npu
from npu_testkit.torchair_converters import (
    compile_lowered,
    fresh_dynamo_imports,
    graph_ops,
    missing_converters,
    symbolic_inputs,
)
from vllm_npu.ops.moe.eplb import eplb_placement, eplb_tables
from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
from vllm_npu.ops.moe.gating import RoutingConfig
from vllm_npu.ops.moe.placement import ExpertPlacement

E, R, K, HID, INTER, TOKENS = 6, 2, 2, 16, 8, 5
REBALANCED = [0, 1, 2, 4, 3, 5, 0, 1]  # rank 0's slot 3 now holds expert 4 (was 3); rank 1's slot 4 expert 3


def _checkpoint() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * INTER, HID, generator=gen) / HID**0.5, torch.randn(
        E, HID, INTER, generator=gen
    ) / INTER**0.5


class _EplbLayer(torch.nn.Module):
    """Rank 0's layer: its 4 slots' weights, the plan over a placement that follows vLLM-shaped tables."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.placement = placement = eplb_placement(E, R, 2)
        phys = placement.physical_to_logical.tolist()
        self.table, self.counts = eplb_tables(phys, E)
        self.load = torch.zeros(len(phys), dtype=torch.int32)
        placement.follow(self.table, self.counts, self.load)
        w13, w2 = _checkpoint()
        mine = placement.slots[0]
        self.w13 = torch.nn.Parameter(w13[mine].clone(), requires_grad=False)
        self.w2 = torch.nn.Parameter(w2[mine].clone(), requires_grad=False)
        self.moe_plan = build_moe_plan(
            RoutingConfig(top_k=K), E, act_dtype=torch.float32, placement=placement, ep_rank=0, backend=backend
        )

    def forward(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return moe_forward(x, logits, plan=self.moe_plan, experts=self.moe_plan.unquantized_experts(self.w13, self.w2))

    def rearrange(self, physical_to_logical: list[int]) -> None:
        """What EplbState.rearrange does to this rank: tables and moved weights rewritten in place."""
        table, counts = eplb_tables(physical_to_logical, E)
        self.table.copy_(table)
        self.counts.copy_(counts)
        w13, w2 = _checkpoint()
        mine = physical_to_logical[:4]
        self.w13.copy_(w13[mine])
        self.w2.copy_(w2[mine])


def _steps(backend: str, *, compiled: bool, rebalance: bool = True):
    """Four decode steps, a rearrangement after the second; outputs, the load after each step, the graphs."""
    layer = _EplbLayer(backend)
    fn, graphs = compile_lowered(layer, dynamic=backend == "npu") if compiled else (layer, [])
    outs, loads = [], []
    with torch.no_grad():
        for step in range(4):
            if step == 2 and rebalance:
                layer.rearrange(REBALANCED)
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(TOKENS, HID, generator=gen)
            logits = torch.randn(TOKENS, E, generator=gen)
            logits[:, 4] += 1.0  # expert 4 is hot
            if compiled and backend == "npu":  # the torchair wrapper's NPU strategy: dynamic, tensors static
                for t in (x, logits, layer.w13, layer.w2):
                    torch._dynamo.mark_static(t)
            outs.append(fn(x, logits).clone())
            loads.append(layer.load.clone())
    return outs, loads, graphs


def test_the_compiled_layer_reads_rearranged_tables_without_recompiling():
    expected, expected_loads, _ = _steps("reference", compiled=False)
    unbalanced, _, _ = _steps("reference", compiled=False, rebalance=False)
    outs, loads, graphs = _steps("reference", compiled=True)
    for out, exp in zip(outs, expected, strict=True):
        torch.testing.assert_close(out, exp, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(loads, expected_loads, strict=True)), (loads, expected_loads)
    assert int(loads[-1].sum()) > 0  # the graph counted the load in place
    assert not torch.allclose(expected[3], unbalanced[3])  # the rearrangement changes what rank 0 computes
    assert len(graphs) == 1, f"{len(graphs)} compiles over four steps and a rearrangement"


def test_npu_strategy_reads_rearranged_tables_and_every_op_has_a_converter(monkeypatch):
    expected, expected_loads, _ = _steps("reference", compiled=False)
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(checked=False))
    with fresh_dynamo_imports():
        outs, loads, graphs = _steps("npu", compiled=True)
    for out, exp in zip(outs, expected, strict=True):
        torch.testing.assert_close(out, exp, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(loads, expected_loads, strict=True))
    assert len(graphs) == 1
    assert symbolic_inputs(graphs[0]) == []  # the followed tables are static: no shape input
    ops = graph_ops(graphs[0])
    assert not ops & {"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default"}, ops
    assert missing_converters(ops) == [], ops


class _StaticMapLayer(torch.nn.Module):
    """Rank 0 of 2 under a static ``npu.expert_map_path`` placement with redundant replicas (experts 0 and 1 on both
    ranks): the placement's own tables, marked static."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        placement = ExpertPlacement(E, [[0, 1, 2, 3], [4, 5, 0, 1]])
        w13, w2 = _checkpoint()
        self.w13 = torch.nn.Parameter(w13[[0, 1, 2, 3]].clone(), requires_grad=False)
        self.w2 = torch.nn.Parameter(w2[[0, 1, 2, 3]].clone(), requires_grad=False)
        self.moe_plan = build_moe_plan(
            RoutingConfig(top_k=K), E, act_dtype=torch.float32, placement=placement, ep_rank=0, backend=backend
        )

    def forward(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return moe_forward(x, logits, plan=self.moe_plan, experts=self.moe_plan.unquantized_experts(self.w13, self.w2))


def test_a_static_expert_map_compiles_once_with_converters(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    steps = [(torch.randn(TOKENS, HID, generator=gen), torch.randn(TOKENS, E, generator=gen)) for _ in range(3)]
    expected = [_StaticMapLayer("reference")(x, lg) for x, lg in steps]
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(checked=False))
    with fresh_dynamo_imports():
        layer = _StaticMapLayer("npu")
        fn, graphs = compile_lowered(layer, dynamic=True)
        with torch.no_grad():
            for (x, lg), exp in zip(steps, expected, strict=True):
                for t in (x, lg, layer.w13, layer.w2):
                    torch._dynamo.mark_static(t)
                torch.testing.assert_close(fn(x, lg), exp, atol=1e-5, rtol=1e-5)
    assert len(graphs) == 1 and symbolic_inputs(graphs[0]) == []
    assert missing_converters(graph_ops(graphs[0])) == []
