# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The contract of a linear quant scheme, and helpers shared by the schemes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..params import QuantLoadError, TensorSpec


@dataclass(frozen=True)
class LinearShape:
    """The per-rank geometry of a linear layer: ``n`` output features (all shards), ``k`` input features."""

    n: int
    k: int
    params_dtype: torch.dtype
    row_parallel: bool
    tp_size: int
    prefix: str


class LinearScheme(ABC):
    """One msModelSlim scheme for linear layers. An instance serves exactly one layer.

    - :meth:`specs`: the checkpoint tensors (shapes/dtypes as on disk, per rank);
    - :meth:`process`: ALL load-time processing (validation of values, transposes, packing, scale folding);
    - :meth:`apply`: the forward, through kernels chosen once in ``__init__``.
    """

    name: str = ""

    @abstractmethod
    def specs(self, shape: LinearShape) -> list[TensorSpec]: ...

    @abstractmethod
    def process(self, layer: torch.nn.Module, shape: LinearShape) -> None: ...

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


def require_int_range(t: torch.Tensor, lo: int, hi: int, what: str) -> None:
    if t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
        raise QuantLoadError(f"{what} must hold values in [{lo}, {hi}], got [{int(t.min())}, {int(t.max())}]")


def require_positive(t: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        raise QuantLoadError(f"{what} must be finite and > 0 (got min {float(t.min()):g}); the checkpoint is corrupt")


def require_zero_if_loaded(layer: torch.nn.Module, name: str, loaded: set[str], what: str) -> None:
    """Offsets that the NPU kernels cannot apply (symmetric-only paths) must be zero, never silently ignored."""
    if name in loaded:
        t = getattr(layer, name)
        if bool((t != 0).any()):
            raise QuantLoadError(
                f"{what} has non-zero values: asymmetric weights are not supported by this scheme's NPU kernels; "
                "re-export with symmetric weight quantization"
            )


def flat2d(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    return x.reshape(-1, x.shape[-1]), tuple(x.shape[:-1])
