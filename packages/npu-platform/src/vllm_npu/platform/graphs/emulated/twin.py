# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The emulated device's static graphs: capture traces the runnable into an FX graph of aten ops, replay runs that
graph on the captured input buffers and writes the result into the captured output.

What this keeps from a real ACL/CUDA graph, on purpose (it is what makes graph mode hard):

- Everything the host computed while capturing is frozen. Shapes and slice bounds are constants of the graph;
  Python values (``.tolist()`` results, lists handed to kernels, branch decisions on metadata) were consumed by the
  tracer and never run again; tensors the runnable reached through Python state (attention metadata, weights, KV
  caches) are captured *by reference*, so in-place updates of persistent buffers are seen and freshly built tensors
  are not. A step whose metadata was not routed into the graph's buffers computes with capture-time values.
- Reading device values on the host while capturing (``.item()``, ``.tolist()`` of a traced tensor) fails, as a
  host sync during an NPU capture does.
- Input buffers must keep their addresses: replaying with a tensor argument at another address raises
  :class:`GraphInputMovedError`; so does replaying after any tensor the graph captured by reference (weights,
  buffers, KV caches: the traced module's constants) moved, e.g. its storage resized to 0 and back (sleep mode), or
  ``p.data`` rebound (:mod:`._reads`). The twin would compute with the new storage; an NPU graph would not.
- A task (:func:`vllm_npu.interface.graphs.launch`) returns None and writes only into its tensor arguments: the
  task node is opaque and declares those as its only mutations, so a result returned, or written anywhere else,
  would be lost at replay. The twin checks the return value at every run; that the NPU kernel allocates nothing
  inside the task group is checked where the NPU kernels run, against the stand-in torch_npu
  (:mod:`npu_testkit.fake_npu_graphs`): here the task's kernel is the reference twin, whose internal temporaries
  stand for the NPU kernel's own workspace.
- Replay writes into the tensors returned at capture (their addresses stay fixed, as graph-pool outputs do).
- Updatable kernels (:mod:`vllm_npu.interface.graphs`) become opaque ``vllm_npu_graph::task`` nodes whose host
  parameters are those of the capture until the runtime refreshes them.

Attention ops that vLLM registers as opaque custom ops (``vllm.unified_attention_with_output``...) are traced
*through* (their Python implementation is the decomposition), so the attention backend's host logic is frozen too.
Other custom ops (MoE dispatch, collectives) stay opaque nodes, like kernels.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree
from vllm_npu.interface import Prepare, Refresh, check_task_result, recording

from .. import GraphInputMovedError
from .._reads import CapturedReads, tensor_labels

if TYPE_CHECKING:
    from ..compile_cache import CompileCache


@dataclass
class _Task:
    """One captured updatable kernel: its callable, argument structure with tensor holes, and host parameters."""

    kernel: Callable[..., Any]
    spec: pytree.TreeSpec
    leaves: list[Any]  # non-tensor leaves; tensors are None holes filled at run time
    params: dict[str, Any]
    refresh: Refresh
    prepare: Prepare | None = None

    # Fast path, when every positional argument is a leaf (no tensor inside a list...): the positional arguments
    # with None holes, and the names of the tensor keyword arguments (they follow the positional tensors).
    flat_args: list[Any] | None = None
    tensor_names: tuple[str, ...] = ()

    def run(self, tensors: list[torch.Tensor]) -> None:
        """Run the kernel on ``tensors``; its ``prepare`` (scratch for these parameters) first, as the NPU runtime
        calls it before each update (no task group to stay out of here)."""
        it = iter(tensors)
        if self.flat_args is not None:
            args = [next(it) if a is None else a for a in self.flat_args]
            kwargs = dict(zip(self.tensor_names, it, strict=True))
        else:
            leaves = [next(it) if leaf is None else leaf for leaf in self.leaves]
            args_, kwargs = pytree.tree_unflatten(leaves, self.spec)
            args = list(args_)
        params = {**kwargs, **self.params}
        if self.prepare is not None:
            params.update(self.prepare(*args, **params))
        check_task_result(self.kernel, self.kernel(*args, **params))


_TASKS: dict[int, _Task] = {}  # registry: task id -> task, owned by the EmulatedGraph that captured it
_task_ids = itertools.count()


def run_task(task_id: int, tensors: list[torch.Tensor]) -> None:
    """Run captured task ``task_id`` on ``tensors`` (its tensor arguments, in capture order)."""
    _TASKS[task_id].run(list(tensors))


@torch.library.custom_op("vllm_npu_graph::task", mutates_args=("tensors",))
def _run_task(task_id: int, tensors: list[torch.Tensor]) -> None:
    run_task(task_id, tensors)


def _is_leaf(value: Any) -> bool:
    leaves = pytree.tree_leaves(value)
    return len(leaves) == 1 and leaves[0] is value


class _TwinRecorder:
    """Records :func:`vllm_npu.interface.graphs.launch` calls during a trace as ``vllm_npu_graph::task`` nodes."""

    def __init__(self) -> None:
        self.task_ids: list[int] = []

    def record(
        self,
        kernel: Callable[..., Any],
        args: tuple[Any, ...],
        params: dict[str, Any],
        refresh: Refresh,
        prepare: Prepare | None = None,
    ) -> None:
        tensor_kwargs = {k: v for k, v in params.items() if isinstance(v, torch.Tensor)}
        host_params = {k: v for k, v in params.items() if k not in tensor_kwargs}
        leaves, spec = pytree.tree_flatten((args, tensor_kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        holes = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        task_id = next(_task_ids)
        task = _TASKS[task_id] = _Task(kernel, spec, holes, host_params, refresh, prepare)
        if all(_is_leaf(a) for a in args):
            task.flat_args = [None if isinstance(a, torch.Tensor) else a for a in args]
            task.tensor_names = tuple(tensor_kwargs)
        self.task_ids.append(task_id)
        torch.ops.vllm_npu_graph.task(task_id, tensors)


def _attention_decompositions() -> dict[Any, Callable[..., Any]]:
    """vLLM's attention custom ops -> their Python implementations, so tracing enters the attention backend."""
    from vllm.attention import layer

    table: dict[Any, Callable[..., Any]] = {}
    for name in ("unified_attention", "unified_attention_with_output"):
        op = getattr(torch.ops.vllm, name, None)
        if op is not None:
            table[op.default] = getattr(layer, name)
    gdn = getattr(torch.ops.vllm, "gdn_attention", None)
    if gdn is not None:
        table[gdn.default] = _gdn_attention
    return table


def _gdn_attention(hidden_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    """The body of vLLM 0.11's ``vllm.gdn_attention`` op (``models/qwen3_next.py``; npu-models registers the same
    one where vLLM's module cannot be imported): the gated delta-net layer's ``_forward``, so that a capture traces
    the layer's state reads and writes (by slot) instead of freezing an opaque call."""
    from vllm.forward_context import get_forward_context

    get_forward_context().no_compile_layers[layer_name]._forward(hidden_states=hidden_states, output=output)


@contextlib.contextmanager
def _plain_parameters(runnable: Any) -> Iterator[None]:
    """While tracing, the runnable's parameters of tensor subclasses (vLLM's ``ModelWeightParameter``...) are plain
    ``nn.Parameter``s: the tracer refuses tensor subclasses it does not know, and these add only weight-loading
    metadata. The graph holds the same tensor objects, whose classes are restored afterwards."""
    swapped: list[tuple[torch.Tensor, type]] = []
    if isinstance(runnable, torch.nn.Module):
        for t in itertools.chain(runnable.parameters(), runnable.buffers()):
            if type(t) not in (torch.Tensor, torch.nn.Parameter):
                swapped.append((t, type(t)))
                t.__class__ = torch.nn.Parameter if isinstance(t, torch.nn.Parameter) else torch.Tensor
    try:
        yield
    finally:
        for t, cls in swapped:
            t.__class__ = cls


_HOST_READS = ("tolist", "numpy")


@contextlib.contextmanager
def _no_host_reads_of_traced_tensors() -> Iterator[None]:
    """While tracing: ``.tolist()`` / ``.numpy()`` of a tensor the graph computes or reads (one the tracer tracks)
    fail, as a device-to-host read fails in an ACL capture (``capture_error_mode`` "global", torch_npu
    ``npu/graphs.py:204-209``). The tracer already refuses ``.item()``, ``bool()``, ``int()``
    (``aten._local_scalar_dense``), but these two read the data without dispatching an op, so they would silently
    freeze the capture's values. A host tensor of Python state that no traced op touched is not tracked: reading it
    is host work, frozen at capture like every host value."""
    from torch.fx.experimental import proxy_tensor

    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def guarded(name: str) -> Callable[..., Any]:
        original = originals[name]

        def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            mode = proxy_tensor.get_proxy_mode()
            if mode is not None and proxy_tensor.get_proxy_slot(self, mode.tracer, None) is not None:
                raise RuntimeError(
                    f"Tensor.{name}() of a tensor the captured graph computes or reads: a host read while capturing "
                    "(an NPU graph capture refuses it; read host copies prepared before the capture instead)"
                )
            return original(self, *args, **kwargs)

        return call

    for name in _HOST_READS:
        setattr(torch.Tensor, name, guarded(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


@contextlib.contextmanager
def one_meta_mode() -> Iterator[None]:
    """One fake-tensor mode for the metadata of every traced node. A real-mode ``make_fx`` records each node's value
    as a fake tensor (``node.meta["val"]``) and, with no fake mode in reach, makes a new ``FakeTensorMode`` per node
    (torch 2.8's ``proxy_tensor.extract_val``), whose constructor records the Python stack: on the demo model ~40 %
    of a capture's trace, at every engine start and capture size. A tracing context holding one mode is where
    ``extract_val`` looks first (``torch._guards.detect_fake_mode``); the metadata is the same (shape, stride,
    dtype, device of each value)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
        yield


def _tensor_positions(flat: list[Any]) -> list[int]:
    return [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]


@dataclass
class EmulatedGraph:
    """A captured static graph of the emulated device (see the module docstring)."""

    module: torch.fx.GraphModule
    spec: pytree.TreeSpec
    flat: list[Any]  # capture-time leaves of (args, kwargs); tensors at `positions`
    positions: list[int]
    addresses: list[int]
    output: Any
    task_ids: list[int] = field(default_factory=list)
    replays: int = 0
    # after compile(): the traced graph with its pure pieces compiled by inductor, run instead of `module`
    compiled: Callable[..., Any] | None = None
    # (positional count, keyword names, which are None) when every argument at capture was a tensor or None
    plain: tuple[int, tuple[str, ...], tuple[bool, ...]] | None = None
    # the tensors the graph captured by reference (the traced module's constants) and their capture addresses
    reads: CapturedReads = field(default_factory=lambda: CapturedReads(weak=False))

    @classmethod
    def capture(cls, runnable: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> EmulatedGraph:
        flat, spec = pytree.tree_flatten((args, kwargs))
        positions = _tensor_positions(flat)

        def traced(*tensors: torch.Tensor) -> Any:
            leaves = list(flat)
            for i, t in zip(positions, tensors, strict=True):
                leaves[i] = t
            a, k = pytree.tree_unflatten(leaves, spec)
            return runnable(*a, **k)

        inputs = [flat[i] for i in positions]
        recorder = _TwinRecorder()
        with (
            recording(recorder),
            _plain_parameters(runnable),
            _no_host_reads_of_traced_tensors(),
            one_meta_mode(),
        ):
            module = make_fx(traced, decomposition_table=_attention_decompositions(), tracing_mode="real")(*inputs)
        graph = cls(module, spec, flat, positions, [t.data_ptr() for t in inputs], None, recorder.task_ids)
        labels = tensor_labels(runnable)
        graph.reads.add(
            (labels.get(id(t), f"captured tensor {name!r} {tuple(t.shape)}"), t)
            for name, t in itertools.chain(module.named_parameters(), module.named_buffers())
        )
        values = (*args, *kwargs.values())
        if all(v is None or isinstance(v, torch.Tensor) for v in values):
            graph.plain = (len(args), tuple(kwargs), tuple(v is None for v in values))
        # The trace ran the step once with tracer tensors; this run produces the real output buffers.
        graph.output = module(*inputs)
        return graph

    def compile(self, cache: CompileCache | None = None) -> None:
        """Compile the graph's pure pieces with inductor (``npu.emulated_compile=inductor``; see
        :mod:`.twin_compile`), with the on-disk cache ``cache`` (None: none). Runs one step on the captured
        buffers, as the capture did."""
        from .twin_compile import compile_graph

        inputs = [self.flat[i] for i in self.positions]
        self.compiled = compile_graph(self.module, inputs, cache)

    @property
    def num_tasks(self) -> int:
        return len(self.task_ids)

    def refresh_tasks(self) -> None:
        """Re-issue every task with the host parameters its ``refresh`` returns for the current step."""
        for task_id in self.task_ids:
            task = _TASKS[task_id]
            task.params.update(task.refresh())

    def inputs_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensor arguments of a replay, checked against the capture (same structure, same addresses)."""
        inputs = self._plain_inputs(args, kwargs)
        if inputs is None:
            flat, spec = pytree.tree_flatten((args, kwargs))
            if spec != self.spec:
                raise GraphInputMovedError(
                    f"graph replayed with differently structured arguments: {spec} vs {self.spec}"
                )
            tensors = _tensor_positions(flat)
            if tensors != self.positions:  # a tensor where the capture had a constant (None...), or the reverse
                raise GraphInputMovedError(
                    f"graph replayed with tensors at argument leaves {tensors}, captured with {self.positions}"
                )
            inputs = [flat[i] for i in self.positions]
        for n, (t, addr) in enumerate(zip(inputs, self.addresses, strict=True)):
            if not isinstance(t, torch.Tensor) or t.data_ptr() != addr:
                got = f"{t.data_ptr():#x}" if isinstance(t, torch.Tensor) else type(t).__name__
                what = f" ({type(t).__name__} {tuple(t.shape)})" if isinstance(t, torch.Tensor) else ""
                raise GraphInputMovedError(
                    f"static graph input {n}{what} moved: captured at {addr:#x}, replayed with {got}; a captured "
                    "graph reads its input buffers by address, so the caller must copy new inputs into the captured "
                    "buffers (a weight moved by sleep mode's wake-up: capture the graphs again)"
                )
        return inputs

    def _plain_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor] | None:
        """The tensors of a call whose arguments are each a tensor or None (the model runner's), when they are laid
        out as at capture; None otherwise (the caller then compares pytree specs). Same result as flattening, at
        a fraction of pytree's per-step cost."""
        values = (*args, *kwargs.values())
        if self.plain is None or self.plain != (len(args), tuple(kwargs), tuple(v is None for v in values)):
            return None
        return [v for v in values if v is not None]

    def replay(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the graph on the captured buffers; the result lands in (and is) the capture-time output."""
        inputs = self.inputs_of(args, kwargs)
        self.reads.check()
        result = (self.compiled or self.module)(*inputs)
        if isinstance(result, torch.Tensor) and isinstance(self.output, torch.Tensor):  # the model's one output
            if result is not self.output:
                self.output.copy_(result)
        else:
            for dst, src in zip(pytree.tree_leaves(self.output), pytree.tree_leaves(result), strict=True):
                if isinstance(dst, torch.Tensor) and dst is not src:
                    dst.copy_(src)
        self.replays += 1
        return self.output

    def reset(self) -> None:
        for task_id in self.task_ids:
            _TASKS.pop(task_id, None)
        self.task_ids = []
