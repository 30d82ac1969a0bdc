# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Linear layers: vLLM's parallel linear classes with an NPU unquantized method.

The GEMM itself is ``torch.nn.functional.linear`` on both devices (torch_npu serves aten's matmul on the NPU). What
the NPU needs on top is the weight layout: after loading, the weight of an unquantized linear layer is cast once to
the Ascend FRACTAL_NZ format (``npu_format_cast(weight, 29)``), which the matmul kernels consume without a per-call
transdata. The emulated device keeps ND (the cast is the identity there).

Only the method is swapped: sharding, weight loading (v1/v2 loaders), bias handling on TP rank 0 and the TP
collectives stay vLLM's. Quantized layers (``quant_config`` given) are left to their quant method.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm_npu.interface.device import Kernel

ACL_FORMAT_FRACTAL_NZ = 29


def to_npu_weight_layout_npu(weight: torch.Tensor) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_format_cast(weight, ACL_FORMAT_FRACTAL_NZ)


def to_npu_weight_layout_reference(weight: torch.Tensor) -> torch.Tensor:
    return weight


WEIGHT_LAYOUT = Kernel("linear_weight_layout", npu=to_npu_weight_layout_npu, reference=to_npu_weight_layout_reference)


class NPUUnquantizedLinearMethod(UnquantizedLinearMethod):
    """``y = x @ W^T + b`` with ``W [out, in]`` in the NPU's preferred layout after loading."""

    def __init__(self) -> None:
        super().__init__()
        self._layout = WEIGHT_LAYOUT.select()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = layer.weight
        assert isinstance(weight, torch.Tensor)  # the parameter create_weights registered
        weight.data = self._layout(weight.data)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = layer.weight
        assert isinstance(weight, torch.Tensor)
        return torch.nn.functional.linear(x, weight, bias)


def _use_npu_method(layer: Any) -> None:
    # Exact type: subclasses of UnquantizedLinearMethod (LoRA, other plugins) keep theirs.
    if type(layer.quant_method) is UnquantizedLinearMethod:
        layer.quant_method = NPUUnquantizedLinearMethod()


class NPUReplicatedLinear(ReplicatedLinear):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _use_npu_method(self)


class NPUColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _use_npu_method(self)


class NPUMergedColumnParallelLinear(MergedColumnParallelLinear):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _use_npu_method(self)


class NPUQKVParallelLinear(QKVParallelLinear):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _use_npu_method(self)


class NPURowParallelLinear(RowParallelLinear):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _use_npu_method(self)
