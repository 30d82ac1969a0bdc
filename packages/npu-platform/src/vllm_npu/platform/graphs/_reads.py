# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The tensors a captured graph reads by address, snapshotted at capture and checked before every replay.

A captured ACL graph (like a CUDA graph) holds raw device addresses: of its inputs, and of every tensor its kernels
reached through Python state while capturing (weights, buffers, KV caches, the tensor arguments of its updatable
tasks). torch_npu's ``NPUGraph.replay`` (``torch_npu/npu/graphs.py:205``) relaunches the graph as captured; nothing
re-reads a Python object. A tensor whose storage moved after the capture (``p.data = new``, an
``untyped_storage().resize_(0)`` / ``resize_(n)`` pair as sleep mode does, a re-allocated KV cache) leaves the graph
reading freed memory. vllm-ascend keeps addresses fixed instead (its sleep allocator re-maps the same virtual
addresses, ``device_allocator/camem.py``); we check.

The check is one ``data_ptr()`` per tensor: a list comprehension compared with the capture's list, the details
worked out only on a mismatch.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Collection, Iterable
from typing import Any

import torch

from . import GraphInputMovedError


def tensor_labels(runnable: Any) -> dict[int, str]:
    """``id(tensor) -> name`` for the tensors a capture may read by reference: the runnable's parameters and buffers
    (when it is a module) and the KV caches of the attention layers in the current forward context."""
    labels: dict[int, str] = {}
    if isinstance(runnable, torch.nn.Module):
        for name, p in runnable.named_parameters(remove_duplicate=False):
            labels.setdefault(id(p), f"parameter {name!r}")
        for name, b in runnable.named_buffers(remove_duplicate=False):
            labels.setdefault(id(b), f"buffer {name!r}")
    forward_context = sys.modules.get("vllm.forward_context")  # not imported: no forward context to read
    try:
        layers = forward_context.get_forward_context().no_compile_layers if forward_context else {}
    except (AssertionError, AttributeError):  # outside a forward (unit tests of the graph alone)
        layers = {}
    for layer_name, layer in layers.items():
        for i, cache in enumerate(getattr(layer, "kv_cache", None) or ()):
            if isinstance(cache, torch.Tensor):
                labels.setdefault(id(cache), f"KV cache {i} of {layer_name!r}")
    return labels


def owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns ``t``'s memory: its base for a view (the KV cache behind ``kv_cache.unbind(0)``)."""
    base = t._base
    return t if base is None else base


class CapturedReads:
    """The tensors a graph reads by reference and their addresses at capture (see the module docstring).

    ``weak``: hold them through ``weakref`` (the NPU graph, whose task arguments must not be kept alive: a tensor
    that dies after the capture was an intermediate of the capture, owned by the graph pool, and is dropped by
    :meth:`settle`); otherwise hold them (the emulated twin, whose traced module holds them anyway).
    """

    def __init__(self, weak: bool) -> None:
        self.weak = weak
        self.labels: list[str] = []
        self.refs: list[Any] = []
        self.addresses: list[int] = []
        self._seen: set[int] = set()

    def __len__(self) -> int:
        return len(self.refs)

    def add(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for label, t in tensors:
            if id(t) in self._seen:
                continue
            self._seen.add(id(t))
            self.labels.append(label)
            self.refs.append(weakref.ref(t) if self.weak else t)
            self.addresses.append(t.data_ptr())

    def settle(self, exclude_storages: Collection[int] = ()) -> None:
        """After the capture: forget the tensors that died with it and those on ``exclude_storages`` (the
        capture's outputs): both are intermediates of the capture, in the graph pool."""
        if not self.weak:
            return

        def kept(r: Any) -> bool:
            t = r()
            return t is not None and t.untyped_storage().data_ptr() not in exclude_storages

        keep = [i for i, r in enumerate(self.refs) if kept(r)]
        self.labels = [self.labels[i] for i in keep]
        self.refs = [self.refs[i] for i in keep]
        self.addresses = [self.addresses[i] for i in keep]
        self._seen.clear()

    def check(self) -> None:
        """Raise :class:`GraphInputMovedError` naming every tensor that moved (or, held weakly, was freed)."""
        if self.weak:
            tensors = [r() for r in self.refs]
            if all(t is not None for t in tensors) and [t.data_ptr() for t in tensors] == self.addresses:
                return
        else:
            tensors = self.refs
            if [t.data_ptr() for t in tensors] == self.addresses:
                return
        moved = []
        for label, t, addr in zip(self.labels, tensors, self.addresses, strict=True):
            if t is None:
                moved.append(f"{label} (freed; captured at {addr:#x})")
            elif t.data_ptr() != addr:
                moved.append(f"{label} (captured at {addr:#x}, now at {t.data_ptr():#x})")
        shown = "; ".join(moved[:4]) + (f"; and {len(moved) - 4} more" if len(moved) > 4 else "")
        raise GraphInputMovedError(
            f"a captured graph reads tensors by the address they had at capture, and {len(moved)} moved since: "
            + shown
            + ". Keep captured tensors in place (copy new values into them), or capture the graphs again after "
            "moving them (e.g. after waking up from sleep mode)"
        )
