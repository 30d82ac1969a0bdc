# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The NPU graph runtime (vllm_npu.platform.graphs._npu) against torch_npu 2.8.0's graph API, read from the wheel.

``torch_npu/npu/graphs.py`` and ``streams.py`` are parsed (never imported): every name our code calls must exist
there, and a stand-in ``torch.npu`` built from those parsed signatures binds each call (wrong or missing arguments
fail as they would on an NPU). The capture and the per-step task update are then run against the stand-in, and the
recorded call sequence must follow vllm-ascend's scheme: ``graph(npu_graph, pool=...)`` around the runnable; an
``ExternalEvent`` wait/reset, then ``graph_task_group_begin/end`` around each updatable kernel; before replay, on a
side stream, ``graph_task_update_begin(stream, handle)``, the kernel with the new parameters,
``graph_task_update_end(stream)``, ``event.record(stream)``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from npu_testkit import fake_npu_graphs
from npu_testkit.torch_npu_docs import DocsUnavailableError
from vllm_npu.interface import launch


def _documented() -> dict[str, Any]:
    try:
        return fake_npu_graphs.documented_graph_api()
    except DocsUnavailableError as exc:  # pragma: no cover - offline without a cached wheel
        pytest.skip(str(exc))


@pytest.fixture
def npu(monkeypatch):
    from vllm_npu.platform.graphs import _npu

    _documented()
    monkeypatch.setattr(_npu, "_UPDATE_STREAM", [], raising=False)  # the process's update stream, made on the stand-in
    return fake_npu_graphs.install(monkeypatch)


def test_every_graph_api_name_we_call_is_documented():
    docs = _documented()
    for name in (
        "NPUGraph.replay",
        "NPUGraph.reset",
        "graph.__init__",
        "graph_pool_handle",
        "graph_task_group_begin",
        "graph_task_group_end",
        "graph_task_update_begin",
        "graph_task_update_end",
        "ExternalEvent.record",
        "ExternalEvent.wait",
        "ExternalEvent.reset",
        "Stream.wait_stream",
    ):
        assert name in docs, name
    assert list(docs["graph.__init__"].parameters)[:2] == ["npu_graph", "pool"]
    assert list(docs["graph_task_update_begin"].parameters) == ["stream", "handle"]


def test_capture_task_update_and_replay_follow_the_documented_api(npu):
    from vllm_npu.platform.graphs._npu import NPUGraph, graph_pool_handle

    def kernel(q: torch.Tensor, *, lens: list[int], out: torch.Tensor) -> None:
        torch.mul(q, len(lens), out=out)  # only the out= kernel inside the task group

    q, out = torch.ones(2), torch.empty(2)
    current = {"lens": [1, 1]}

    def step(t: torch.Tensor) -> torch.Tensor:
        launch(kernel, t, refresh=lambda: {"lens": current["lens"]}, lens=[1, 1], out=out)
        return out

    pool = graph_pool_handle()
    g = NPUGraph.capture(step, (q,), {}, pool, None)
    names = [name for name, _ in npu.calls]
    assert names == [
        "graph_pool_handle",
        "NPUGraph.__init__",
        "graph.__init__",
        "ExternalEvent.__new__",
        "ExternalEvent.wait",
        "ExternalEvent.reset",
        "graph_task_group_begin",
        "graph_task_group_end",
    ]
    assert "pool" in npu.calls[2][1] and g.num_tasks == 1
    npu.calls.clear()
    current["lens"] = [7, 8, 9]
    g.refresh_tasks()
    g.replay((q,), {})
    names = [name for name, _ in npu.calls]
    assert names == [
        "Stream.wait_stream",
        "graph_task_update_begin",
        "graph_task_update_end",
        "ExternalEvent.record",
        "NPUGraph.replay",
    ]
    assert npu.calls[1][1]["handle"] == g.tasks[0].handle and g.tasks[0].params["lens"] == [7, 8, 9]
    assert torch.equal(out, torch.full((2,), 3.0))  # the kernel was re-issued with the new parameters


# --- the runtime rules (issue 28): each test fails against the graph runtime that broke the rule -------------------


def _task_kernel(q: torch.Tensor, cache: torch.Tensor, *, lens: list[int], out: torch.Tensor, workspace=None) -> None:
    torch.add(q, cache[: q.shape[0]], alpha=len(lens), out=out)


class _Model(torch.nn.Module):
    """A full-graph runnable: a weight, a KV cache reached through Python state, one updatable task."""

    def __init__(self, prepare: bool = False) -> None:
        super().__init__()
        self.use_prepare = prepare
        self.weight = torch.nn.Parameter(torch.ones(4), requires_grad=False)
        self.kv_cache = torch.zeros(8)
        self.lens = [1, 1]
        self.prepared: list[list[int]] = []

    def prepare(self, q, cache, *, lens, out, workspace=None):
        self.prepared.append(list(lens))
        return {"workspace": torch.empty(len(lens))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x * self.weight
        out = torch.empty_like(q)
        scratch = {"prepare": self.prepare} if self.use_prepare else {}
        launch(
            _task_kernel, q, self.kv_cache[:4], refresh=lambda: {"lens": self.lens}, lens=self.lens, out=out,
            **scratch,
        )  # fmt: skip
        return out + 1


def test_task_arguments_are_weak_references_and_nothing_keeps_them_alive(npu):
    """torch_npu's own graph dispatch (graphs.py:120-134) and vllm-ascend's graph_params keep TensorWeakRefs of a
    task's tensors, so the graph pool owns them and smaller graphs captured later reuse the memory."""
    import gc
    import weakref

    from vllm_npu.platform.graphs._npu import NPUGraph

    model, x = _Model(), torch.ones(4)
    alive: list[weakref.ref] = []
    original = launch

    def spy(kernel, *args, **kw):
        alive.extend(weakref.ref(t) for t in (*args, kw["out"]) if isinstance(t, torch.Tensor))
        return original(kernel, *args, **kw)

    with pytest.MonkeyPatch.context() as m:
        m.setitem(globals(), "launch", spy)  # _Model.forward calls this module's launch
        g = NPUGraph.capture(model, (x,), {}, None, None)
    g.weaken_output()
    gc.collect()
    task = g.tasks[0]
    held = [t for t in pytree_leaves((task.args, task.params)) if isinstance(t, torch.Tensor)]
    assert held and not any(t is r() for t in held for r in alive)
    # q, the KV-cache view and out were intermediates of the capture: nothing of ours keeps them
    assert [r() is None for r in alive] == [True, True, True]


def pytree_leaves(tree):
    from torch.utils import _pytree

    return _pytree.tree_leaves(tree)


def test_one_update_stream_per_process_ordered_after_the_current_stream(npu):
    from vllm_npu.platform.graphs._npu import NPUGraph

    a = NPUGraph.capture(_Model(), (torch.ones(4),), {}, None, None)
    b = NPUGraph.capture(_Model(), (torch.ones(4),), {}, None, None)
    assert a.update_stream is b.update_stream is not None
    npu.calls.clear()
    b.refresh_tasks()
    name, bound = npu.calls[0]
    assert name == "Stream.wait_stream" and bound["stream"] is torch.npu.current_stream()
    assert npu.calls[1][0] == "graph_task_update_begin" and npu.calls[1][1]["stream"] is a.update_stream


def test_prepare_runs_outside_the_task_group_at_capture_and_before_every_update(npu):
    from vllm_npu.platform.graphs._npu import NPUGraph

    model = _Model(prepare=True)
    g = NPUGraph.capture(model, (torch.ones(4),), {}, None, None)
    assert model.prepared == [[1, 1]]
    model.lens = [3, 4, 5]
    g.refresh_tasks()  # the workspace allocation would fail inside the update group (the stand-in's rule)
    assert model.prepared == [[1, 1], [3, 4, 5]]


def test_an_allocation_inside_a_task_group_fails_the_capture(npu):
    from npu_testkit.fake_npu_graphs import CaptureRuleError
    from vllm_npu.platform.graphs._npu import NPUGraph

    def allocating(q: torch.Tensor, *, lens: list[int], out: torch.Tensor) -> None:
        out.copy_(q * len(lens))  # q * n allocates inside the group

    def step(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        launch(allocating, x, refresh=lambda: {}, lens=[1], out=out)
        return out

    with pytest.raises(CaptureRuleError, match=r"aten.mul.Tensor allocates a tensor inside a graph task group"):
        NPUGraph.capture(step, (torch.ones(2),), {}, None, None)


@pytest.mark.parametrize("read", ["item", "tolist", "bool", "cpu"])
def test_a_host_read_fails_the_capture(npu, read):
    from npu_testkit.fake_npu_graphs import CaptureRuleError
    from vllm_npu.platform.graphs._npu import NPUGraph

    def step(x: torch.Tensor) -> torch.Tensor:
        s = x.sum()
        value = {"item": lambda: s.item(), "tolist": lambda: x.tolist(), "bool": lambda: bool(s), "cpu": x.cpu}[read]()
        return x * (1 if value is None else 2)

    with pytest.raises(CaptureRuleError, match="host read"):
        NPUGraph.capture(step, (torch.ones(2),), {}, None, None)


@pytest.mark.parametrize("move", ["resize", "rebind"])
@pytest.mark.parametrize("what", ["weight", "kv_cache"])
def test_a_replay_after_a_captured_tensor_moved_fails_naming_it(npu, move, what):
    """Sleep mode's storage resize_(0) / resize_(n) (or rebinding .data) moves a tensor the graph holds by address."""
    from vllm_npu.platform.graphs import GraphInputMovedError
    from vllm_npu.platform.graphs._npu import NPUGraph

    model, x = _Model(), torch.ones(4)
    g = NPUGraph.capture(model, (x,), {}, None, None)
    g.weaken_output()
    g.replay((x,), {})  # in place: fine
    t = getattr(model, what)
    if move == "resize":
        n = t.untyped_storage().nbytes()
        t.untyped_storage().resize_(0)
        t.untyped_storage().resize_(n)
    else:
        t.data = t.data.clone()
    label = "parameter 'weight'" if what == "weight" else "_task_kernel argument"
    with pytest.raises(GraphInputMovedError, match=label):
        g.replay((x,), {})
