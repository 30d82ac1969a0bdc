# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The MoE forward traced into a compiled decode graph, as the torchair mode compiles it (no engine).

- The finalize twins (``npu_moe_finalize_routing``, the graph's combine) against plain math and the unpermute.
- The NPU strategy: ``torch.compile(fullgraph=True, dynamic=True)`` with every tensor marked static (what the
  torchair wrapper does on an NPU), ``torch_npu`` replaced by opaque custom ops in the ``npu`` namespace with the
  documented arguments, computing the documented semantics (rows the docs leave undefined are NaN here;
  :mod:`npu_testkit.fake_torch_npu`). Results
  equal the eager reference, Dynamo compiles once over new inputs, the lowered aten graph reads nothing on the host,
  and every op in it has an implemented GE converter in torch_npu 2.8.0's torchair (read from the wheel).
- The emulated device's path: the reference twins compiled the same way (``dynamic=False``, as the stand-in).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from npu_testkit.fake_torch_npu import fake_torch_npu
from npu_testkit.torchair_converters import (
    compile_lowered,
    fresh_dynamo_imports,
    graph_ops,
    missing_converters,
    symbolic_inputs,
)
from vllm_npu.ops.moe import routing as rt
from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
from vllm_npu.ops.moe.gating import RoutingConfig

# --- the finalize twins ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (6, 2), (17, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finalize_routing_reference_is_the_unpermute(num_tokens, top_k, dtype):
    torch.manual_seed(3)
    permuted = torch.randn(num_tokens * top_k, 9).to(dtype)
    sorted_indices = torch.randperm(num_tokens * top_k).to(torch.int32)
    probs = torch.rand(num_tokens, top_k)
    expect = torch.zeros(num_tokens, 9)
    for i, flat in enumerate(sorted_indices.tolist()):  # plain math, one row at a time
        expect[flat // top_k] += probs[flat // top_k, flat % top_k] * permuted[i].float()
    out = rt.finalize_routing_reference(permuted, sorted_indices, probs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expect, atol=tol, rtol=tol)
    torch.testing.assert_close(out, rt.unpermute_reference(permuted, sorted_indices, probs), atol=tol, rtol=tol)


def test_src_to_dst_rows_is_the_layout_of_npu_moe_init_routing():
    """``npu_moe_init_routing`` (the op vllm-ascend pairs with the finalize) documents ``expanded_row_idx[
    sorted_row_idx[i]] = i`` over ``row_idx[t, j] = j * T + t``: the slot-major position of each slot's row."""
    t, k = 5, 3
    ids = torch.rand(t, 7).topk(k, -1).indices
    _, gather_idx, _ = rt.init_routing_reference(torch.randn(t, 2), ids, 7, (0, 7))
    row_idx = torch.arange(t * k).view(k, t).t()  # vllm-ascend's row_idx
    order = sorted(range(t * k), key=lambda f: (int(ids.reshape(-1)[f]), f))  # the key-value sort, stable
    sorted_row_idx = row_idx.reshape(-1)[torch.tensor(order)]
    documented = torch.empty(t * k, dtype=torch.int64)
    documented[sorted_row_idx] = torch.arange(t * k)
    assert torch.equal(rt.src_to_dst_rows(gather_idx, k).long(), documented)


# --- compiling the forward -------------------------------------------------------------------------------------


def _weights(e: int, h: int, i: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (
        (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype),
        (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype),
    )


NUM_EXPERTS, HIDDEN, INTER, TOKENS = 6, 16, 8, 4


class _MoELayer(torch.nn.Module):
    """As the engine holds it: the plan and the weights on a module, the experts built per call (as
    ``AscendUnquantizedFusedMoEMethod.apply`` does), so Dynamo sees the plan's ints as the module's constants."""

    def __init__(self, backend: str, dtype: torch.dtype, ep: bool) -> None:
        super().__init__()
        w13, w2 = _weights(NUM_EXPERTS, HIDDEN, INTER, dtype)
        expert_map, local = None, torch.arange(NUM_EXPERTS)
        if ep:  # this rank owns experts 1, 3, 4 over replicated tokens: a partial sum
            local = torch.tensor([1, 3, 4])
            expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
            expert_map[local] = torch.arange(3, dtype=torch.int32)
        self.w13 = torch.nn.Parameter(w13[local], requires_grad=False)
        self.w2 = torch.nn.Parameter(w2[local], requires_grad=False)
        cfg = RoutingConfig(top_k=2)
        self.moe_plan = build_moe_plan(cfg, NUM_EXPERTS, act_dtype=dtype, expert_map=expert_map, backend=backend)

    def forward(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return moe_forward(x, logits, plan=self.moe_plan, experts=self.moe_plan.unquantized_experts(self.w13, self.w2))


def _run(backend: str, dtype: torch.dtype, ep: bool, *, compiled: bool) -> tuple[list[torch.Tensor], list[Any]]:
    """Three decode steps of one MoE layer (same shapes, new values), eager or compiled; outputs and the graphs."""
    layer = _MoELayer(backend, dtype, ep)
    fn, graphs = (
        compile_lowered(lambda x, logits: layer(x, logits), dynamic=backend == "npu") if compiled else (layer, [])
    )
    outs = []
    with torch.no_grad():
        for seed in range(3):
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype)
            logits = torch.randn(TOKENS, NUM_EXPERTS, generator=gen)
            if compiled and backend == "npu":  # the torchair wrapper's NPU strategy: dynamic, tensors static
                for t in (x, logits, layer.w13, layer.w2):
                    torch._dynamo.mark_static(t)
            outs.append(fn(x, logits))
    return outs, graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ep", [False, True])
def test_npu_strategy_compiles_once_and_every_op_has_a_converter(monkeypatch, dtype, ep):
    expected, _ = _run("reference", dtype, ep, compiled=False)
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(checked=True))
    eager, _ = _run("npu", dtype, ep, compiled=False)  # the calls fit the documented signatures
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(checked=False))
    with fresh_dynamo_imports():
        outs, graphs = _run("npu", dtype, ep, compiled=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for out, exp in zip(eager + outs, expected * 2, strict=True):
        assert not torch.isnan(out).any()  # the undefined rows never reach the output
        torch.testing.assert_close(out.float(), exp.float(), atol=tol, rtol=tol)
    assert len(graphs) == 1, f"{len(graphs)} compiles over three steps of the same shapes"
    # GE converters take the ops' ints (k, expert_num, active_expert_range, ...) as attributes: none is symbolic
    assert symbolic_inputs(graphs[0]) == []
    ops = graph_ops(graphs[0])
    assert not ops & {"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default"}, ops
    assert missing_converters(ops) == []
    npu_ops = {op for op in ops if op.startswith("npu.")}
    gemm = {"npu.npu_grouped_matmul.default", "npu.npu_swiglu.default"}
    assert npu_ops == {"npu.npu_moe_gating_top_k_softmax.default", "npu.npu_moe_init_routing_v2.default"} | gemm | (
        set() if ep else {"npu.npu_moe_finalize_routing.default"}  # EP combines the partial rows in plain torch
    )


@pytest.mark.parametrize("ep", [False, True])
def test_reference_twins_compile_without_host_reads(ep):
    """The emulated device's graph (the stand-in compiles with ``dynamic=False``): one compile, the eager result,
    and the only host read of the counts stays inside the grouped matmul twin's registered op."""
    expected, _ = _run("reference", torch.float32, ep, compiled=False)
    outs, graphs = _run("reference", torch.float32, ep, compiled=True)
    for out, exp in zip(outs, expected, strict=True):
        torch.testing.assert_close(out, exp, atol=1e-5, rtol=1e-5)
    assert len(graphs) == 1
    ops = graph_ops(graphs[0])
    assert "vllm_npu.moe_grouped_matmul.default" in ops and "aten._local_scalar_dense.default" not in ops
