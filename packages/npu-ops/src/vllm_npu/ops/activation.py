"""Activation overrides: ``npu_swiglu`` for SiluAndMul, ``npu_fast_gelu`` for QuickGELU.

Contracts (torch_npu 2.8.0 docs):

- ``npu_swiglu(x, dim=-1) -> y``: ``A, B = x.chunk(2, dim)``; ``y = A * sigmoid(A) * B`` (vLLM's SiluAndMul with the
  gate in the first half). ``x [..., 2d]`` -> ``y [..., d]``, same dtype; an odd last dimension is a ValueError.
- ``npu_fast_gelu(x) -> y``: on Atlas A2/A3 ``y = x / (1 + exp(-1.702 x))`` = ``x * sigmoid(1.702 x)``
  (QuickGELU). Same shape and dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.activation import QuickGELU, SiluAndMul
from vllm_npu.interface.device import Kernel


def _odd_width(x: torch.Tensor) -> ValueError:
    return ValueError(f"SiluAndMul needs an even last dimension (gate|up halves), got shape {tuple(x.shape)}")


# Both twins reject an odd last dimension themselves (the NPU docs do not say what npu_swiglu does with one, and the
# reference would broadcast a width-3 input silently): the check costs nothing extra where the width is read anyway,
# and the layer's forward stays a bare kernel call.


def swiglu_npu(x: torch.Tensor) -> torch.Tensor:
    import torch_npu

    if x.shape[-1] % 2:
        raise _odd_width(x)
    return torch_npu.npu_swiglu(x, -1)


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    d, odd = divmod(x.shape[-1], 2)
    if odd:
        raise _odd_width(x)
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def fast_gelu_npu(x: torch.Tensor) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_fast_gelu(x)


def fast_gelu_reference(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.sigmoid(1.702 * xf)).to(x.dtype)


SWIGLU = Kernel("swiglu", npu=swiglu_npu, reference=swiglu_reference)
FAST_GELU = Kernel("fast_gelu", npu=fast_gelu_npu, reference=fast_gelu_reference)


class NPUSiluAndMul(SiluAndMul):
    """``x [..., 2d] -> silu(x[..., :d]) * x[..., d:]`` in one kernel."""

    def __init__(self) -> None:
        super().__init__()
        self._kernel = SWIGLU.select()

    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x)  # the kernel rejects an odd last dimension


class NPUQuickGELU(QuickGELU):
    """``x * sigmoid(1.702 x)`` in one kernel."""

    def __init__(self) -> None:
        super().__init__()
        self._kernel = FAST_GELU.select()

    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x)
