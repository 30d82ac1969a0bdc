# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Weight storage format before vLLM reshapes an MLA layer's ``kv_b_proj`` weight.

vLLM's ``MLACommonBaseImpl.process_weights_after_loading`` takes ``kv_b_proj.weight`` (``[N * (P + V), L]``) and
``.T``, ``.view``s and ``.split``s it into ``W_UK_T``/``W_UV``. Those are views over the storage: on an Ascend tensor
in FRACTAL_NZ (blocked) format they would not mean what they mean for a row-major one. The plugin itself keeps float
weights ND and runs with ``torch.npu.config.allow_internal_format = False`` (see ``vllm_npu.platform._device``), so
nothing it builds is NZ; the cast back to ND (format 2) before the split is what vllm-ascend v0.11.0 does "to be on the
safe side" (``attention/mla_v1.py``) and covers a weight another component put into NZ.

Contract (both twins): ``weight`` any shape/dtype -> a tensor of the same shape, dtype and values in ND format (the
reference has no formats: identity).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm_npu.interface import Kernel

ACL_FORMAT_ND = 2


def weight_to_nd_npu(weight: torch.Tensor) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_format_cast(weight, ACL_FORMAT_ND)


def weight_to_nd_reference(weight: torch.Tensor) -> torch.Tensor:
    return weight


WEIGHT_TO_ND = Kernel("weight_to_nd", npu=weight_to_nd_npu, reference=weight_to_nd_reference)


def kv_b_proj_to_nd(kv_b_proj: torch.nn.Module) -> None:
    """Make an unquantized ``kv_b_proj`` weight ND in place before vLLM reshapes it (a quantized one is dequantized
    by vLLM through its method's ``apply``, which yields a fresh ND tensor)."""
    if isinstance(getattr(kv_b_proj, "quant_method", None), UnquantizedLinearMethod):
        weight = kv_b_proj.weight
        assert isinstance(weight, torch.Tensor)  # the parameter UnquantizedLinearMethod.create_weights registered
        weight.data = WEIGHT_TO_ND.select()(weight.data)
