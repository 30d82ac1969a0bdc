# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vLLM's linear-method seam for msModelSlim schemes: tensors from the scheme, loading checked, forward delegated."""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearMethodBase, RowParallelLinear

from .params import check_complete, create_params
from .schemes import LinearScheme, LinearShape


class AscendLinearMethod(LinearMethodBase):
    """One instance per layer (``get_quant_method`` builds a fresh one), wrapping one :class:`LinearScheme`."""

    def __init__(self, scheme: LinearScheme, prefix: str) -> None:
        self.scheme = scheme
        self.prefix = prefix
        self.shape: LinearShape | None = None
        self.num_shards = 1

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        weight_loader = extra_weight_attrs.pop("weight_loader", None)
        self.shape = LinearShape(
            n=sum(output_partition_sizes),
            k=input_size_per_partition,
            params_dtype=params_dtype,
            row_parallel=isinstance(layer, RowParallelLinear),
            tp_size=getattr(layer, "tp_size", 1),
            prefix=self.prefix,
        )
        self.num_shards = len(output_partition_sizes)
        create_params(layer, self.scheme.specs(self.shape), weight_loader, self.prefix, extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        assert self.shape is not None, "create_weights was not called"
        check_complete(layer, self.prefix, self.num_shards)
        self.scheme.process(layer, self.shape)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.scheme.apply(layer, x, bias)
