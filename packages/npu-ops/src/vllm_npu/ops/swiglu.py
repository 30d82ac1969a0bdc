# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The ``npu_swiglu`` kernel and its reference twin, shared by ``SiluAndMul`` (:mod:`.activation`) and the MoE
expert MLP (:mod:`.moe.experts`). Imports only torch, so the MoE kernel modules stay free of vLLM.

Contract (torch_npu 2.8.0 docs), ``npu_swiglu(x, dim=-1) -> y``: ``A, B = x.chunk(2, dim)``;
``y = A * sigmoid(A) * B`` (vLLM's SiluAndMul with the gate in the first half). ``x [..., 2d]`` -> ``y [..., d]``,
same dtype; an odd last dimension is a ValueError.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm_npu.interface import Kernel


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
    if x.shape[-1] % 2:
        raise _odd_width(x)
    gate, up = x.float().chunk(2, dim=-1)
    return F.silu(gate).mul_(up).to(x.dtype)  # in place on silu's fresh output: same values, one allocation less


SWIGLU = Kernel("swiglu", npu=swiglu_npu, reference=swiglu_reference)
