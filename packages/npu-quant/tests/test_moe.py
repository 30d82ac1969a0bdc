# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Quantized FusedMoE experts on a real vLLM ``FusedMoE`` layer (reference kernels, npu-ops' MoE forward).

Experts are loaded per expert and shard through ``FusedMoE.weight_loader`` (wrapped by our validating loader).
Reference: plain torch written here: softmax top-2 with renormalisation, per-expert SwiGLU MLP, with either float
weights (bound: relative Frobenius error <= 0.03 for W8A8_DYNAMIC, <= 0.05 for static W8A8 (per-tensor ranges, measured 0.038), <= 0.25 for W4A8_DYNAMIC: two int4 matmuls in a row, measured 0.17) or the same quantized
maths (per-token or static int8 activations; W4A8: int8 activations x int4 weights with float16-rounded scales, as
the hardware kernel; max |Δ| <= 1e-4 * max|y|); the W4A8 format 1.0.0 (packed) experts load to the format-0
tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from quant_moe_harness import INTER, PREFIX, TOP_K, E, G, H, build, float_experts, quantized
from vllm_npu.quant.params import QuantLoadError
from vllm_npu.quant.tools.quantize_math import quantize_w4a8


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def reference(x: torch.Tensor, logits: torch.Tensor, linear) -> torch.Tensor:
    w, ids = torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            e = int(ids[t, j])
            h = F.silu(linear(x[t : t + 1], e, "gate_proj")) * linear(x[t : t + 1], e, "up_proj")
            out[t] += w[t, j] * linear(h, e, "down_proj")[0]
    return out


def sim_linear(qtype: str, tensors):
    def lin(x: torch.Tensor, e: int, proj: str) -> torch.Tensor:
        t = tensors[(e, proj)]
        if qtype == "W8A8_DYNAMIC":
            s = x.abs().amax(-1, keepdim=True) / 127
            return (torch.round(x / s) @ t["weight"].float().t()) * t["weight_scale"].reshape(-1) * s
        if qtype == "W8A8":
            xq = torch.clamp(torch.round(x / t["input_scale"] + t["input_offset"]), -128, 127)
            return (xq @ t["weight"].float().t() + t["quant_bias"].float()) * t["deq_scale"]
        # W4A8_DYNAMIC experts: int8 per-token activations x int4 weights (the hardware kernel), written out as plain
        # quantized maths: y = s * (xq @ W4 * fp16(s1 * s2)) (+ the bias' residual against the fp16-rounded scales)
        s = x.abs().amax(-1, keepdim=True) / 127
        w_full = t["weight_scale"] * t["weight_scale_second"].repeat_interleave(G, dim=1)
        w4 = t["weight"].float()
        residual = 8 * (w4 * w_full).sum(1) - 8 * (w4 * w_full.half().float()).sum(1)
        return s * (torch.round(x / s) @ (w4 * w_full.half().float()).t() + residual)

    return lin


@pytest.mark.parametrize("qtype, bound", [("W8A8_DYNAMIC", 0.03), ("W8A8", 0.05), ("W4A8_DYNAMIC", 0.25)])
def test_quantized_experts_match_maths(vllm_ctx: object, tp1_group: None, qtype: str, bound: float) -> None:
    weights = float_experts()
    tensors = quantized(qtype, weights)
    layer = build(qtype, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    g = torch.Generator().manual_seed(7)
    x, logits = torch.randn(11, H, generator=g), torch.randn(11, E, generator=g)
    y = layer.quant_method.apply(layer, x, logits, TOP_K, True)
    y_sim = reference(x, logits, sim_linear(qtype, tensors))
    assert float((y - y_sim).abs().max()) <= 1e-4 * float(y_sim.abs().max())
    y_f = reference(x, logits, lambda v, e, p: v @ weights[(e, p)].t())
    assert float((y - y_f).norm() / y_f.norm()) <= bound


def test_missing_expert_shard_is_named(vllm_ctx: object, tp1_group: None) -> None:
    tensors = quantized("W8A8_DYNAMIC", float_experts())
    layer = build("W8A8_DYNAMIC", tensors, skip=(2, "up_proj"))
    with pytest.raises(QuantLoadError, match=rf"{PREFIX}\.w13_weight \(7/8 expert shards\)"):
        layer.quant_method.process_weights_after_loading(layer)


def test_float_expert_weight_is_rejected(vllm_ctx: object, tp1_group: None) -> None:
    tensors = quantized("W8A8_DYNAMIC", float_experts())
    tensors[(1, "down_proj")]["weight"] = torch.randn(H, INTER)
    with pytest.raises(QuantLoadError, match=rf"'{PREFIX}\.1\.down_proj\.weight'.*float32"):
        build("W8A8_DYNAMIC", tensors)


def _set(value: float) -> Any:
    return lambda t: torch.full_like(t, value)


def _poke(value: int) -> Any:
    def f(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = value
        return t

    return f


@pytest.mark.parametrize(
    "qtype, projs, suffix, change, message",
    [
        ("W8A8_DYNAMIC", ("up_proj",), "weight_offset", _set(1.0), r"w13_weight_offset has non-zero values"),
        ("W8A8_DYNAMIC", ("down_proj",), "weight_scale", _set(0.0), r"w2_weight_scale must be finite and > 0"),
        (
            "W4A8_DYNAMIC",
            ("gate_proj",),
            "weight",
            _poke(9),
            r"w13_weight \(int4 values\) must hold values in \[-8, 7\]",
        ),
        (
            "W4A8_DYNAMIC",
            ("down_proj",),
            "weight_scale_second",
            _set(-1.0),
            r"w2_weight_scale / _second must be finite",
        ),
        ("W4A8_DYNAMIC", ("down_proj",), "weight_offset_second", _set(0.5), r"w2_weight_offset_second has non-zero"),
        ("W8A8", ("gate_proj", "up_proj"), "input_scale", _set(0.0), r"w13_input_scale must be finite and > 0"),
        ("W8A8", ("down_proj",), "deq_scale", _set(-1.0), r"w2_deq_scale must be finite and > 0"),
    ],
)
def test_bad_expert_values_are_refused_at_load(
    vllm_ctx: object, tp1_group: None, qtype: str, projs: tuple[str, ...], suffix: str, change: Any, message: str
) -> None:
    tensors = quantized(qtype, float_experts())
    for proj in projs:  # gate_proj and up_proj share one input scale: change both
        tensors[(2, proj)][suffix] = change(tensors[(2, proj)][suffix])
    layer = build(qtype, tensors)
    with pytest.raises(QuantLoadError, match=rf"{PREFIX}\.{message}"):
        layer.quant_method.process_weights_after_loading(layer)


def test_packed_w4a8_experts_equal_format_0(vllm_ctx: object, tp1_group: None) -> None:
    """Format 1.0.0 (two int4 per int8 along the output dim, plus scale_bias) holds the same int4 values as format 0:
    after load both layers carry identical processed tensors and give identical outputs."""
    weights = float_experts(seed=3)
    v0 = {k: quantize_w4a8(w, G, "0", False, torch.float32) for k, w in weights.items()}
    v1 = {k: quantize_w4a8(w, G, "1.0.0", k[1] == "down_proj", torch.float32) for k, w in weights.items()}
    assert v1[(0, "gate_proj")]["weight"].shape == (INTER // 2, H) and v1[(0, "down_proj")]["scale_bias"].shape == (
        H,
        16,
    )
    layers = [
        build("W4A8_DYNAMIC", v0),
        build("W4A8_DYNAMIC", v1, version="1.0.0", prefix="model.layers.1.mlp.experts"),
    ]
    assert layers[1].w13_weight.shape == (E, INTER, H) and layers[1].w2_weight.shape == (E, H // 2, INTER)
    for layer in layers:
        layer.quant_method.process_weights_after_loading(layer)
    for name in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
        assert torch.equal(getattr(layers[0], name), getattr(layers[1], name)), name
    # the checkpoint's scale bias (partial sums over 16 chunks of K for w2) equals the one computed for format 0
    for name in ("w13_scale_bias", "w2_scale_bias"):
        assert torch.allclose(getattr(layers[0], name), getattr(layers[1], name), rtol=1e-5, atol=1e-6), name
    g = torch.Generator().manual_seed(11)
    x, logits = torch.randn(9, H, generator=g), torch.randn(9, E, generator=g)
    y0, y1 = (layer.quant_method.apply(layer, x, logits, TOP_K, True) for layer in layers)
    assert float((y0 - y1).abs().max()) <= 1e-5 * float(y0.abs().max())
    y_sim = reference(x, logits, sim_linear("W4A8_DYNAMIC", v0))
    assert float((y1 - y_sim).abs().max()) <= 1e-4 * float(y_sim.abs().max())


def test_static_w8a8_gate_up_input_scales_must_agree(vllm_ctx: object, tp1_group: None) -> None:
    tensors = quantized("W8A8", float_experts())
    tensors[(3, "up_proj")]["input_scale"] = tensors[(3, "up_proj")]["input_scale"] * 2
    with pytest.raises(QuantLoadError, match=r"w13_input_scale: expert 3 has different gate_proj / up_proj"):
        build("W8A8", tensors)


def test_static_w8a8_experts_refuse_tensor_parallel_split(vllm_ctx: object, tp1_group: None) -> None:
    layer = build("W8A8", quantized("W8A8", float_experts()))
    layer.moe_parallel_config.tp_size = 2  # what a tp=2 engine without expert parallelism would give
    with pytest.raises(QuantLoadError, match="enable expert parallelism"):
        layer.quant_method.process_weights_after_loading(layer)


def test_grouped_matmul_twins_match_per_row_maths_with_empty_groups() -> None:
    """The int8 grouped-matmul reference twins against row-by-row maths (group 1 empty; rows sorted by group);
    rows past the counts (the expert-parallel graph path) come out zero; a count list that does not fit the rows is
    refused."""
    from vllm_npu.quant.moe_experts import grouped_quant_matmul, grouped_static_matmul

    g = torch.Generator().manual_seed(5)
    counts = torch.tensor([2, 0, 3])
    group_of = [0, 0, 2, 2, 2]
    xq = torch.randint(-128, 128, (5, 16), dtype=torch.int8, generator=g)
    w8 = torch.randint(-128, 128, (3, 16, 8), dtype=torch.int8, generator=g)
    scale, tok = torch.rand(3, 8, generator=g), torch.rand(5, generator=g)
    bias = torch.randint(-500, 500, (3, 8), dtype=torch.int32, generator=g)

    y = grouped_quant_matmul.reference(xq, w8, scale, tok, counts, torch.float32)
    ys = grouped_static_matmul.reference(xq, w8, scale, bias, counts, torch.float32)
    for r, e in enumerate(group_of):
        acc = xq[r].double() @ w8[e].double()
        assert torch.allclose(y[r].double(), acc * scale[e].double() * float(tok[r]), rtol=1e-6)
        assert torch.allclose(ys[r].double(), (acc + bias[e].double()) * scale[e].double(), rtol=1e-6)
    short = torch.tensor([2, 0, 2])  # the last row belongs to no group
    for out, full in (
        (grouped_quant_matmul.reference(xq, w8, scale, tok, short, torch.float32), y),
        (grouped_static_matmul.reference(xq, w8, scale, bias, short, torch.float32), ys),
    ):
        assert torch.equal(out[:4], full[:4]) and not out[4].any()
    with pytest.raises(ValueError, match=r"counts \[2, 0, 4\] do not fit 5 rows / 3 groups"):
        grouped_quant_matmul.reference(xq, w8, scale, tok, torch.tensor([2, 0, 4]), torch.float32)


def test_row_experts_gathers_each_rows_expert_on_the_device() -> None:
    """Static W8A8 experts' per-row scales: each sorted row's expert from the counts (empty experts skipped); rows
    past the counts (the expert-parallel graph path) get the last expert."""
    from vllm_npu.quant.moe_experts import row_experts

    counts = torch.tensor([2, 0, 3, 1])
    assert row_experts(counts, 6).tolist() == torch.arange(4).repeat_interleave(counts).tolist() == [0, 0, 2, 2, 2, 3]
    assert row_experts(counts, 8).tolist() == [0, 0, 2, 2, 2, 3, 3, 3]
    assert row_experts(torch.tensor([0, 0, 1]), 2).tolist() == [2, 2]


def test_every_moe_method_runs_the_layer_plan() -> None:
    """They declare npu-interface's LayerMoEPlanRunner (apply runs ``layer.moe_plan``), so npu-ops' layer may give
    the plan its all-to-all dispatcher under data-parallel attention, as for unquantised experts; and
    MoEGraphTraceable, so the torchair mode traces their layers (test_moe_graph.py)."""
    from vllm_npu.interface import runs_layer_moe_plan, traces_moe_in_graph
    from vllm_npu.ops.moe import AscendUnquantizedFusedMoEMethod
    from vllm_npu.quant.moe_method import (
        AscendW4A8DynamicFusedMoEMethod,
        AscendW8A8DynamicFusedMoEMethod,
        AscendW8A8FusedMoEMethod,
    )

    for cls in (AscendW8A8DynamicFusedMoEMethod, AscendW4A8DynamicFusedMoEMethod, AscendW8A8FusedMoEMethod):
        assert runs_layer_moe_plan(cls) and traces_moe_in_graph(cls), cls
    assert runs_layer_moe_plan(AscendUnquantizedFusedMoEMethod) and traces_moe_in_graph(AscendUnquantizedFusedMoEMethod)
