# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Expert MLPs over expert-sorted rows: grouped matmul -> gated activation -> grouped matmul.

:func:`grouped_matmul_npu` / :func:`grouped_matmul_reference` (``npu_grouped_matmul`` with one x, one 3-D weight,
one output: ``split_item=2``, ``group_type=0`` (groups along M), ``group_list_type=1`` (counts))::

    (x [N, K], weight [G, K, M] (any strides: a transposed view of vLLM's [G, M, K] parameter is fine),
     group_counts [G] int64 with sum <= N) -> y [N, M], y[rows of group g] = x[rows of group g] @ weight[g]
    (rows past the sum: undefined)

:data:`SWIGLU` (``npu_swiglu``, dim=-1, from :mod:`vllm_npu.ops.swiglu`, the kernel of ``SiluAndMul``): ``x = [a | b]``
-> ``silu(a) * b`` (vLLM's ``w13`` stacks gate (w1) then up (w3), so this is ``SiluAndMul``).

An :data:`ExpertsFn` ``(rows [N, H], group_counts [E_local] int64) -> [N, H]`` is what the token dispatchers call;
:class:`UnquantizedExperts` is the bf16/fp16/fp32 one. Quantised MoE methods supply their own ``ExpertsFn`` (same
signature) and reuse the gating and dispatch unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from vllm_npu.interface import ConfigError, Kernel, KernelBackend, opaque_reference_op

from ..swiglu import SWIGLU, swiglu_npu, swiglu_reference  # noqa: F401 (re-exported: the silu activation twins)

ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
GroupedMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grouped_matmul_npu(x: torch.Tensor, weight: torch.Tensor, group_counts: torch.Tensor) -> torch.Tensor:
    """Per-expert matmul over contiguous row groups with ``npu_grouped_matmul``."""
    import torch_npu

    return torch_npu.npu_grouped_matmul(
        [x], [weight], group_list=group_counts.to(torch.int64), split_item=2, group_type=0, group_list_type=1
    )[0]


def _grouped_matmul_loop(x: torch.Tensor, weight: torch.Tensor, group_counts: torch.Tensor) -> torch.Tensor:
    counts = group_counts.tolist()
    if len(counts) != weight.shape[0]:
        raise ValueError(f"group_counts has {len(counts)} groups but weight has {weight.shape[0]} experts")
    if sum(counts) > x.shape[0]:
        raise ValueError(f"group_counts sum to {sum(counts)} but x has {x.shape[0]} rows")
    out = x.new_zeros(x.shape[0], weight.shape[-1])
    start = 0
    for expert, n in enumerate(counts):
        if n:
            torch.matmul(x[start : start + n], weight[expert], out=out[start : start + n])
        start += n
    return out


_REFERENCE_GROUPED_MATMUL: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = opaque_reference_op(
    "moe_grouped_matmul",
    _grouped_matmul_loop,
    lambda x, weight, group_counts: x.new_empty(x.shape[0], weight.shape[-1]),
)


def grouped_matmul_reference(x: torch.Tensor, weight: torch.Tensor, group_counts: torch.Tensor) -> torch.Tensor:
    """Reference twin of :func:`grouped_matmul_npu` (a loop over experts, none over tokens).

    Rows past ``group_counts.sum()`` (fewer counted rows than rows: the expert-parallel graph path, where rows of
    other ranks' experts stay in the buffer) are zeros; the NPU leaves them undefined, and callers mask them. The loop
    reads the counts on the host, so it runs inside a registered op (``torch.ops.vllm_npu.moe_grouped_matmul``, fake
    output ``[N, M]``): a compiled graph holds one opaque node, as it holds the NPU kernel's, instead of a host read.
    """
    return _REFERENCE_GROUPED_MATMUL(x, weight, group_counts)


GROUPED_MATMUL = Kernel("moe_grouped_matmul", npu=grouped_matmul_npu, reference=grouped_matmul_reference)


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(a) * b`` (vLLM's ``activation="gelu"`` for MoE); plain torch on both backends."""
    a, b = x.chunk(2, dim=-1)
    return F.gelu(a) * b


def build_activation(activation: str, backend: KernelBackend | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    if activation == "silu":
        from ..chip_310p import swiglu_kernel  # the chip's pair (310P: npu_swiglu in float32)

        return swiglu_kernel().select(backend)
    if activation == "gelu":
        return gelu_and_mul
    raise ConfigError(f"MoE activation {activation!r} is not supported by npu-ops; supported: 'silu', 'gelu'")


@dataclass
class UnquantizedExperts:
    """The expert MLP for float weights in vLLM's layout: w13 [E, 2I, H], w2 [E, H, I] (used as transposed views)."""

    w13: torch.Tensor
    w2: torch.Tensor
    grouped_matmul: GroupedMatmul
    activation: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, rows: torch.Tensor, group_counts: torch.Tensor) -> torch.Tensor:
        gate_up = self.grouped_matmul(rows, self.w13.transpose(1, 2), group_counts)
        return self.grouped_matmul(self.activation(gate_up), self.w2.transpose(1, 2), group_counts)


def unquantized_experts(
    w13: torch.Tensor, w2: torch.Tensor, activation: str = "silu", backend: KernelBackend | None = None
) -> UnquantizedExperts:
    """Build the float expert MLP, choosing its kernels now."""
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0] or w13.shape[1] != 2 * w2.shape[2]:
        raise ConfigError(
            f"MoE weights must be w13 [E, 2I, H] and w2 [E, H, I]; got {tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    return UnquantizedExperts(w13, w2, GROUPED_MATMUL.select(backend), build_activation(activation, backend))
