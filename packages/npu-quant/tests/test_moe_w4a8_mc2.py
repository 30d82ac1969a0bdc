# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""W4A8_DYNAMIC experts behind MC2 (issue #31): MC2's dynamic-quant dispatch hands the experts int8 rows with
per-token scales, and the experts run them through ``run_int8`` (the int8 x int4 grouped matmul, no second
quantisation), as vllm-ascend v0.11.0 feeds its W4A8 MoE from MC2's quantized dispatch. One rank, the reference MC2
twin; the same layer without MC2 (the experts quantise the rows themselves) is the reference: equal outputs."""

from __future__ import annotations

import pytest
import torch
from quant_moe_harness import E, G, H, build, float_experts
from vllm_npu.quant.tools.quantize_math import quantize_w4a8


@pytest.mark.parametrize("tokens", [1, 5])
def test_mc2_int8_dispatch_feeds_the_w4a8_grouped_matmul(vllm_ctx: object, tp1_group: None, tokens: int) -> None:
    from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
    from vllm_npu.ops.moe.gating import RoutingConfig
    from vllm_npu.ops.moe.mc2 import MC2Comm
    from vllm_npu.quant.moe_w4a8 import W4A8DynamicExperts

    weights = float_experts(seed=7)
    layer = build("W4A8_DYNAMIC", {k: quantize_w4a8(w, G, "0", False, torch.float32) for k, w in weights.items()})
    layer.quant_method.process_weights_after_loading(layer)
    experts = W4A8DynamicExperts(layer, layer.quant_method._plan.activation)
    calls: list[tuple[int, torch.dtype]] = []
    run_int8 = experts.run_int8

    def recorded(xq, scales, counts, out_dtype):
        calls.append((int(counts.sum()), xq.dtype))
        return run_int8(xq, scales, counts, out_dtype)

    experts.run_int8 = recorded  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(3)
    x, logits = torch.randn(tokens, H, generator=gen), torch.randn(tokens, E, generator=gen)
    routing = RoutingConfig(top_k=2)
    ident = lambda t, out_splits, in_splits: t.clone()  # noqa: E731  the one-rank all-to-all of the twin
    mc2_plan = build_moe_plan(
        routing, E, act_dtype=torch.float32, mc2=MC2Comm(0, 1, ident, "", "A3"), mc2_capacity=8, backend="reference"
    )
    plain_plan = build_moe_plan(routing, E, act_dtype=torch.float32, backend="reference")
    through_mc2 = moe_forward(x, logits, plan=mc2_plan, experts=experts)
    assert calls == [(2 * tokens, torch.int8)]  # every routed row reached the experts as int8, once
    del experts.run_int8  # without MC2 the experts quantise their rows themselves (__call__), then run_int8
    plain = moe_forward(x, logits, plan=plain_plan, experts=experts)
    torch.testing.assert_close(through_mc2, plain, atol=1e-5, rtol=1e-5)
    assert through_mc2.abs().sum() > 0
