# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Shared-expert overlap (``npu.multistream_overlap_shared_expert``) inside a compiled torchair graph, without an
engine.

While Dynamo traces, the MoE layer's shared experts go under torchair's stream scope instead of the eager side
stream (vllm-ascend v0.11.0's torchair MoE does the same, ``torchair/ops/torchair_fused_moe.py:133-137``). A stand-in
``torchair.scope.npu_stream_switch`` built like torch_npu 2.8.0's (``torchair/scope/_scope.py``: side-effect ops
``scope_enter(keys, values)`` / ``scope_exit()`` that torchair's FX-to-GE converter executes while it builds the GE
graph, labelling the nodes between them) shows that the compiled graph holds exactly the shared experts' ops between
the scope's enter and exit, with the stream label and priority vllm-ascend uses, the routed experts' ops outside it,
no stream object, and the eager values; the emulated path (no torchair) gives the same values.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from torch.fx.node import has_side_effect
from vllm_npu.ops.moe.layer import AscendFusedMoE
from vllm_npu.ops.moe.overlap import GRAPH_SIDE_STREAM

_LIB = torch.library.Library("air_standin", "DEF")
_LIB.define("scope_enter(str[] keys, str[] values) -> ()")
_LIB.define("scope_exit() -> ()")
for _name in ("scope_enter", "scope_exit"):
    _LIB.impl(_name, lambda *args: None, "CompositeExplicitAutograd")
    has_side_effect(getattr(torch.ops.air_standin, _name).default)


class _Scope:
    def __init__(self, attrs: list[tuple[str, str]]) -> None:
        self.attrs = attrs

    def __enter__(self) -> None:
        keys, values = zip(*self.attrs, strict=True)
        torch.ops.air_standin.scope_enter(list(keys), list(values))

    def __exit__(self, *args: Any) -> None:
        torch.ops.air_standin.scope_exit()


def _fake_torchair() -> types.ModuleType:
    scope = types.ModuleType("torchair.scope")
    scope.npu_stream_switch = lambda tag, priority=0: _Scope(  # type: ignore[attr-defined]
        [("_user_stream_label", tag), ("_user_stream_priority", str(priority))]
    )
    torchair = types.ModuleType("torchair")
    torchair.scope = scope  # type: ignore[attr-defined]
    return torchair


class _NoSideStream:
    def overlap(self, *args: Any) -> Any:
        raise AssertionError("the eager side stream must not be traced into the graph")


class _Layer(torch.nn.Module):
    """The parts of an AscendFusedMoE that ``_shared_and_routed`` reads: shared experts and a side stream."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.shared_experts = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 8))
        self.routed_w = torch.nn.Parameter(torch.randn(8, 8, generator=gen), requires_grad=False)
        self._side_stream = _NoSideStream()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared, routed = AscendFusedMoE._shared_and_routed(self, x, lambda: torch.tanh(x @ self.routed_w))  # type: ignore[arg-type]
        assert shared is not None
        return shared + routed


def _compiled(layer: _Layer) -> tuple[Any, list[torch.fx.GraphModule]]:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(layer, backend=backend, fullgraph=True, dynamic=False), graphs


@pytest.mark.parametrize("backend", ["npu", "reference"])
def test_shared_experts_go_under_torchairs_stream_scope_in_the_graph(monkeypatch, backend):
    import vllm_npu.ops.moe.layer as layer_module

    monkeypatch.setattr(layer_module, "kernel_backend", lambda: backend)
    monkeypatch.setitem(sys.modules, "torchair", _fake_torchair())
    layer = _Layer()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = layer.shared_experts(x) + torch.tanh(x @ layer.routed_w)
        compiled, graphs = _compiled(layer)
        torch.testing.assert_close(compiled(x), expected)
    (graph,) = graphs
    calls = [n for n in graph.graph.nodes if n.op in ("call_function", "call_module", "call_method")]
    names = [str(n.target) for n in calls]
    enters = [i for i, t in enumerate(names) if "scope_enter" in t]
    exits = [i for i, t in enumerate(names) if "scope_exit" in t]
    if backend == "reference":  # the emulated device: no torchair, no scope, the same values
        assert not enters and not exits
        return
    assert len(enters) == len(exits) == 1 and enters[0] < exits[0], names
    assert calls[enters[0]].args == (["_user_stream_label", "_user_stream_priority"], [GRAPH_SIDE_STREAM, "0"])
    inside = names[enters[0] + 1 : exits[0]]
    # the shared experts' two linears and their activation, nothing of the routed experts
    assert sum("linear" in t for t in inside) == 2 and not any("tanh" in t for t in inside), inside
    assert any("tanh" in t for t in names[exits[0] :]), names
    assert not any("stream" in t.lower() and "scope" not in t for t in names), names
