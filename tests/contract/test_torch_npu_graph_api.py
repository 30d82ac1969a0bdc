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

import ast
import contextlib
import inspect
import sys
import types
import zipfile
from typing import Any

import pytest
import torch
from npu_testkit.torch_npu_docs import DocsUnavailableError, wheel_path
from vllm_npu.interface import graphs

GRAPHS = "torch_npu/npu/graphs.py"
STREAMS = "torch_npu/npu/streams.py"


def _signature(fn: ast.FunctionDef, drop_self: bool) -> inspect.Signature:
    a = fn.args
    pos = [*a.posonlyargs, *a.args][1 if drop_self else 0 :]
    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    params = [
        inspect.Parameter(
            p.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=inspect.Parameter.empty if d is None else None
        )
        for p, d in zip(pos, defaults, strict=True)
    ]
    return inspect.Signature(params)


def _documented() -> dict[str, inspect.Signature]:
    """``name`` / ``Class.method`` -> signature, from the wheel's graphs.py and streams.py."""
    try:
        wheel = wheel_path()
    except DocsUnavailableError as exc:  # pragma: no cover - offline without a cached wheel
        pytest.skip(str(exc))
    out: dict[str, inspect.Signature] = {}
    with zipfile.ZipFile(wheel) as zf:
        for path in (GRAPHS, STREAMS):
            tree = ast.parse(zf.read(path).decode("utf-8"))
            for node in tree.body:
                if isinstance(node, ast.FunctionDef):
                    out[node.name] = _signature(node, drop_self=False)
                elif isinstance(node, ast.ClassDef):
                    out[node.name] = inspect.Signature()
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef):
                            out[f"{node.name}.{item.name}"] = _signature(item, drop_self=True)
        graphs_src = zf.read(GRAPHS).decode("utf-8")
    assert "_weak_ref_tensor as TensorWeakRef" in graphs_src  # torch_npu._C._weak_ref_tensor exists in 2.8.0
    return out


class _Recorder:
    def __init__(self, docs: dict[str, inspect.Signature]) -> None:
        self.docs = docs
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def check(self, name: str, *args: Any, **kwargs: Any) -> None:
        assert name in self.docs, f"torch.npu.{name} is not in torch_npu 2.8.0's graphs.py/streams.py"
        bound = self.docs[name].bind(*args, **kwargs)  # raises TypeError on a call outside the signature
        self.calls.append((name, dict(bound.arguments)))


def _fake_npu(rec: _Recorder) -> types.SimpleNamespace:
    class Stream:
        pass

    current = Stream()

    class NPUGraph:
        def __init__(self) -> None:
            rec.check("NPUGraph.__init__")

        def replay(self) -> None:
            rec.check("NPUGraph.replay")

        def reset(self) -> None:
            rec.check("NPUGraph.reset")

    @contextlib.contextmanager
    def graph(*args: Any, **kwargs: Any):
        rec.check("graph.__init__", *args, **kwargs)
        yield

    class ExternalEvent:
        def __init__(self) -> None:
            rec.check("ExternalEvent.__new__")

        def record(self, *a: Any, **k: Any) -> None:
            rec.check("ExternalEvent.record", *a, **k)

        def wait(self, *a: Any, **k: Any) -> None:
            rec.check("ExternalEvent.wait", *a, **k)

        def reset(self, *a: Any, **k: Any) -> None:
            rec.check("ExternalEvent.reset", *a, **k)

    @contextlib.contextmanager
    def stream(s: Any):
        yield

    def fn(name: str):
        def call(*a: Any, **k: Any) -> Any:
            rec.check(name, *a, **k)
            return f"handle-{len(rec.calls)}" if name == "graph_task_group_end" else None

        return call

    return types.SimpleNamespace(
        NPUGraph=NPUGraph,
        graph=graph,
        ExternalEvent=ExternalEvent,
        Stream=Stream,
        stream=stream,
        current_stream=lambda device=None: current,
        graph_pool_handle=fn("graph_pool_handle"),
        graph_task_group_begin=fn("graph_task_group_begin"),
        graph_task_group_end=fn("graph_task_group_end"),
        graph_task_update_begin=fn("graph_task_update_begin"),
        graph_task_update_end=fn("graph_task_update_end"),
    )


@pytest.fixture
def npu(monkeypatch):
    rec = _Recorder(_documented())
    fake_torch_npu = types.ModuleType("torch_npu")
    fake_torch_npu._C = types.SimpleNamespace(_weak_ref_tensor=lambda t: t)
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu)
    monkeypatch.setattr(torch, "npu", _fake_npu(rec), raising=False)
    return rec


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
    ):
        assert name in docs, name
    assert list(docs["graph.__init__"].parameters)[:2] == ["npu_graph", "pool"]
    assert list(docs["graph_task_update_begin"].parameters) == ["stream", "handle"]


def test_capture_task_update_and_replay_follow_the_documented_api(npu):
    from vllm_npu.platform.graphs._npu import NPUGraph, graph_pool_handle

    def kernel(q: torch.Tensor, *, lens: list[int], out: torch.Tensor) -> None:
        out.copy_(q * len(lens))

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
    assert names == ["graph_task_update_begin", "graph_task_update_end", "ExternalEvent.record", "NPUGraph.replay"]
    assert npu.calls[0][1]["handle"] == g.tasks[0].handle and g.tasks[0].params["lens"] == [7, 8, 9]
    assert torch.equal(out, torch.full((2,), 3.0))  # the kernel was re-issued with the new parameters
