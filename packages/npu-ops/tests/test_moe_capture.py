# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The MoE forward inside a captured static graph (vllm_npu.ops.moe.capture), captured by the emulated device's twin
(no engine). vLLM's moe_forward is not a splitting op, so under PIECEWISE / FULL_DECODE_ONLY the layer runs inside
the captured graph: no host read may happen there. The expert-parallel paths without one are captured and replay
right (on the reference twins and on the NPU kernels' documented stand-ins); the all-to-all, whose split sizes are
read on the host, fails the capture loudly instead of being frozen into it."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from npu_testkit.fake_torch_npu import fake_torch_npu
from vllm_npu.interface import recording
from vllm_npu.ops.moe.capture import HostReadInCaptureError, host_ints, in_graph_step
from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
from vllm_npu.ops.moe.gating import RoutingConfig
from vllm_npu.ops.moe.layer import dp_steps_padded
from vllm_npu.platform.graphs.emulated.twin import EmulatedGraph

NUM_EXPERTS, HIDDEN, INTER, TOKENS = 6, 16, 8, 5


class _NoTasks:
    def record(self, kernel: Any, args: Any, params: Any, refresh: Any) -> Any:
        raise AssertionError("no updatable task expected")


def test_host_reads_are_refused_only_while_a_graph_is_captured():
    values = torch.tensor([3, 1])
    assert host_ints(values, "the split sizes") == [3, 1] and not in_graph_step()
    with recording(_NoTasks()):
        assert in_graph_step()
        with pytest.raises(HostReadInCaptureError, match="read the split sizes on the host while a static graph"):
            host_ints(values, "the split sizes")


def _weights(local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    return w13[local].contiguous(), w2[local].contiguous()


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS, HIDDEN, generator=gen), torch.randn(TOKENS, NUM_EXPERTS, generator=gen)


def _ep_layer(backend: str, **plan: Any) -> Any:
    """One EP rank's MoE step over replicated tokens: experts 1, 3, 4 of 6 (a partial sum)."""
    local = torch.tensor([1, 3, 4])
    expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
    expert_map[local] = torch.arange(3, dtype=torch.int32)
    w13, w2 = _weights(local)
    moe = build_moe_plan(
        RoutingConfig(top_k=2), NUM_EXPERTS, act_dtype=torch.float32, expert_map=expert_map, backend=backend, **plan
    )
    return lambda x, logits: moe_forward(x, logits, plan=moe, experts=moe.unquantized_experts(w13, w2))


@pytest.mark.parametrize("backend", ["reference", "npu"])
def test_expert_parallel_over_replicated_tokens_is_captured_and_replays_right(monkeypatch, backend):
    """Without the fix the dispatcher read its row count (``int(counts.sum())``) inside the capture."""
    expected = [_ep_layer("reference")(*_inputs(seed)) for seed in range(3)]
    if backend == "npu":  # torch_npu's documented kernels (rows they leave undefined come out NaN)
        monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(checked=True))
    step = _ep_layer(backend)
    x, logits = _inputs(0)
    with torch.no_grad():
        graph = EmulatedGraph.capture(step, (x, logits), {})
        outs = [graph.output.clone()]
        for seed in (1, 2):  # new step: new contents in the captured buffers, then a replay
            new_x, new_logits = _inputs(seed)
            x.copy_(new_x)
            logits.copy_(new_logits)
            outs.append(graph.replay((x, logits), {}).clone())
    for out, exp in zip(outs, expected, strict=True):
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out, exp, atol=1e-5, rtol=1e-5)


def test_the_all_to_all_exchange_fails_the_capture_loudly():
    """The variable-size all-to-all reads its split sizes on the host: a capture must fail, not freeze them (the
    twin's tracer lets ``.tolist()`` through, so without the guard this capture succeeded)."""
    moe = build_moe_plan(
        RoutingConfig(top_k=2),
        NUM_EXPERTS,
        act_dtype=torch.float32,
        all_to_all=lambda x, out_splits, in_splits: x.clone(),  # one rank: the exchange is the identity
        expert_maps=[torch.arange(NUM_EXPERTS, dtype=torch.int32)],
        ep_rank=0,
        backend="reference",
    )
    w13, w2 = _weights(torch.arange(NUM_EXPERTS))
    experts = moe.unquantized_experts(w13, w2)
    x, logits = _inputs(0)
    local = build_moe_plan(RoutingConfig(top_k=2), NUM_EXPERTS, act_dtype=torch.float32, backend="reference")
    eager = moe_forward(x, logits, plan=moe, experts=experts)  # eager steps are fine: one rank holds every expert
    torch.testing.assert_close(eager, moe_forward(x, logits, plan=local, experts=experts), atol=1e-5, rtol=1e-5)
    with pytest.raises(HostReadInCaptureError, match="all-to-all split sizes"):
        EmulatedGraph.capture(lambda a, b: moe_forward(a, b, plan=moe, experts=experts), (x, logits), {})


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (None, False),  # no model config (tests, tools): nothing padded
        (SimpleNamespace(enforce_eager=True), False),  # eager (also what the platform sets when graphs are off)
        (SimpleNamespace(enforce_eager=False), True),  # graphs on: vLLM's get_dp_padding pads every DP rank
    ],
)
def test_dp_steps_are_padded_exactly_when_vllm_pads_them(model, expected):
    assert dp_steps_padded(SimpleNamespace(model_config=model)) is expected


def test_graph_steps_of_vllm_take_the_capture_path_on_replay_too():
    """The emulated twin re-runs vLLM's opaque moe_forward at every replay: in a graph step it takes the path the
    NPU captured, not the eager one."""
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.forward_context import BatchDescriptor, set_forward_context

    cfg = VllmConfig()
    with set_forward_context(None, cfg, cudagraph_runtime_mode=CUDAGraphMode.NONE):
        assert not in_graph_step()
    for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
        with set_forward_context(None, cfg, cudagraph_runtime_mode=mode, batch_descriptor=BatchDescriptor(4)):
            assert in_graph_step()
            assert host_ints(torch.tensor([2]), "a size") == [2]  # refused only while capturing
