# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Linear quant schemes, by msModelSlim quant type."""

from __future__ import annotations

from ..description import QuantDescription
from .base import LinearScheme, LinearShape
from .w4a4_flatquant import W4A4FlatQuantScheme, decompose_dim
from .w4a8_dynamic import W4A8DynamicScheme
from .w8a8 import W8A8Scheme
from .w8a8_dynamic import W8A8DynamicScheme


def make_linear_scheme(quant_type: str, desc: QuantDescription) -> LinearScheme:
    """A fresh scheme instance (one per layer) for ``quant_type``."""
    if quant_type == "W8A8":
        return W8A8Scheme()
    if quant_type == "W8A8_DYNAMIC":
        return W8A8DynamicScheme()
    if quant_type == "W4A8_DYNAMIC":
        return W4A8DynamicScheme(desc.group_size, desc.version)
    if quant_type == "W4A4_FLATQUANT_DYNAMIC":
        return W4A4FlatQuantScheme()
    raise ValueError(f"no linear scheme for quant type {quant_type!r}")


__all__ = [
    "LinearScheme",
    "LinearShape",
    "W4A4FlatQuantScheme",
    "W4A8DynamicScheme",
    "W8A8DynamicScheme",
    "W8A8Scheme",
    "decompose_dim",
    "make_linear_scheme",
]
