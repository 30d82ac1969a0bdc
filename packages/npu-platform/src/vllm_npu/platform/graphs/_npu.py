# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""ACL graphs on the NPU, through torch_npu 2.8.0's documented graph API (``torch_npu/npu/graphs.py``,
``torch_npu/npu/streams.py``):

- capture: ``g = torch.npu.NPUGraph()``; ``with torch.npu.graph(g, pool=pool, stream=stream): out = runnable(...)``;
  the pool is ``torch.npu.graph_pool_handle()`` (one per process, shared by every capture so that smaller graphs
  reuse the memory of larger ones, captured first).
- updatable kernels (:mod:`vllm_npu.interface.graphs`): inside the capture, each is bracketed by
  ``torch.npu.graph_task_group_begin(stream)`` / ``handle = torch.npu.graph_task_group_end(stream)`` after an
  ``ExternalEvent`` wait+reset on the capture stream; before each replay it is re-issued on a side stream between
  ``graph_task_update_begin(stream, handle)`` and ``graph_task_update_end(stream)``, and the event is recorded so
  the replayed graph waits for the update (vllm-ascend's scheme for ``npu_fused_infer_attention_score`` and
  ``_npu_paged_attention``).
- outputs are held as weak references (``torch_npu._C._weak_ref_tensor``) as vLLM's CUDA wrapper does: the graph
  pool owns their memory.

None of this can run without an NPU; the wiring is checked against a stand-in that enforces the documented
signatures (``tests/contract``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from vllm_npu.interface.graphs import Refresh, recording

from . import GraphInputMovedError


def _npu() -> Any:
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu  # type: ignore[attr-defined]  # torch_npu adds torch.npu at import; torch's stubs lack it


def _weak_ref(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        import torch_npu

        return torch_npu._C._weak_ref_tensor(x)
    return x


@dataclass
class _NPUTask:
    kernel: Callable[..., Any]
    args: tuple[Any, ...]
    params: dict[str, Any]
    refresh: Refresh
    handle: Any
    event: Any


class _NPURecorder:
    def __init__(self) -> None:
        self.tasks: list[_NPUTask] = []

    def record(
        self, kernel: Callable[..., Any], args: tuple[Any, ...], params: dict[str, Any], refresh: Refresh
    ) -> Any:
        npu = _npu()
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        result = kernel(*args, **params)
        handle = npu.graph_task_group_end(stream)
        self.tasks.append(_NPUTask(kernel, args, dict(params), refresh, handle, event))
        return result


@dataclass
class NPUGraph:
    """A captured ACL graph with its updatable tasks."""

    graph: Any
    output: Any
    addresses: list[int]
    tasks: list[_NPUTask] = field(default_factory=list)
    update_stream: Any = None
    replays: int = 0

    @classmethod
    def capture(
        cls, runnable: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], pool: Any, stream: Any
    ) -> NPUGraph:
        npu = _npu()
        graph = npu.NPUGraph()
        recorder = _NPURecorder()
        with npu.graph(graph, pool=pool, stream=stream), recording(recorder):
            output = runnable(*args, **kwargs)
        inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        captured = cls(graph, output, [t.data_ptr() for t in inputs], recorder.tasks)
        if recorder.tasks:
            captured.update_stream = npu.Stream()
        return captured

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def weaken_output(self) -> None:
        self.output = pytree.tree_map(_weak_ref, self.output)

    def refresh_tasks(self) -> None:
        if not self.tasks:
            return
        npu = _npu()
        with npu.stream(self.update_stream):
            for task in self.tasks:
                task.params.update(task.refresh())
                npu.graph_task_update_begin(self.update_stream, task.handle)
                task.kernel(*task.args, **task.params)
                npu.graph_task_update_end(self.update_stream)
                task.event.record(self.update_stream)

    def inputs_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        addresses = [t.data_ptr() for t in inputs]
        if addresses != self.addresses:
            raise GraphInputMovedError(
                f"ACL graph input addresses changed between capture and replay ({self.addresses} -> {addresses}); "
                "the caller must copy new inputs into the captured buffers"
            )
        return inputs

    def replay(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.inputs_of(args, kwargs)
        self.graph.replay()
        self.replays += 1
        return self.output

    def reset(self) -> None:
        self.graph.reset()
        self.tasks = []


def graph_pool_handle() -> Any:
    return _npu().graph_pool_handle()
