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
from vllm_npu.interface import graphs


def _documented() -> dict[str, Any]:
    try:
        return fake_npu_graphs.documented_graph_api()
    except DocsUnavailableError as exc:  # pragma: no cover - offline without a cached wheel
        pytest.skip(str(exc))


@pytest.fixture
def npu(monkeypatch):
    _documented()
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
        graphs.launch(kernel, t, refresh=lambda: {"lens": current["lens"]}, lens=[1, 1], out=out)
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
