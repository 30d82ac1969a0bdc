# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Kernels inside a captured static graph whose host-side parameters change every step ("graph tasks").

A captured graph (ACL graph on an NPU, the static-graph twin on the emulated device) freezes everything the host
decided while capturing: shapes, scalars, Python lists handed to kernels. Only the *contents* of the captured
tensors change between replays. A few kernels take per-step host parameters anyway: the decode attention kernels
take the sequence lengths as ``SymInt[]``. vllm-ascend captures such a kernel as an updatable task group and, before
each replay, re-issues it with new parameters (``graph_task_update_begin/end``).

This module is the contract between the kernel's caller (npu-attention) and the graph runtime (npu-platform):

- :func:`launch` runs ``kernel(*args, **params)``. Outside a capture that is all it does. While a full graph is
  being captured it hands the call to the active :class:`TaskRecorder`, which captures it as a task and remembers
  ``refresh``.
- Before every replay the runtime calls each task's ``refresh()`` (a zero-argument callable, run on the host outside
  the graph, typically reading the current step's attention metadata) and re-issues the task with the parameters it
  returns. A task whose refresh is skipped keeps its capture-time parameters: on an NPU and on the emulated device
  alike that gives wrong results, never stale-but-plausible ones that a test could miss.

Only the parameters named in ``refresh``'s result may change; tensor arguments are captured by address. The rules a
task follows (the NPU's: an update re-issues exactly the captured kernel, on the update stream, between
``graph_task_update_begin`` and ``graph_task_update_end``):

- the kernel writes its results into its tensor arguments (``out=``) and returns nothing: whatever a task produces
  must live at an address the graph captured;
- everything the kernel reads or writes is allocated *before* :func:`launch` (masks, ``.contiguous()`` copies,
  outputs, softmax LSE, workspaces): inside the task group only the ``.out`` / in-place kernel runs. An allocation
  inside the group would be re-made, and freed, at every update while the graph keeps the capture's address;
- scratch that depends on the host parameters (a workspace sized for this step's sequence lengths) comes from
  ``prepare``: ``prepare(*args, **params)`` returns extra keyword parameters, and the runtime calls it outside the
  group at capture and again before every update, after ``refresh`` (vllm-ascend v0.11.0 re-queries
  ``_npu_paged_attention_get_workspace`` before each update the same way, ``compilation/acl_graph.py:279-299``);
- the runtime keeps no strong reference to the tensor arguments (torch_npu ``_weak_ref_tensor``, as vllm-ascend's
  ``graph_params``): their memory belongs to the graph pool or to their owners (weights, KV caches).

Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

#: Parameters of one task refresh: keyword name -> new host value (e.g. ``{"context_lens": [5, 9, 1, 1]}``).
Refresh = Callable[[], Mapping[str, Any]]

#: A task's per-update scratch: called as ``prepare(*args, **params)``, returns extra keyword parameters (e.g.
#: ``{"workspace": ...}``) allocated outside the task group.
Prepare = Callable[..., Mapping[str, Any]]


class TaskRecorder(Protocol):
    """What a graph runtime implements to capture updatable kernels (see the module docstring)."""

    def record(
        self,
        kernel: Callable[..., Any],
        args: tuple[Any, ...],
        params: dict[str, Any],
        refresh: Refresh,
        prepare: Prepare | None = None,
    ) -> None:
        """Capture ``kernel(*args, **params)`` as a task (running it once; ``prepare``'s parameters added first)."""
        ...


_state = threading.local()


def active_recorder() -> TaskRecorder | None:
    """The recorder of the full-graph capture running on this thread, or None."""
    return getattr(_state, "recorder", None)


@contextlib.contextmanager
def recording(recorder: TaskRecorder) -> Iterator[TaskRecorder]:
    """Within the block, :func:`launch` on this thread records into ``recorder`` (captures do not nest)."""
    if active_recorder() is not None:
        raise RuntimeError("a graph capture is already recording tasks on this thread; captures do not nest")
    _state.recorder = recorder
    try:
        yield recorder
    finally:
        _state.recorder = None


def launch(
    kernel: Callable[..., Any], *args: Any, refresh: Refresh, prepare: Prepare | None = None, **params: Any
) -> None:
    """Run ``kernel(*args, **params)`` (which writes into its ``out`` tensors and returns nothing); inside a
    full-graph capture, as a task refreshed (and prepared) before every replay. Outside a capture ``prepare`` is
    not called: the kernel sizes its own scratch."""
    recorder = active_recorder()
    if recorder is None:
        check_task_result(kernel, kernel(*args, **params))
    else:
        recorder.record(kernel, args, params, refresh, prepare)


def check_task_result(kernel: Callable[..., Any], result: Any) -> None:
    """Raise TypeError unless ``result`` (what ``kernel`` returned) is None: a task's results live in its tensor
    arguments, and a captured graph would lose anything returned."""
    if result is not None:
        raise TypeError(
            f"graph task {getattr(kernel, '__name__', kernel)!r} returned {type(result).__name__}: a task writes its "
            "results into its tensor arguments (out=) and returns None"
        )


# --- compiled decode graphs (the torchair mode) ----------------------------------------------------------------------


class CompiledStep:
    """The graph inputs of the compiled decode step being traced or run: attention layer name -> that layer's inputs
    (an object of the layer's attention backend, e.g. npu-attention's ``GraphDecodeInputs``), or None outside one.

    The contract between the torchair wrapper (npu-platform) and the attention impls (npu-attention): the compiled
    function takes the mapping as an *argument* and stores it here as its first statement; an impl reads its layer's
    entry with :func:`compiled_step_inputs`. Dynamo tracks that store, so what the impl reads during the trace is the
    argument itself: its tensors are graph inputs guarded on shape only, and its Python ints (the lengths the NPU
    attention kernel takes as ``SymInt[]``) are graph inputs too under ``dynamic=True``, where a value read from a
    module global would be baked into the graph as a constant. The wrapper resets it to None after the call.
    """

    inputs: Mapping[str, Any] | None = None


COMPILED_STEP = CompiledStep()


def compiled_step_inputs(layer_name: str | None) -> Any:
    """``layer_name``'s graph inputs of the compiled decode step being traced or run, or None (eager steps)."""
    inputs = COMPILED_STEP.inputs
    if inputs is None or layer_name is None:
        return None
    return inputs.get(layer_name)


def opaque_reference_op(name: str, fn: Callable[..., Any], fake: Callable[..., Any]) -> Any:
    """``torch.ops.vllm_npu.<name>``: ``fn`` registered as a custom op without mutated arguments, ``fake`` its shape
    function; registered once per process (a later call returns the existing op).

    For reference twins that read sizes on the host or write a buffer Dynamo must not functionalize: inside a
    compiled graph (the torchair mode, the emulated twin) the op is one opaque node, as the NPU kernel it stands for
    is. Imports torch when called."""
    import torch

    try:
        return getattr(torch.ops.vllm_npu, name)
    except (AttributeError, RuntimeError):
        pass
    op = torch.library.custom_op(f"vllm_npu::{name}", mutates_args=())(fn)
    op.register_fake(fake)
    return getattr(torch.ops.vllm_npu, name)
