# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``npu.emulated_compile=inductor`` on the twin (vllm_npu.platform.graphs.emulated.twin_compile): writes into captured
buffers and updatable tasks stay eager on the real buffers, the pure pieces between them are compiled, and a
compiled replay keeps every static-graph rule of the uncompiled one (frozen task parameters until refreshed, inputs
checked by address)."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from vllm_npu.interface import launch
from vllm_npu.platform.graphs import GraphInputMovedError
from vllm_npu.platform.graphs.emulated.twin import EmulatedGraph
from vllm_npu.platform.graphs.emulated.twin_compile import state_nodes


def _attend(q: torch.Tensor, cache: torch.Tensor, *, lens: list[int], out: torch.Tensor) -> None:
    """A task standing in for paged decode: row i of ``out`` = q[i] * (sum of the first lens[i] cache rows)."""
    for i, n in enumerate(lens):
        out[i].copy_(q[i] * cache[:n].sum(dim=0))


class _Step:
    """A decode-like step: a pure projection, a cache write through a view of a captured buffer (as the KV write
    twin does), a task reading the cache, and a pure tail."""

    def __init__(self) -> None:
        self.w = torch.linspace(0.5, 1.5, 16).reshape(4, 4)
        self.kv = torch.zeros(2, 8, 4)  # (k/v, slots, dim): unbound like vLLM's per-layer cache
        self.lens = [1, 1]
        self.out = torch.empty(2, 4)

    def __call__(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x @ self.w) + 1.0
        key, _ = self.kv.unbind(0)
        key.view(-1, 4).index_copy_(0, slots, h)
        launch(_attend, h, key, refresh=lambda: {"lens": list(self.lens)}, lens=self.lens, out=self.out)
        return torch.tanh(self.out * 0.1) + h


@pytest.fixture(scope="module")
def captured() -> tuple[EmulatedGraph, EmulatedGraph, dict[str, Any]]:
    """The same step captured twice (separate state): one graph replayed as traced, one compiled."""
    made = []
    for _ in range(2):
        step = _Step()
        x, slots = torch.ones(2, 4), torch.tensor([0, 1])
        made.append((EmulatedGraph.capture(step, (x, slots), {}), step, x, slots))
    (plain, s1, x1, sl1), (compiled, s2, x2, sl2) = made
    compiled.compile()
    return plain, compiled, {"steps": (s1, s2), "x": (x1, x2), "slots": (sl1, sl2)}


def test_state_writes_views_and_tasks_stay_eager():
    step = _Step()
    g = EmulatedGraph.capture(step, (torch.ones(2, 4), torch.tensor([0, 1])), {})
    eager = state_nodes(g.module.graph)
    targets = {n.target for n in eager}
    assert torch.ops.aten.index_copy_.default in targets
    assert torch.ops.vllm_npu_graph.task.default in targets
    assert torch.ops.aten.unbind.int in targets and operator.getitem in targets  # views of the captured cache
    # the projection, ReLU and the tail are not state nodes: inductor compiles them
    assert not {torch.ops.aten.mm.default, torch.ops.aten.relu.default, torch.ops.aten.tanh.default} & targets
    g.reset()


def test_compiled_replay_equals_the_traced_graph_and_writes_the_real_cache(captured):
    plain, compiled, st = captured
    assert compiled.compiled is not None and plain.compiled is None
    kv_address = st["steps"][1].kv.data_ptr()
    for n, (values, slots) in enumerate([([0.5, -1.0], [2, 3]), ([2.0, 3.0], [4, 5])]):
        for g, step, x, sl in zip((plain, compiled), st["steps"], st["x"], st["slots"], strict=True):
            x.copy_(torch.tensor(values).unsqueeze(1).expand(2, 4))
            sl.copy_(torch.tensor(slots))
            step.lens = [slots[1] + 1, slots[1] + 1]
            g.refresh_tasks()
            g.replay((x, sl), {})
        s1, s2 = st["steps"]
        assert torch.equal(plain.output, compiled.output), f"replay {n}"
        assert torch.equal(s1.kv, s2.kv)  # the compiled graph wrote the captured cache itself, in place
        assert s2.kv.data_ptr() == kv_address and s2.kv[0, slots[0]].abs().sum() > 0


def test_compiled_eager_pieces_call_tasks_without_the_dispatcher(captured):
    """The split's eager pieces are inlined into the split graph (no module call per piece) and call the task's
    Python (run_task) instead of the custom op: same task, same tensors, no dispatcher round trip per layer and
    step. Views of captured buffers are constants of the split (computed once, at compile)."""
    from vllm_npu.platform.graphs.emulated.twin import run_task

    _, compiled, _ = captured
    split = compiled.compiled
    assert not [p for n, p in split.named_children() if isinstance(p, torch.fx.GraphModule)]  # all inlined
    targets = [n.target for n in split.graph.nodes]
    assert run_task in targets and torch.ops.vllm_npu_graph.task.default not in targets
    views = [n for n in split.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.unbind.int]
    assert not views and any(str(n.target).startswith("_folded_view") for n in split.graph.nodes)


def test_compiled_tasks_keep_capture_parameters_until_refreshed(captured):
    plain, compiled, st = captured
    outs = []
    for g, step, x, sl in zip((plain, compiled), st["steps"], st["x"], st["slots"], strict=True):
        # write cache slots 4 and 5, so lengths 6 and 2 read different sums (whatever ran before in this module)
        x.copy_(torch.tensor([1.5, -0.5]).unsqueeze(1).expand(2, 4))
        sl.copy_(torch.tensor([4, 5]))
        step.lens = [6, 6]
        g.refresh_tasks()
        g.replay((x, sl), {})
        six = g.output.clone()
        step.lens = [2, 2]
        g.replay((x, sl), {})  # not refreshed: still lens [6, 6]
        assert torch.equal(g.output, six)
        g.refresh_tasks()
        g.replay((x, sl), {})
        assert not torch.equal(g.output, six)
        outs.append(g.output)
    assert torch.equal(outs[0], outs[1])


def test_a_moved_input_buffer_is_refused_when_compiled(captured):
    _, compiled, st = captured
    x, slots = st["x"][1], st["slots"][1]
    with pytest.raises(GraphInputMovedError, match="static graph input 0 .* moved"):
        compiled.replay((x.clone(), slots), {})


# A custom op that writes an intermediate in place and returns it, as vLLM's vllm::moe_forward(Tensor(a0!)
# hidden_states, ...) -> Tensor(a0!) does (MoE layers): inductor cannot functionalize it.
_LIB = torch.library.Library("npu_twin_test", "DEF")
_LIB.define("scale_(Tensor(a!) x, float s) -> Tensor(a!)")
_LIB.impl("scale_", lambda x, s: x.mul_(s), "CompositeExplicitAutograd")
# ... and one returning a tuple, as vllm::moe_forward_shared(Tensor(a0!) hidden_states, ...) -> (Tensor, Tensor).
_LIB.define("scale_pair(Tensor(a!) x, float s) -> (Tensor, Tensor)")
_LIB.impl("scale_pair", lambda x, s: (x.mul_(s) + 0.0, x * 2.0), "CompositeExplicitAutograd")


def _moe_like_step(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ w) + 1.0
    g = torch.tanh(torch.ops.npu_twin_test.scale_(h, 0.5)) * 2.0
    shared, routed = torch.ops.npu_twin_test.scale_pair(g, 0.25)
    return torch.sigmoid(shared + routed)


def test_a_custom_op_writing_an_intermediate_runs_between_compiled_pieces():
    w = torch.linspace(0.5, 1.5, 16).reshape(4, 4)
    x = torch.linspace(-1.0, 1.0, 8).reshape(2, 4)
    plain = EmulatedGraph.capture(lambda t: _moe_like_step(w, t), (x,), {})
    compiled = EmulatedGraph.capture(lambda t: _moe_like_step(w, t), (x,), {})
    targets = {n.target for n in state_nodes(compiled.module.graph)}
    assert {torch.ops.npu_twin_test.scale_.default, torch.ops.npu_twin_test.scale_pair.default} <= targets
    assert not {torch.ops.aten.mm.default, torch.ops.aten.relu.default, torch.ops.aten.tanh.default} & targets
    compiled.compile()  # failed before: "Found a custom (non-ATen) operator whose output has alias annotations"
    x.copy_(torch.linspace(1.0, -1.0, 8).reshape(2, 4))
    torch.testing.assert_close(compiled.replay((x,), {}), plain.replay((x,), {}))
    torch.testing.assert_close(plain.replay((x,), {}), _moe_like_step(w, x))
    plain.reset()
    compiled.reset()
