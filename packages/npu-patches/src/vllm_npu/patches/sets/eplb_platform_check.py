# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Patch ``eplb-platform-check``: vLLM's ``--enable-eplb`` must not be refused just because the platform is not CUDA.

vLLM 0.11.0's ``ParallelConfig.__post_init__`` (``vllm/config/parallel.py``) starts its EPLB checks with
``if not current_platform.is_cuda(): raise ValueError("Expert parallelism load balancing is only supported on CUDA
devices now.")``. Nothing else of EPLB needs CUDA there: ``EplbState`` and its weight exchange run on
``torch.distributed`` groups (gloo on the emulated device, HCCL on the NPU), npu-ops' MoE layers count the expert
load and follow the state, and npu-platform's model runner maps the rearrangement's ``torch.cuda.synchronize`` to the
device backend.

The replacement runs vLLM's ``__post_init__`` with EPLB switched off for the call (so the platform check is not
reached and the "num_redundant_experts without EPLB" check sees 0), then switches it back on and runs vLLM's other
EPLB checks itself, with vLLM's messages. The deprecated ``num_redundant_experts`` field is folded into
``eplb_config`` first, as vLLM does (the other deprecated EPLB fields vLLM folds itself during the call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def check_eplb(config: Any) -> None:
    """vLLM 0.11.0's EPLB checks of ``ParallelConfig.__post_init__`` other than the CUDA one (same messages)."""
    if config.eplb_config.num_redundant_experts < 0:
        raise ValueError(
            f"num_redundant_experts must be non-negative, but got {config.eplb_config.num_redundant_experts}."
        )
    if not config.enable_expert_parallel:
        raise ValueError("enable_expert_parallel must be True to use EPLB.")
    if config.tensor_parallel_size * config.data_parallel_size <= 1:
        raise ValueError(
            "EPLB requires tensor_parallel_size or data_parallel_size to be greater than 1, but got "
            f"TP={config.tensor_parallel_size},DP={config.data_parallel_size}."
        )


def make_replacement(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """Build ``ParallelConfig.__post_init__`` without the CUDA-only EPLB check (``original`` is kept by the registry)."""

    def __post_init__(self: Any) -> None:
        if not self.enable_eplb:
            original(self)
            return
        if self.num_redundant_experts is not None:  # deprecated field: vLLM folds it in the same way
            self.eplb_config.num_redundant_experts = self.num_redundant_experts
            self.num_redundant_experts = None
        redundant = self.eplb_config.num_redundant_experts
        self.enable_eplb = False
        self.eplb_config.num_redundant_experts = 0
        try:
            original(self)
        finally:
            self.enable_eplb = True
            self.eplb_config.num_redundant_experts = redundant
        check_eplb(self)

    __post_init__.__module__ = original.__module__
    __post_init__.__qualname__ = original.__qualname__
    __post_init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __post_init__
