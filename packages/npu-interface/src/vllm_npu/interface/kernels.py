# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Kernel pairs: an NPU kernel and its pure-PyTorch reference twin (:class:`Kernel`), selected once per layer by the
process's kernel backend (:func:`.device.kernel_backend`). Imports no torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from . import device
from .device import KernelBackend

F = TypeVar("F", bound=Callable[..., object])


class Kernel(Generic[F]):
    """An NPU kernel and its pure-PyTorch reference twin: same contract (shapes, dtypes, layouts, in-place effects).

    Both live in the same module as the layer that uses them. ``select()`` is called when a layer is built.
    Immutable; equal when name and both functions are equal.
    """

    __slots__ = ("name", "npu", "reference")
    name: str
    npu: F
    reference: F

    def __init__(self, name: str, npu: F, reference: F) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "npu", npu)
        object.__setattr__(self, "reference", reference)

    def __setattr__(self, key: str, value: object) -> None:
        raise AttributeError(f"Kernel is immutable: cannot set {key!r}")

    def __delattr__(self, key: str) -> None:
        raise AttributeError(f"Kernel is immutable: cannot delete {key!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Kernel):
            return NotImplemented
        return (self.name, self.npu, self.reference) == (other.name, other.npu, other.reference)

    def __hash__(self) -> int:
        return hash((self.name, self.npu, self.reference))

    def __repr__(self) -> str:
        return f"Kernel(name={self.name!r}, npu={self.npu!r}, reference={self.reference!r})"

    def select(self, backend: KernelBackend | None = None) -> F:
        # Looked up on the device module at each call: the process's backend is that module's state (and tests
        # that stand in an NPU replace device.kernel_backend).
        return self.npu if (backend or device.kernel_backend()) == "npu" else self.reference
