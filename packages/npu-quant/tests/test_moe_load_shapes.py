# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Loading quantized MoE experts (gate/up merged into w13, down into w2): every mis-shaped expert tensor of every
scheme is a QuantLoadError naming the checkpoint tensor, its shape and the expected one. vLLM's FusedMoE loader
narrows each tensor to the expert slice, so a too-large tensor (twice the rows or columns) used to load silently,
truncated; a too-small one failed with a bare RuntimeError (now translated too)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from quant_moe_harness import build, float_experts, quantized
from vllm_npu.quant.params import QuantLoadError

MUTATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "rows*2": lambda t: torch.cat([t, t], 0),
    "rows/2": lambda t: t[: t.shape[0] // 2].clone(),  # empty for a one-value tensor
    "cols*2": lambda t: torch.cat([t, t], -1),
}
CASES = [
    (qtype, proj, suffix, mutation)
    for qtype in ("W8A8_DYNAMIC", "W8A8", "W4A8_DYNAMIC")
    for proj in ("gate_proj", "up_proj", "down_proj")
    for suffix in quantized(qtype, float_experts())[(0, proj)]
    for mutation in MUTATIONS
]
_layer_index = itertools.count()  # vLLM refuses two layers of one name in a config


@pytest.mark.parametrize(("qtype", "proj", "suffix", "mutation"), CASES, ids=["-".join(c) for c in CASES])
def test_mis_shaped_expert_tensor_is_named(vllm_ctx: object, tp1_group: None, qtype, proj, suffix, mutation) -> None:
    tensors = quantized(qtype, float_experts())
    good = tensors[(1, proj)][suffix]
    bad = MUTATIONS[mutation](good)
    tensors[(1, proj)][suffix] = bad
    prefix = f"model.layers.{next(_layer_index)}.mlp.experts"
    with pytest.raises(QuantLoadError) as err:
        layer = build(qtype, tensors, prefix=prefix)
        layer.quant_method.process_weights_after_loading(layer)
    msg = str(err.value)
    assert f"{prefix}.1.{proj}.{suffix}" in msg and str(tuple(bad.shape)) in msg, msg
