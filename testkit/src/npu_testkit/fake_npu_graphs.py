# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A stand-in ``torch.npu`` graph runtime for NPU-wiring tests: torch_npu 2.8.0's graph and stream API, read from
the wheel, enforcing the runtime rules an ACL graph imposes (the same rules the emulated device's graph twin
enforces, ``vllm_npu.platform.graphs.emulated.twin``).

Every call binds against the signature parsed from the wheel's ``torch_npu/npu/graphs.py`` / ``streams.py`` (never
imported) and is recorded. On top, while capturing:

- **host reads fail** (rule 8): inside ``torch.npu.graph(...)``, ``.item()``, ``bool()``, ``int()``, ``float()``
  (``aten._local_scalar_dense``), ``.tolist()``, ``.cpu()`` and ``.numpy()`` of a tensor raise
  :class:`CaptureRuleError`. Source: a capture runs with ``aclmdlRICaptureMode`` "global" by default
  (``torch_npu/npu/graphs.py:204-209``): synchronising or copying device memory to the host while a stream captures
  is refused; vLLM's CUDA wrapper has the same rule. In the stand-in every tensor is a device tensor (tests build
  host lists before the capture).
- **allocations inside a task group fail** (rule 7): between ``graph_task_group_begin`` and
  ``graph_task_group_end`` (and between ``graph_task_update_begin`` and ``graph_task_update_end``) any aten op that
  makes a new tensor (anything but a view or an in-place / ``out=`` op writing into given tensors) raises with the
  op's name, and so does a stand-in torch_npu op (:func:`npu_testkit.npu_binding_rules.documented`) that is not
  given its outputs (``out=``, in-place ops) or that returns a workspace. Source: torch_npu's own graph dispatch
  (``graphs.py:137-160``) allocates the FIA output, softmax LSE and ``get_max_workspace`` *before*
  ``graph_task_group_begin`` and puts only ``npu_fused_infer_attention_score.out`` inside; an update re-issues the
  group's kernel alone (``graphs.py:104-118``), so memory allocated inside would be re-allocated and freed at every
  update while the graph keeps the capture's address. The fake kernels' own bodies are exempt (they stand for the
  kernel).
- **captured tensors must stay in place** (rule 6): every tensor an op reads during the capture that the capture did
  not create (weights, KV caches, inputs) is remembered with its address; ``NPUGraph.replay()`` raises
  :class:`CaptureRuleError` naming the op that read a tensor that moved or was freed since. Source:
  ``NPUGraph.replay`` (``graphs.py:223-225``) relaunches the captured work on the captured addresses.

``torch_npu._C._weak_ref_tensor`` is ``detach()`` here (a new tensor object sharing the storage; on a CPU a
non-owning tensor cannot be made): tests check that the runtime keeps no *original* tensor object alive.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import types
import weakref
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from npu_testkit.torch_npu_docs import wheel_path

GRAPHS = "torch_npu/npu/graphs.py"
STREAMS = "torch_npu/npu/streams.py"


class CaptureRuleError(RuntimeError):
    """A rule of ACL graph capture/replay broken (see the module docstring)."""


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


def documented_graph_api() -> dict[str, inspect.Signature]:
    """``name`` / ``Class.method`` -> signature, from the wheel's graphs.py and streams.py (raises
    :class:`~npu_testkit.torch_npu_docs.DocsUnavailableError` offline without a cached wheel)."""
    out: dict[str, inspect.Signature] = {}
    with zipfile.ZipFile(wheel_path()) as zf:
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


# --- the capture state the rules read -----------------------------------------------------------------------------


class _State:
    capturing: _CaptureMode | None = None
    update_mode: _UpdateMode | None = None
    group: str | None = None  # "group" / "update" while inside a task group or a task update
    kernel_depth = 0  # > 0 while a stand-in torch_npu op's body runs (exempt: it stands for the kernel)


STATE = _State()


def in_task_group() -> str | None:
    """``"group"`` / ``"update"`` inside a task group or update (outside a fake kernel's body), else None."""
    return STATE.group if STATE.kernel_depth == 0 else None


@contextlib.contextmanager
def kernel_body() -> Iterator[None]:
    """Around a stand-in torch_npu op's body: its temporaries stand for the kernel's own memory."""
    STATE.kernel_depth += 1
    try:
        yield
    finally:
        STATE.kernel_depth -= 1


_HOST_READ_METHODS = ("tolist", "cpu", "numpy")


def _aliases_an_input(func: Any) -> bool:
    """A view or an in-place / out= op: every output aliases an input in the schema."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None for r in returns)


class _CaptureMode(TorchDispatchMode):
    """Active while ``torch.npu.graph(...)`` captures: host reads fail; inside task groups, allocations fail; every
    tensor read that the capture did not make is remembered with its address."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()  # storages the capture created
        self.reads: list[tuple[str, Any, int]] = []  # (op, weakref to the tensor, address at capture)
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types_: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        if func is torch.ops.aten._local_scalar_dense.default and STATE.kernel_depth == 0:
            raise CaptureRuleError(f"{name}: a host read of a device value (.item(), bool(), int()) while capturing")
        group = in_task_group()
        if group is not None and not _aliases_an_input(func):
            raise CaptureRuleError(
                f"{name} allocates a tensor inside a graph task {group}: only the .out / in-place kernel may run "
                "there; allocate its inputs, outputs and workspace before graph_task_group_begin"
            )
        if STATE.kernel_depth == 0:
            self.note_reads(name, (args, kwargs))
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not _aliases_an_input(func):
                self.made.add(t.untyped_storage().data_ptr())
        return out

    def note_reads(self, name: str, tree: Any) -> None:
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage().data_ptr()
                if storage not in self.made and id(t) not in self._seen:
                    self._seen.add(id(t))
                    base = t if t._base is None else t._base
                    self.reads.append((name, weakref.ref(base), base.data_ptr()))

    def check_replay(self) -> None:
        moved = []
        for op, ref, addr in self.reads:
            t = ref()
            if t is None:
                continue  # a tensor of the test's own making that died (the capture's own outputs are in `made`)
            if t.data_ptr() != addr:
                moved.append(f"a tensor read by {op} {tuple(t.shape)} (captured at {addr:#x}, now {t.data_ptr():#x})")
        if moved:
            raise CaptureRuleError("NPUGraph.replay: captured tensors moved since the capture: " + "; ".join(moved))


@contextlib.contextmanager
def _no_host_reads() -> Iterator[None]:
    originals = {m: getattr(torch.Tensor, m) for m in _HOST_READ_METHODS}

    def refuse(method: str) -> Any:
        original = originals[method]

        def call(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            if STATE.kernel_depth == 0:
                raise CaptureRuleError(f"Tensor.{method}(): a host read of a device tensor while capturing")
            return original(self, *a, **k)

        return call

    for m in _HOST_READ_METHODS:
        setattr(torch.Tensor, m, refuse(m))
    try:
        yield
    finally:
        for m, fn in originals.items():
            setattr(torch.Tensor, m, fn)


# --- the stand-in torch.npu -----------------------------------------------------------------------------------------


class GraphAPIRecorder:
    """Binds each call against the documented signature and records ``(name, bound arguments)``."""

    def __init__(self, docs: dict[str, inspect.Signature]) -> None:
        self.docs = docs
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def check(self, name: str, *args: Any, **kwargs: Any) -> None:
        assert name in self.docs, f"torch.npu.{name} is not in torch_npu 2.8.0's graphs.py/streams.py"
        bound = self.docs[name].bind(*args, **kwargs)  # raises TypeError on a call outside the signature
        self.calls.append((name, dict(bound.arguments)))


def fake_npu(rec: GraphAPIRecorder) -> types.SimpleNamespace:
    """``torch.npu``'s graph and stream API over ``rec``, enforcing the capture rules."""
    stream_cls, graph_cls, event_cls = _graph_types(rec)
    active = [stream_cls()]  # the stream stack: the current stream is the last
    return types.SimpleNamespace(
        NPUGraph=graph_cls,
        graph=_graph_context(rec),
        ExternalEvent=event_cls,
        Stream=stream_cls,
        stream=_stream_context(active),
        current_stream=lambda device=None: active[-1],
        graph_pool_handle=lambda: rec.check("graph_pool_handle") or "pool",
        **_task_group_api(rec, active),
    )


def _graph_types(rec: GraphAPIRecorder) -> tuple[type, type, type]:
    """``Stream``, ``NPUGraph`` and ``ExternalEvent`` recording on ``rec`` (vLLM code builds them with no argument)."""

    class Stream:
        def wait_stream(self, stream: Any) -> None:
            rec.check("Stream.wait_stream", stream)

    class NPUGraph:
        def __init__(self) -> None:
            rec.check("NPUGraph.__init__")
            self.mode: _CaptureMode | None = None

        def replay(self) -> None:
            rec.check("NPUGraph.replay")
            if STATE.capturing is not None:
                raise CaptureRuleError("NPUGraph.replay inside a capture")
            assert self.mode is not None, "replay of a graph never captured"
            self.mode.check_replay()

        def reset(self) -> None:
            rec.check("NPUGraph.reset")

    class ExternalEvent:
        def __init__(self) -> None:
            rec.check("ExternalEvent.__new__")

        def record(self, *a: Any, **k: Any) -> None:
            rec.check("ExternalEvent.record", *a, **k)

        def wait(self, *a: Any, **k: Any) -> None:
            rec.check("ExternalEvent.wait", *a, **k)

        def reset(self, *a: Any, **k: Any) -> None:
            rec.check("ExternalEvent.reset", *a, **k)

    return Stream, NPUGraph, ExternalEvent


def _graph_context(rec: GraphAPIRecorder) -> Callable[..., contextlib.AbstractContextManager[None]]:
    """``torch.npu.graph(npu_graph, ...)``: a capture (never nested) that must not end inside a task group."""

    @contextlib.contextmanager
    def graph(npu_graph: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
        rec.check("graph.__init__", npu_graph, *args, **kwargs)
        if STATE.capturing is not None:
            raise CaptureRuleError("torch.npu.graph: captures do not nest")
        mode = _CaptureMode()
        npu_graph.mode = mode
        STATE.capturing = mode
        try:
            with mode, _no_host_reads():
                yield
            if STATE.group is not None:
                raise CaptureRuleError("capture ended inside a graph task group (graph_task_group_end missing)")
        finally:
            STATE.capturing, STATE.group = None, None

    return graph


def _stream_context(active: list[Any]) -> Callable[[Any], contextlib.AbstractContextManager[None]]:
    """``torch.npu.stream(s)``: ``s`` is the current stream inside."""

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[None]:
        active.append(s)
        try:
            yield
        finally:
            active.pop()

    return stream


def _task_group_api(rec: GraphAPIRecorder, active: list[Any]) -> dict[str, Callable[..., Any]]:
    """``graph_task_group_begin/end`` (inside a capture) and ``graph_task_update_begin/end`` (on the current
    stream, outside a capture: no allocation in between)."""

    def group_begin(stream: Any) -> None:
        rec.check("graph_task_group_begin", stream)
        if STATE.capturing is None or STATE.group is not None:
            raise CaptureRuleError("graph_task_group_begin outside a capture, or inside another group")
        STATE.group = "group"

    def group_end(stream: Any) -> str:
        rec.check("graph_task_group_end", stream)
        if STATE.group != "group":
            raise CaptureRuleError("graph_task_group_end without graph_task_group_begin")
        STATE.group = None
        return f"handle-{len(rec.calls)}"

    def update_begin(stream: Any, handle: Any) -> None:
        rec.check("graph_task_update_begin", stream, handle)
        if STATE.group is not None or active[-1] is not stream:
            raise CaptureRuleError("graph_task_update_begin: nested, or not on the current (update) stream")
        STATE.group = "update"
        STATE.update_mode = _UpdateMode()
        STATE.update_mode.__enter__()

    def update_end(stream: Any) -> None:
        rec.check("graph_task_update_end", stream)
        if STATE.group != "update" or STATE.update_mode is None:
            raise CaptureRuleError("graph_task_update_end without graph_task_update_begin")
        STATE.update_mode.__exit__(None, None, None)
        STATE.group, STATE.update_mode = None, None

    return {
        "graph_task_group_begin": group_begin,
        "graph_task_group_end": group_end,
        "graph_task_update_begin": update_begin,
        "graph_task_update_end": update_end,
    }


class _UpdateMode(TorchDispatchMode):
    """Outside a capture: allocations inside a task update fail."""

    def __torch_dispatch__(self, func: Any, types_: Any, args: Any = (), kwargs: Any = None) -> Any:
        group = in_task_group()
        if group is not None and not _aliases_an_input(func):
            raise CaptureRuleError(
                f"{func} allocates a tensor inside a graph task {group}: only the .out / in-place kernel may run there"
            )
        return func(*args, **(kwargs or {}))


def install(monkeypatch: Any, torch_npu: types.ModuleType | None = None) -> GraphAPIRecorder:
    """Install the stand-in: ``torch.npu`` (graph/stream API) and ``torch_npu`` (``torch_npu`` if given, else an
    empty module) with ``_C._weak_ref_tensor``. Returns the call recorder."""
    import sys

    rec = GraphAPIRecorder(documented_graph_api())
    module = torch_npu if torch_npu is not None else types.ModuleType("torch_npu")
    module._C = types.SimpleNamespace(_weak_ref_tensor=lambda t: t.detach())  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    npu = fake_npu(rec)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    STATE.capturing, STATE.group, STATE.kernel_depth = None, None, 0
    return rec


def kernel_call(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A stand-in torch_npu op is called (:func:`npu_testkit.npu_binding_rules.documented`): inside a task group it
    must be given its outputs (``out=``; a ``_get_workspace`` / ``_get_max_workspace`` query allocates); while
    capturing, its tensor arguments are reads of the graph."""
    group = in_task_group()
    if group is not None and ("out" not in kwargs or op.endswith("workspace")):
        raise CaptureRuleError(
            f"torch_npu.{op} allocates its result inside a graph task {group}: call its .out / out= form with "
            "buffers (and workspace) allocated before graph_task_group_begin"
        )
    if STATE.capturing is not None and STATE.kernel_depth == 0:
        STATE.capturing.note_reads(f"torch_npu.{op}", (args, kwargs))
