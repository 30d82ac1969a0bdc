# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Quantized FusedMoE layers for the MoE tests (``test_moe``, ``test_moe_graph``): a real vLLM ``FusedMoE`` with the
``ascend`` quant config, its experts loaded per expert and shard through ``FusedMoE.weight_loader`` (wrapped by our
validating loader) from float experts quantized by :mod:`vllm_npu.quant.tools.quantize_math`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from vllm_npu.quant.config import AscendQuantConfig
from vllm_npu.quant.description import QuantDescription
from vllm_npu.quant.tools.quantize_math import quantize_w4a8, quantize_w8a8, quantize_w8a8_dynamic

E, TOP_K, H, INTER, G = 4, 2, 32, 32, 16
PREFIX = "model.layers.0.mlp.experts"
PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def float_experts(seed: int = 0, num_experts: int = E) -> dict[tuple[int, str], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(num_experts):
        out[(e, "gate_proj")] = torch.randn(INTER, H, generator=g) * 0.2
        out[(e, "up_proj")] = torch.randn(INTER, H, generator=g) * 0.2
        out[(e, "down_proj")] = torch.randn(H, INTER, generator=g) * 0.2
    return out


def quantized(
    qtype: str, weights: dict[tuple[int, str], torch.Tensor]
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    if qtype == "W8A8_DYNAMIC":
        return {k: quantize_w8a8_dynamic(w, torch.float32) for k, w in weights.items()}
    if qtype == "W8A8":
        # calibration on other N(0, 1) rows than the test's: every expert sees all of them (as the quantizer does)
        xc = torch.randn(64, H, generator=torch.Generator().manual_seed(123))
        out = {}
        for e in sorted({e for e, _ in weights}):
            h = F.silu(xc @ weights[(e, "gate_proj")].t()) * (xc @ weights[(e, "up_proj")].t())
            for proj, inp in (("gate_proj", xc), ("up_proj", xc), ("down_proj", h)):
                out[(e, proj)] = quantize_w8a8(
                    weights[(e, proj)], None, float(inp.min()), float(inp.max()), torch.float32
                )
        return out
    return {k: quantize_w4a8(w, G, "0", False, torch.float32) for k, w in weights.items()}


def build(
    qtype: str,
    tensors: dict[tuple[int, str], dict[str, torch.Tensor]],
    skip: tuple[int, str] | None = None,
    version: str = "0",
    prefix: str = PREFIX,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A FusedMoE of ``len(experts)`` experts (params ``dtype``) loaded from ``tensors`` (``skip``: one shard left
    out); not yet processed (``layer.quant_method.process_weights_after_loading(layer)``)."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    entries: dict[str, Any] = {f"{prefix}.{e}.{p}.{s}": qtype for (e, p), ts in tensors.items() for s in ts}
    entries["group_size"] = G
    entries["version"] = version
    cfg = AscendQuantConfig(QuantDescription.from_mapping(entries))
    layer = FusedMoE(
        num_experts=len({e for e, _ in tensors}),
        top_k=TOP_K,
        hidden_size=H,
        intermediate_size=INTER,
        params_dtype=dtype,
        renormalize=True,
        quant_config=cfg,
        prefix=prefix,
    )
    params = dict(layer.named_parameters())
    for (e, proj), ts in tensors.items():
        if (e, proj) == skip:
            continue
        for suffix, t in ts.items():
            name = ("w2_" if proj == "down_proj" else "w13_") + suffix
            params[name].weight_loader(
                params[name], t, f"{prefix}.{e}.{proj}.{suffix}", shard_id=PROJ[proj], expert_id=e
            )
    return layer
