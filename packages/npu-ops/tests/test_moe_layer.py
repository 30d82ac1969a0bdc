# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""AscendFusedMoE / AscendSharedFusedMoE built through vLLM's own classes (OOT registration), on the emulated device.

Golden references: vLLM's ``moe_torch_iterative.fused_moe`` and ``cpu_fused_moe.CPUFusedMOE`` (pure torch), and HF
transformers' ``DeepseekV3MoE`` for vLLM's ``DeepseekV2MoE`` block (grouped top-k with e_score_correction_bias,
shared experts, routed scaling) built with our classes. Tolerance: float32, 1e-5 abs/rel (2e-5 against HF, whose
expert loop sums in a different order).
"""

from __future__ import annotations

import types

import pytest
import torch


@pytest.fixture
def ctx(vllm_ctx, tp1_group):
    return vllm_ctx


def _forward(cfg, module, *args):
    from vllm.forward_context import set_forward_context

    with set_forward_context(None, cfg), torch.no_grad():
        return module(*args)


def _fill(layer, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    e, two_i, h = layer.w13_weight.shape
    layer.w13_weight.data.copy_(torch.randn(e, two_i, h, generator=gen) / h**0.5)
    layer.w2_weight.data.copy_(torch.randn(e, h, two_i // 2, generator=gen) / (two_i // 2) ** 0.5)
    layer.quant_method.process_weights_after_loading(layer)


def test_vllm_fused_moe_is_ours_and_matches_vllm_torch_moe(ctx):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.layers.fused_moe.moe_torch_iterative import fused_moe
    from vllm_npu.ops.moe.comm import LocalDispatcher
    from vllm_npu.ops.moe.layer import AscendFusedMoE, AscendUnquantizedFusedMoEMethod

    layer = FusedMoE(
        num_experts=6,
        top_k=2,
        hidden_size=16,
        intermediate_size=12,
        params_dtype=torch.float32,
        renormalize=False,
        prefix="t1.experts",
    )
    assert type(layer) is AscendFusedMoE
    assert type(layer.quant_method) is AscendUnquantizedFusedMoEMethod
    assert layer.moe_plan.gate_path == "topk_softmax" and isinstance(layer.moe_plan.dispatcher, LocalDispatcher)
    _fill(layer)
    for num_tokens in (1, 9):
        x, logits = torch.randn(num_tokens, 16), torch.randn(num_tokens, 6)
        out = _forward(ctx, layer, x, logits)
        expect = fused_moe(x, layer.w13_weight, layer.w2_weight, logits, 2, 6, renormalize=False)
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


def test_layer_casts_and_moves_like_any_module(ctx):
    """``Module.to()`` / ``.double()`` reach every child through ``Module._apply(fn)``: the layer must not shadow it."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    layer = FusedMoE(
        num_experts=4, top_k=2, hidden_size=8, intermediate_size=4, params_dtype=torch.float32, prefix="t0.experts"
    )
    torch.nn.Sequential(layer).to(torch.float64)
    assert layer.w13_weight.dtype == layer.w2_weight.dtype == torch.float64


def test_grouped_router_layer_matches_vllm_cpu_moe(ctx):
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import CPUFusedMOE
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    bias = torch.nn.Parameter(torch.randn(12) * 0.2, requires_grad=False)
    layer = FusedMoE(
        num_experts=12,
        top_k=3,
        hidden_size=8,
        intermediate_size=4,
        params_dtype=torch.float32,
        renormalize=True,
        use_grouped_topk=True,
        num_expert_group=3,
        topk_group=2,
        scoring_func="sigmoid",
        routed_scaling_factor=1.5,
        e_score_correction_bias=bias,
        prefix="t2.experts",
    )
    assert layer.moe_plan.gate_path == "grouped_topk"
    _fill(layer, seed=1)
    x, logits = torch.randn(7, 8), torch.randn(7, 12)
    out = _forward(ctx, layer, x, logits)
    ref_layer = types.SimpleNamespace(w13_weight=layer.w13_weight.data, w2_weight=layer.w2_weight.data)
    expect = CPUFusedMOE(ref_layer)(
        ref_layer,
        x,
        True,
        3,
        logits,
        True,
        topk_group=2,
        num_expert_group=3,
        global_num_experts=12,
        scoring_func="sigmoid",
        routed_scaling_factor=1.5,
        e_score_correction_bias=bias.data,
    )
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


def test_eplb_layer_follows_vllm_state_and_counts_load(ctx):
    """``enable_eplb`` with 2 redundant experts: the layer holds 4 + 2 physical slots (vLLM's initial map), follows
    the tables vLLM's ``set_eplb_state`` hands it, counts each routed slot once, and computes vLLM's torch MoE."""
    from vllm.distributed.eplb.eplb_state import EplbState
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.layers.fused_moe.moe_torch_iterative import fused_moe
    from vllm_npu.ops.moe.eplb import eplb_tables

    layer = FusedMoE(
        num_experts=4,
        top_k=2,
        hidden_size=8,
        intermediate_size=4,
        params_dtype=torch.float32,
        renormalize=False,
        enable_eplb=True,
        num_redundant_experts=2,
        prefix="t3.experts",
    )
    assert layer.w13_weight.shape[0] == 6 and layer.expert_placement.slots == [[0, 1, 2, 3, 0, 1]]
    _fill(layer)
    layer.w13_weight.data[4:] = layer.w13_weight.data[:2]  # the redundant slots hold experts 0 and 1
    layer.w2_weight.data[4:] = layer.w2_weight.data[:2]
    physical = EplbState.build_initial_global_physical_to_logical_map(4, 2)
    table, counts = eplb_tables(physical, 4)
    load = torch.zeros(1, 6, dtype=torch.int32)
    layer.set_eplb_state(0, load, table.unsqueeze(0), counts.unsqueeze(0))  # [layers, ...] as EplbState's
    x, logits = torch.randn(9, 8), torch.randn(9, 4)
    out = _forward(ctx, layer, x, logits)
    expect = fused_moe(x, layer.w13_weight[:4], layer.w2_weight[:4], logits, 2, 4, renormalize=False)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    topk = torch.topk(logits, 2, dim=-1).indices
    logical = torch.zeros(4, dtype=torch.long).index_add_(0, torch.tensor(physical), load[0].long())
    assert logical.tolist() == torch.bincount(topk.flatten(), minlength=4).tolist()
    assert load[0, 4:].sum() > 0  # the replicas were used


def test_eplb_with_a_static_map_is_a_clear_error(ctx, tmp_path):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm_npu.interface import ConfigError

    ctx.additional_config = {"npu": {"expert_map_path": str(tmp_path / "map.json")}}
    with pytest.raises(ConfigError, match=r"npu\.expert_map_path.*--enable-eplb"):
        FusedMoE(
            num_experts=4,
            top_k=1,
            hidden_size=8,
            intermediate_size=4,
            params_dtype=torch.float32,
            enable_eplb=True,
            prefix="t3b.experts",
        )


def _deepseek_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=32,
        moe_intermediate_size=8,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
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


@pytest.mark.parametrize("num_tokens", [1, 13])
def test_vllm_deepseek_moe_block_matches_hf_deepseek_v3(ctx, num_tokens):
    """vLLM's DeepseekV2MoE (our AscendSharedFusedMoE inside) vs transformers' DeepseekV3MoE, same weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MoE
    from vllm_npu.ops.moe.layer import AscendSharedFusedMoE

    hf_cfg = _deepseek_config()
    torch.manual_seed(10)
    hf = DeepseekV3MoE(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
        # Positive biased scores: HF masks dropped groups with 0.0 where vLLM uses -inf; they agree when s+b > 0.
        hf.gate.e_score_correction_bias.uniform_(0.0, 0.1)
    ours = DeepseekV2MoE(hf_cfg, ctx.parallel_config, quant_config=None, prefix=f"t4_{num_tokens}.mlp")
    assert type(ours.experts) is AscendSharedFusedMoE
    assert ours.experts.moe_plan.gate_path == "grouped_topk"
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        for e, mlp in enumerate(hf.experts):
            ours.experts.w13_weight[e].copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            ours.experts.w2_weight[e].copy_(mlp.down_proj.weight)
        se = hf.shared_experts
        ours.shared_experts.gate_up_proj.weight.copy_(torch.cat([se.gate_proj.weight, se.up_proj.weight]))
        ours.shared_experts.down_proj.weight.copy_(se.down_proj.weight)
    ours.experts.quant_method.process_weights_after_loading(ours.experts)
    x = torch.randn(num_tokens, 32)
    out = _forward(ctx, ours, x)
    with torch.no_grad():
        expect = hf(x.unsqueeze(0)).squeeze(0)
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)
