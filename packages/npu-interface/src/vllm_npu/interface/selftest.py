# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The selftest contract: how a layer describes the calls ``vllm-npu selftest`` makes to each of its kernel pairs.

A layer with :class:`~vllm_npu.interface.kernels.Kernel` pairs exports ``selftest_cases() -> list[KernelCase]`` from
its door (``vllm_npu.<layer>.selftest_cases``). Each case is one call of one kernel at one shape and dtype: its
``build(device)`` returns a :class:`KernelCall` whose inputs satisfy the kernel's contract (block tables, slot
mappings, sequence lengths, quant scales...). The selftest builds the call twice from the same seed, once on the
device for the kernel the process selected and once on the CPU for the reference twin, and compares what
``outputs`` names. ``vllm-npu selftest`` fails a kernel pair found in a layer's source without a case.

Nothing here imports torch: the door stays import-light.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from .kernels import Kernel

#: ``outputs(result, args, kwargs) -> {name: tensor}``: the tensors to compare after the call (returned values, or
#: the in-place targets among the arguments), already in a form where equal contracts give equal tensors (e.g. top-k
#: ids sorted when the order of the k entries is not part of the contract).
Outputs = Callable[[Any, tuple, dict], Mapping[str, Any]]


def returned(result: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The default :data:`Outputs`: the returned tensor, or each tensor of a returned tuple (``out0``, ``out1``...)."""
    if isinstance(result, (tuple, list)):
        return {f"out{i}": r for i, r in enumerate(result) if r is not None}
    return {} if result is None else {"out": result}


class KernelCall(NamedTuple):
    """One call: ``fn(*args, **kwargs)`` then ``outputs(result, args, kwargs)``; ``args``/``kwargs`` on the device
    the case was built for."""

    args: tuple
    kwargs: dict
    outputs: Outputs = returned


class KernelCase(NamedTuple):
    """One selftest row: ``kernel`` called with ``build(device)`` at the sizes named by ``shape`` in ``dtype``.

    ``build`` must be deterministic (seed its own generator): it runs once per side. ``tolerance`` overrides the
    selftest's per-dtype ``(atol, rtol)`` for float outputs. Integer and bool outputs must match exactly, or within
    ``int_atol`` (a quantizer whose rounding of exact ties the docs leave open). ``note`` says what the row confirms,
    e.g. the model sizes it stands for or the audit row it checks on hardware.
    """

    kernel: Kernel
    shape: str
    dtype: str
    build: Callable[[Any], KernelCall]
    tolerance: tuple[float, float] | None = None
    int_atol: int = 0
    note: str = ""


def randn(seed: int, *shape: int, dtype: Any, device: Any, scale: float = 1.0) -> Any:
    """Deterministic normal samples (drawn on the CPU from ``seed``, then moved), so both sides of a case get
    identical inputs. Imports torch when called."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def randperm(seed: int, n: int, device: Any) -> Any:
    """A deterministic permutation of ``range(n)`` (int64), moved to ``device``."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(device)
