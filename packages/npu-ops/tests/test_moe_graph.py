# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The MoE forward traced into a compiled decode graph, as the torchair mode compiles it (no engine).

- The finalize twins (``npu_moe_finalize_routing``, the graph's combine) against plain math and the unpermute.
- The NPU strategy: ``torch.compile(fullgraph=True, dynamic=True)`` with every tensor marked static (what the
  torchair wrapper does on an NPU), ``torch_npu`` replaced by opaque custom ops in the ``npu`` namespace with the
  documented arguments, computing the documented semantics (rows the docs leave undefined are NaN here). Results
  equal the eager reference, Dynamo compiles once over new inputs, the lowered aten graph reads nothing on the host,
  and every op in it has an implemented GE converter in torch_npu 2.8.0's torchair (read from the wheel).
- The emulated device's path: the reference twins compiled the same way (``dynamic=False``, as the stand-in).
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import pytest
import torch
from npu_testkit import npu_binding_rules as rules
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

NAN = float("nan")


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


# --- torch_npu as opaque ops with the documented arguments -----------------------------------------------------


@functools.cache
def _register_npu_ops() -> None:
    """The MoE decode graph's torch_npu ops as ``torch.ops.npu.*`` custom ops (the namespace and names of the real
    ones, so the graph's node names are the converter table's)."""
    lib = "npu::"

    @torch.library.custom_op(lib + "npu_moe_gating_top_k_softmax", mutates_args=())
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

    @torch.library.custom_op(lib + "npu_moe_init_routing_v2", mutates_args=())
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

    @torch.library.custom_op(lib + "npu_grouped_matmul", mutates_args=())
    def grouped_matmul(
        x: list[torch.Tensor],
        weight: list[torch.Tensor],
        group_list: torch.Tensor,
        split_item: int,
        group_type: int,
        group_list_type: int,
    ) -> list[torch.Tensor]:
        assert len(x) == len(weight) == 1 and split_item == 2 and group_type == 0 and group_list_type == 1
        (xx,), (w,) = x, weight
        assert group_list.dtype == torch.int64 and int(group_list.sum()) <= xx.shape[0]
        out, start = torch.full((xx.shape[0], w.shape[-1]), NAN, dtype=xx.dtype), 0  # undefined past the counts
        for g, n in enumerate(group_list.tolist()):
            out[start : start + n] = xx[start : start + n] @ w[g]
            start += n
        return [out]

    grouped_matmul.register_fake(
        lambda x, weight, gl, si, gt, glt: [x[0].new_empty(x[0].shape[0], weight[0].shape[-1])]
    )

    @torch.library.custom_op(lib + "npu_swiglu", mutates_args=())
    def swiglu(x: torch.Tensor, dim: int) -> torch.Tensor:
        a, b = x.chunk(2, dim=dim)
        return a * torch.sigmoid(a) * b

    swiglu.register_fake(lambda x, dim: x.new_empty(*x.shape[:-1], x.shape[-1] // 2))

    @torch.library.custom_op(lib + "npu_moe_finalize_routing", mutates_args=())
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


@functools.cache
def _fake_torch_npu(*, checked: bool) -> types.ModuleType:
    """``checked``: each call behind the documented 2.8.0 signature check (eager runs: Dynamo cannot trace the
    check, which parses the wheel's docs)."""
    _register_npu_ops()
    ops = torch.ops.npu
    m = types.ModuleType("torch_npu")  # a module: Dynamo traces the twins' `import torch_npu`

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

    def npu_grouped_matmul(x, weight, *, group_list=None, split_item=0, group_type=None, group_list_type=0, **kw):
        assert not any(v is not None for v in kw.values())
        return ops.npu_grouped_matmul(x, weight, group_list, split_item, group_type, group_list_type)

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

    def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
        # the eager bf16 combine (not an op of the graph: the test checks the graph holds the finalize instead)
        assert permuted_tokens.dtype == probs.dtype == torch.bfloat16 and sorted_indices.dtype == torch.int64
        return rt.unpermute_reference(permuted_tokens, sorted_indices, probs)

    for fn in (
        npu_moe_gating_top_k_softmax,
        npu_moe_init_routing_v2,
        npu_grouped_matmul,
        npu_swiglu,
        npu_moe_finalize_routing,
        npu_moe_token_unpermute,
    ):
        setattr(m, fn.__name__, rules.documented(fn) if checked else fn)
    return m


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
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(checked=True))
    eager, _ = _run("npu", dtype, ep, compiled=False)  # the calls fit the documented signatures
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(checked=False))
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
