# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Each quantized MoE scheme's layer forward traced into a compiled decode graph, as the torchair mode compiles it.

A real vLLM ``FusedMoE`` with npu-quant's MoE method (W8A8_DYNAMIC, static W8A8, W4A8_DYNAMIC), loaded and processed
as in an engine; its ``quant_method.apply`` (npu-ops' gate, dispatcher and combine around the scheme's experts) is
compiled:

- NPU strategy: the layer built with the NPU kernels (the plan's and the experts'), ``torch.compile(fullgraph=True,
  dynamic=True)`` with the inputs marked static (what the torchair wrapper does on an NPU), ``torch_npu`` replaced by
  opaque custom ops of the ``npu`` namespace with the documented arguments (:mod:`npu_testkit.fake_torch_npu`: the
  quant ops' bodies are npu-quant's reference twins, rows the docs leave undefined are NaN). Over three steps the
  result equals the eager layer on the reference kernels, Dynamo compiles once, the lowered graph reads nothing on
  the host, has no symbolic input, and every op of it has an implemented GE converter in torch_npu 2.8.0's torchair
  (read from the wheel); the ``torch_npu`` ops in it are exactly the scheme's. With and without expert parallelism
  over replicated tokens (every row reaches the grouped matmuls; the rows past the counts are NaN and dropped).
- Reference strategy (the emulated device's stand-in, ``dynamic=False``): equal to eager, one compile, the counts read
  only inside the registered grouped-matmul ops (``torch.ops.vllm_npu.quant_grouped_matmul_int8`` / ``_a8w4``).
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
from quant_moe_harness import TOP_K, H, build, float_experts, quantized

#: Routed experts of the router; with EP this rank holds experts 1, 3 and 4 (over replicated tokens).
NUM_EXPERTS, LOCAL, TOKENS = 6, (1, 3, 4), 5
ROUTING = {"npu.npu_moe_gating_top_k_softmax.default", "npu.npu_moe_init_routing_v2.default"}
GEMM = {"npu.npu_grouped_matmul.default", "npu.npu_swiglu.default"}
SCHEMES = {  # the scheme's torch_npu ops in the graph, besides routing, grouped matmuls and the combine
    "W8A8_DYNAMIC": ({"npu.npu_dynamic_quant.default"}, "vllm_npu.quant_grouped_matmul_int8.default"),
    "W8A8": ({"npu.npu_quantize.default"}, "vllm_npu.quant_grouped_matmul_int8.default"),
    "W4A8_DYNAMIC": ({"npu.npu_dynamic_quant.default"}, "vllm_npu.quant_grouped_matmul_a8w4.default"),
}


def _layer(qtype: str, dtype: torch.dtype, ep: bool, backend: str, monkeypatch: pytest.MonkeyPatch, prefix: str) -> Any:
    """The processed layer on ``backend``'s kernels; with ``ep`` it holds the experts ``LOCAL`` of ``NUM_EXPERTS``
    and its plan the expert map (as npu-ops' layer builds it under vLLM's default expert parallelism)."""
    from vllm_npu.ops.moe.forward import build_moe_plan
    from vllm_npu.ops.moe.layer import routing_config_of

    weights = float_experts(seed=4, num_experts=NUM_EXPERTS)
    if ep:
        weights = {(LOCAL.index(e), p): w for (e, p), w in weights.items() if e in LOCAL}
    layer = build(qtype, quantized(qtype, weights), dtype=dtype, prefix=prefix)
    layer.quant_method.process_weights_after_loading(layer)  # load-time kernels: reference (they run outside graphs)
    with monkeypatch.context() as m:
        m.setattr(
            "vllm_npu.interface.device.kernel_backend", lambda: backend
        )  # what select() sees on an NPU (or the emulated device)
        expert_map = None
        if ep:
            expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
            expert_map[list(LOCAL)] = torch.arange(len(LOCAL), dtype=torch.int32)
        # the plan npu-ops' AscendFusedMoE builds (also when FusedMoE is vLLM's own: other tests may register ours)
        layer.moe_plan = build_moe_plan(
            routing_config_of(layer), NUM_EXPERTS, act_dtype=dtype, expert_map=expert_map, backend=backend
        )
        layer.quant_method._build(layer)  # the forward kernels chosen again (layer.moe_plan, as under AscendFusedMoE)
    return layer


def _steps(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        out.append((torch.randn(TOKENS, H, generator=g).to(dtype), torch.randn(TOKENS, NUM_EXPERTS, generator=g)))
    return out


def _run(layer: Any, steps: list[tuple[torch.Tensor, torch.Tensor]], *, compiled: bool, dynamic: bool) -> tuple:
    def forward(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return layer.quant_method.apply(layer, x, logits, TOP_K, True)

    fn, graphs = compile_lowered(forward, dynamic=dynamic) if compiled else (forward, [])
    outs = []
    with torch.no_grad():
        for x, logits in steps:
            if compiled and dynamic:  # the torchair wrapper's NPU strategy: dynamic, every tensor input static
                torch._dynamo.mark_static(x)
                torch._dynamo.mark_static(logits)
            outs.append(fn(x, logits))
    return outs, graphs


@pytest.mark.parametrize("qtype", sorted(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ep", [False, True])
def test_npu_strategy_compiles_once_and_every_op_has_a_converter(vllm_ctx, monkeypatch, qtype, dtype, ep):
    steps = _steps(dtype)
    expected, _ = _run(
        _layer(qtype, dtype, ep, "reference", monkeypatch, "model.layers.0.mlp.experts"),
        steps,
        compiled=False,
        dynamic=False,
    )
    layer = _layer(qtype, dtype, ep, "npu", monkeypatch, "model.layers.1.mlp.experts")
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(quant=True, checked=True))
    eager, _ = _run(layer, steps, compiled=False, dynamic=False)  # the calls fit the documented signatures
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(quant=True))
    with fresh_dynamo_imports():
        outs, graphs = _run(layer, steps, compiled=True, dynamic=True)
    for out, exp in zip(eager + outs, expected * 2, strict=True):
        assert not torch.isnan(out).any()  # the undefined rows never reach the output
        # the same quantized maths; bf16/fp16 routing weights and combine round differently from the eager combine
        torch.testing.assert_close(out.float(), exp.float(), atol=2e-2 * float(exp.abs().max()), rtol=2e-2)
    assert len(graphs) == 1, f"{len(graphs)} compiles over three steps of the same shapes"
    assert symbolic_inputs(graphs[0]) == []
    ops = graph_ops(graphs[0])
    assert not ops & {"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default"}, ops
    assert "aten.repeat_interleave.Tensor" not in ops and missing_converters(ops) == [], ops
    combine = set() if ep else {"npu.npu_moe_finalize_routing.default"}  # EP combines the partial rows in torch
    assert {op for op in ops if op.startswith("npu.")} == ROUTING | GEMM | SCHEMES[qtype][0] | combine
    assert not any(op.startswith("vllm_npu.") for op in ops)  # the reference ops stay out of the NPU graph


@pytest.mark.parametrize("qtype", sorted(SCHEMES))
@pytest.mark.parametrize("ep", [False, True])
def test_reference_twins_compile_without_host_reads(vllm_ctx, monkeypatch, qtype, ep):
    """The emulated device's graph (the stand-in compiles with ``dynamic=False``): one compile, the eager result, and
    the counts are read only inside the registered grouped-matmul op of the scheme."""
    layer = _layer(qtype, torch.float32, ep, "reference", monkeypatch, "model.layers.0.mlp.experts")
    steps = _steps(torch.float32)
    expected, _ = _run(layer, steps, compiled=False, dynamic=False)
    outs, graphs = _run(layer, steps, compiled=True, dynamic=False)
    for out, exp in zip(outs, expected, strict=True):
        torch.testing.assert_close(out, exp, atol=1e-5, rtol=1e-5)
    assert len(graphs) == 1
    ops = graph_ops(graphs[0])
    assert SCHEMES[qtype][1] in ops and "aten._local_scalar_dense.default" not in ops, ops
    assert "aten.repeat_interleave.Tensor" not in ops
