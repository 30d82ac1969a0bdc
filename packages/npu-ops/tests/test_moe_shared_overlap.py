# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Shared-expert overlap (``npu.multistream_overlap_shared_expert``) on vLLM's DeepseekV2MoE block (our
AscendSharedFusedMoE inside), on the emulated device: outputs identical with the overlap on and off, and the
emulated streams' log shows the intended order (side waits for main, shared experts inside the side stream's
block, routed experts after it on main, main waits for the side stream last).
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def ctx(vllm_ctx, tp1_group):
    return vllm_ctx


def _deepseek_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=32,
        moe_intermediate_size=8,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.5,
        norm_topk_prob=True,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        hidden_act="silu",
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
    )


def _block(ctx, overlap: bool, prefix: str):
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MoE

    ctx.additional_config = {"npu": {"multistream_overlap_shared_expert": overlap}}
    torch.manual_seed(7)
    block = DeepseekV2MoE(_deepseek_config(), ctx.parallel_config, quant_config=None, prefix=prefix)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    block.experts.quant_method.process_weights_after_loading(block.experts)
    return block


def test_overlap_on_equals_off_and_runs_in_the_intended_order(ctx):
    from vllm.forward_context import set_forward_context
    from vllm_npu.platform._device import STREAM_LOG

    off = _block(ctx, False, "ov_off.mlp")
    on = _block(ctx, True, "ov_on.mlp")
    assert off.experts._side_stream is None and on.experts._side_stream is not None
    side = on.experts._side_stream.stream.id
    order: list[tuple] = []
    shared = on.experts.shared_experts
    api = on.experts._side_stream.api
    shared.register_forward_hook(lambda m, a, o: order.append(("shared", api["current_stream"]().id)))
    routed_apply = on.experts.quant_method.apply

    def traced_apply(*args, **kwargs):
        order.append(("routed", api["current_stream"]().id))
        return routed_apply(*args, **kwargs)

    on.experts.quant_method.apply = traced_apply
    x = torch.randn(11, 32)
    STREAM_LOG.clear()
    with set_forward_context(None, ctx), torch.no_grad():
        expect = off(x)
        got = on(x)
    assert torch.equal(got, expect)
    assert order == [("shared", side), ("routed", 0)]
    log = [e for e in STREAM_LOG if side in e[1:]]
    assert log == [("wait_stream", side, 0), ("enter", side, None), ("exit", side, None), ("wait_stream", 0, side)]
