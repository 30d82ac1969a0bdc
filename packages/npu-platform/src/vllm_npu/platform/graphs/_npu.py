# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""ACL graphs on the NPU, through torch_npu 2.8.0's documented graph API (``torch_npu/npu/graphs.py``,
``torch_npu/npu/streams.py``):

- capture: ``g = torch.npu.NPUGraph()``; ``with torch.npu.graph(g, pool=pool, stream=stream): out = runnable(...)``;
  the pool is ``torch.npu.graph_pool_handle()`` (one per process, shared by every capture so that smaller graphs
  reuse the memory of larger ones, captured first).
- updatable kernels (:mod:`vllm_npu.interface.graphs`): inside the capture, each is bracketed by
  ``torch.npu.graph_task_group_begin(stream)`` / ``handle = torch.npu.graph_task_group_end(stream)`` after an
  ``ExternalEvent`` wait+reset on the capture stream; only the kernel runs inside the group (its scratch comes from
  the task's ``prepare``, called before the group). Before each replay it is re-issued on the process's update
  stream between ``graph_task_update_begin(stream, handle)`` and ``graph_task_update_end(stream)``, and the event is
  recorded so the replayed graph waits for the update (vllm-ascend's scheme for ``npu_fused_infer_attention_score``
  and ``_npu_paged_attention``, ``compilation/acl_graph.py:197-300``). The update stream first waits for the current
  stream: an update must not rewrite a task that a previous replay of the same graph is still running.
- outputs and task arguments are held as weak references (``torch_npu._C._weak_ref_tensor``, as vllm-ascend's
  ``weak_ref_tensors`` in ``graph_params``): the graph pool owns the capture's memory, so smaller graphs captured
  later reuse it.
- every tensor the graph reads by reference (inputs, the runnable's parameters and buffers, the tasks' tensor
  arguments, e.g. KV caches) is checked against its capture address before every replay (:mod:`._reads`).

None of this can run without an NPU; the wiring is checked against a stand-in that enforces the documented
signatures (``tests/contract``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from vllm_npu.interface import Prepare, Refresh, check_task_result, recording

from . import GraphInputMovedError
from ._reads import CapturedReads, owner, tensor_labels


def _npu() -> Any:
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu  # type: ignore[attr-defined]  # torch_npu adds torch.npu at import; torch's stubs lack it


def _weak_ref(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        import torch_npu

        return torch_npu._C._weak_ref_tensor(x)
    return x


_UPDATE_STREAM: list[Any] = []


def update_stream() -> Any:
    """The stream task updates run on: one per process (vllm-ascend: one per model runner,
    ``worker/model_runner_v1.py:2712``; a worker process has one runner), made on first use."""
    if not _UPDATE_STREAM:
        _UPDATE_STREAM.append(_npu().Stream())
    return _UPDATE_STREAM[0]


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


@dataclass
class _NPUTask:
    kernel: Callable[..., Any]
    args: tuple[Any, ...]  # tensors as weak references
    params: dict[str, Any]  # tensors as weak references
    refresh: Refresh
    prepare: Prepare | None
    handle: Any
    event: Any


class _NPURecorder:
    def __init__(self, reads: CapturedReads) -> None:
        self.tasks: list[_NPUTask] = []
        self.reads = reads

    def record(
        self,
        kernel: Callable[..., Any],
        args: tuple[Any, ...],
        params: dict[str, Any],
        refresh: Refresh,
        prepare: Prepare | None = None,
    ) -> None:
        npu = _npu()
        if prepare is not None:  # the task's scratch, allocated before the group (the capture's pool)
            params = {**params, **prepare(*args, **params)}
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        result = kernel(*args, **params)
        handle = npu.graph_task_group_end(stream)
        check_task_result(kernel, result)
        name = getattr(kernel, "__name__", "task")
        self.reads.add((f"{name} argument", owner(t)) for t in _tensors((args, params)))
        weak_args = tuple(pytree.tree_map(_weak_ref, list(args)))
        weak_params = {k: pytree.tree_map(_weak_ref, v) for k, v in params.items()}
        self.tasks.append(_NPUTask(kernel, weak_args, weak_params, refresh, prepare, handle, event))


@dataclass
class NPUGraph:
    """A captured ACL graph with its updatable tasks."""

    graph: Any
    output: Any
    addresses: list[int]
    tasks: list[_NPUTask] = field(default_factory=list)
    reads: CapturedReads = field(default_factory=lambda: CapturedReads(weak=True))
    replays: int = 0

    @classmethod
    def capture(
        cls, runnable: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], pool: Any, stream: Any
    ) -> NPUGraph:
        npu = _npu()
        graph = npu.NPUGraph()
        reads = CapturedReads(weak=True)
        labels = tensor_labels(runnable)
        if isinstance(runnable, torch.nn.Module):
            reads.add(
                (labels.get(id(t), "module tensor"), t)
                for t in itertools.chain(runnable.parameters(), runnable.buffers())
            )
        recorder = _NPURecorder(reads)
        with npu.graph(graph, pool=pool, stream=stream), recording(recorder):
            output = runnable(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        captured = cls(graph, output, [t.data_ptr() for t in inputs], recorder.tasks, reads)
        # Relabel the task arguments that are known tensors (KV caches...), then drop the capture's intermediates:
        # what died with it, and its outputs (graph-pool memory, weakened by the wrapper).
        reads.labels = [labels.get(id(r()), label) for label, r in zip(reads.labels, reads.refs, strict=True)]
        outputs = {t.untyped_storage().data_ptr() for t in _tensors(output)}
        del output, recorder
        reads.settle(exclude_storages=outputs)
        return captured

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def update_stream(self) -> Any:
        return update_stream() if self.tasks else None

    def weaken_output(self) -> None:
        self.output = pytree.tree_map(_weak_ref, self.output)

    def refresh_tasks(self) -> None:
        """Re-issue every task with this step's host parameters, on the update stream, ordered after the work
        already queued on the current stream (a previous replay of this graph may still read the tasks)."""
        if not self.tasks:
            return
        npu = _npu()
        stream = update_stream()
        stream.wait_stream(npu.current_stream())
        with npu.stream(stream):
            for task in self.tasks:
                task.params.update(task.refresh())
                params = task.params
                if task.prepare is not None:  # fresh scratch for these parameters, outside the update group
                    params = {**params, **task.prepare(*task.args, **params)}
                npu.graph_task_update_begin(stream, task.handle)
                task.kernel(*task.args, **params)
                npu.graph_task_update_end(stream)
                task.event.record(stream)

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
        self.reads.check()
        self.graph.replay()
        self.replays += 1
        return self.output

    def reset(self) -> None:
        self.graph.reset()
        self.tasks = []


def graph_pool_handle() -> Any:
    return _npu().graph_pool_handle()
