# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Each scheme's forward on real vLLM linear layers (reference kernels) against float maths and the independent
simulation (:mod:`vllm_npu.quant.tools.simulate`).

Tensors go through vLLM's own weight loaders (QKV shards, row-parallel), then ``process_weights_after_loading``.
Bounds (float32, x ~ N(0, 1) [9, K], W ~ N(0, 0.2)):

- against the simulation of the same checkpoint tensors: max |Δ| <= 1e-4 * max|y| (same maths, different order);
- against the float layer, relative Frobenius error ||y_q - y_f|| / ||y_f||: W8A8_DYNAMIC <= 0.02,
  W8A8 (static, calibrated on x) <= 0.03, W4A8_DYNAMIC <= 0.15, W4A4_FLATQUANT <= 0.30 (int4 activations).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from vllm_npu.quant import kernels as K
from vllm_npu.quant.config import AscendQuantConfig
from vllm_npu.quant.description import QuantDescription
from vllm_npu.quant.tools.quantize_math import (
    flatquant_transforms,
    quantize_w4a4_flatquant,
    quantize_w4a8,
    quantize_w8a8,
    quantize_w8a8_dynamic,
)
from vllm_npu.quant.tools.simulate import SimulatedQuantLinear

H, HEAD, NH, NKV, INTER = 64, 16, 4, 2, 128
QKV = "model.layers.0.self_attn.qkv_proj"
DOWN = "model.layers.0.mlp.down_proj"
BOUND = {"W8A8_DYNAMIC": 0.02, "W8A8": 0.03, "W4A8_DYNAMIC": 0.15, "W4A4_FLATQUANT_DYNAMIC": 0.30}


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def quantize(
    qtype: str,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    x: torch.Tensor,
    row: bool,
    dtype: torch.dtype,
    version: str = "0",
) -> dict[str, torch.Tensor]:
    if qtype == "W8A8_DYNAMIC":
        return quantize_w8a8_dynamic(w, dtype)
    if qtype == "W8A8":
        return quantize_w8a8(w, bias, float(x.min()), float(x.max()), dtype)
    if qtype == "W4A8_DYNAMIC":
        return quantize_w4a8(w, 32, version, row, dtype)
    left, right = flatquant_transforms(w.shape[1], seed=3)
    return quantize_w4a4_flatquant(w, left, right, 1.0, dtype)


def description(qtype: str, shards: dict[str, dict[str, torch.Tensor]], version: str = "0") -> AscendQuantConfig:
    entries: dict[str, Any] = {f"{p}.{s}": qtype for p, ts in shards.items() for s in ts}
    entries.update(group_size=32, version=version)
    return AscendQuantConfig(QuantDescription.from_mapping(entries))


def build_qkv(qtype: str, dtype: torch.dtype = torch.float32, version: str = "0", seed: int = 0):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, H, generator=g).to(dtype)
    ws = {
        "q": torch.randn(NH * HEAD, H, generator=g) * 0.2,
        "k": torch.randn(NKV * HEAD, H, generator=g) * 0.2,
        "v": torch.randn(NKV * HEAD, H, generator=g) * 0.2,
    }
    bs = {s: torch.randn(w.shape[0], generator=g) * 0.05 for s, w in ws.items()}
    shards = {
        f"model.layers.0.self_attn.{s}_proj": quantize(qtype, ws[s], bs[s], x.float(), False, dtype, version)
        for s in ws
    }
    cfg = description(qtype, shards, version)
    layer = QKVParallelLinear(H, HEAD, NH, NKV, bias=True, params_dtype=dtype, quant_config=cfg, prefix=QKV)
    params = dict(layer.named_parameters())
    for s in ws:
        for suffix, t in shards[f"model.layers.0.self_attn.{s}_proj"].items():
            params[suffix].weight_loader(params[suffix], t, s)
        params["bias"].weight_loader(params["bias"], bs[s].to(dtype), s)
    layer.quant_method.process_weights_after_loading(layer)
    w_f = torch.cat([ws["q"], ws["k"], ws["v"]])
    b_f = torch.cat([bs["q"], bs["k"], bs["v"]])
    sims = [
        SimulatedQuantLinear(
            qtype, shards[f"model.layers.0.self_attn.{s}_proj"], bs[s], {"group_size": 32, "version": version}
        )
        for s in ws
    ]
    return layer, x, w_f, b_f, sims


def build_down(qtype: str, version: str = "0"):
    from vllm.model_executor.layers.linear import RowParallelLinear

    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, INTER, generator=g)
    w, b = torch.randn(H, INTER, generator=g) * 0.2, torch.randn(H, generator=g) * 0.05
    tensors = quantize(qtype, w, b, x, True, torch.float32, version)
    cfg = description(qtype, {DOWN: tensors}, version)
    layer = RowParallelLinear(INTER, H, bias=True, quant_config=cfg, prefix=DOWN)
    params = dict(layer.named_parameters())
    for suffix, t in tensors.items():
        params[suffix].weight_loader(params[suffix], t)
    params["bias"].weight_loader(params["bias"], b)
    layer.quant_method.process_weights_after_loading(layer)
    sim = SimulatedQuantLinear(qtype, tensors, b, {"group_size": 32, "version": version})
    return layer, x, w, b, sim


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


CASES = [
    ("W8A8_DYNAMIC", "0"),
    ("W8A8", "0"),
    ("W4A8_DYNAMIC", "0"),
    ("W4A8_DYNAMIC", "1.0.0"),
    ("W4A4_FLATQUANT_DYNAMIC", "0"),
]


@pytest.mark.parametrize("qtype, version", CASES)
def test_qkv_layer_matches_simulation_and_float(vllm_ctx: object, qtype: str, version: str) -> None:
    layer, x, w_f, b_f, sims = build_qkv(qtype, version=version)
    y, _ = layer(x)
    y_sim = torch.cat([s(x) for s in sims], dim=-1)
    assert float((y - y_sim).abs().max()) <= 1e-4 * float(y_sim.abs().max())
    assert rel(y, F.linear(x, w_f, b_f)) <= BOUND[qtype]


@pytest.mark.parametrize("qtype, version", CASES)
def test_row_parallel_layer_matches_simulation_and_float(vllm_ctx: object, qtype: str, version: str) -> None:
    layer, x, w, b, sim = build_down(qtype, version)
    y, _ = layer(x)
    y_sim = sim(x)
    assert float((y - y_sim).abs().max()) <= 1e-4 * float(y_sim.abs().max())
    assert rel(y, F.linear(x, w, b)) <= BOUND[qtype]


def test_w8a8_fp16_uses_int64_deq_scale(vllm_ctx: object) -> None:
    """fp16 checkpoints store deq_scale as int64 (FP19 bits); it is decoded at load and re-packed for the kernel."""
    layer, x, w_f, b_f, sims = build_qkv("W8A8", dtype=torch.float16)
    assert layer.deq_scale.dtype == torch.int64
    y, _ = layer(x)
    assert y.dtype == torch.float16
    y_sim = torch.cat([s(x.float()) for s in sims], dim=-1)
    # The kernel path multiplies by 1/input_scale rounded to fp16 (npu_quantize's scales have x's dtype), so a few
    # activations round to the neighbouring int8 step: one step of one element, hence the looser bound.
    assert float((y.float() - y_sim).abs().max()) <= 5e-3 * float(y_sim.abs().max())
    assert rel(y, F.linear(x.float(), w_f, b_f)) <= BOUND["W8A8"]


@pytest.mark.parametrize("qtype, version", CASES)
def test_bfloat16_layers(vllm_ctx: object, qtype: str, version: str) -> None:
    """The NPU dtype: bf16 activations and params; output bf16, within the float bound plus bf16 rounding."""
    layer, x, w_f, b_f, sims = build_qkv(qtype, dtype=torch.bfloat16, version=version)
    y, _ = layer(x)
    assert y.dtype == torch.bfloat16
    assert rel(y, F.linear(x.float(), w_f, b_f)) <= BOUND[qtype] + 0.02


def test_w8a8_quant_bias_only_on_tp_rank_0(vllm_ctx: object) -> None:
    """Row-parallel partial sums are all-reduced: quant_bias (offset correction + folded bias) is added once."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, INTER, generator=g), torch.randn(H, INTER, generator=g) * 0.2
    tensors = quantize_w8a8(w, torch.randn(H, generator=g), float(x.min()), float(x.max()), torch.float32)
    outs = []
    for rank in (0, 1):
        layer = RowParallelLinear(INTER, H, bias=False, quant_config=description("W8A8", {DOWN: tensors}), prefix=DOWN)
        params = dict(layer.named_parameters())
        for suffix, t in tensors.items():
            params[suffix].weight_loader(params[suffix], t)
        layer.tp_rank = rank  # as on the second rank of a TP=2 group (the loaders above used rank 0's shard)
        layer.quant_method.process_weights_after_loading(layer)
        outs.append(layer.quant_method.apply(layer, x))
    deq = tensors["deq_scale"].float()
    assert torch.allclose(outs[0] - outs[1], tensors["quant_bias"].float() * deq, atol=1e-4)


def test_three_dim_input_keeps_leading_dims(vllm_ctx: object) -> None:
    layer, x, *_ = build_qkv("W8A8_DYNAMIC")
    y3, _ = layer(x.reshape(3, 3, H))
    y2, _ = layer(x)
    assert y3.shape == (3, 3, y2.shape[-1]) and torch.allclose(y3.reshape_as(y2), y2)


# --- kernels on their own -----------------------------------------------------------------------------------------


def test_int4_packing_roundtrips() -> None:
    v = torch.randint(-8, 8, (5, 24), dtype=torch.int8)
    assert torch.equal(K.unpack_int4(K.pack_int4(v)), v)
    assert torch.equal(K.unpack_int4_pairs_dim0(K.pack_int4_pairs_dim0(v.t().contiguous())), v.t())
    # the v1.0.0 disk form viewed as int32 after a transpose is the same packing as pack_int4 along N
    w = torch.randint(-8, 8, (16, 6), dtype=torch.int8)  # [N, K]
    disk = K.pack_int4_pairs_dim0(w)  # [N/2, K]
    assert torch.equal(disk.t().contiguous().view(torch.int32), K.pack_int4(w.t().contiguous()))
    with pytest.raises(Exception, match="int4 values"):
        K.pack_int4(torch.full((1, 8), 9))


def test_int64_scale_roundtrip_is_fp19() -> None:
    s = torch.rand(17) + 1e-3
    packed = K.trans_quant_param.reference(s)
    assert packed.dtype == torch.int64
    assert torch.equal(K.decode_scale(packed), K.fp19_truncate(s))
    assert float(((K.fp19_truncate(s) - s) / s).abs().max()) < 2**-10


def test_dynamic_quant_error_within_half_step() -> None:
    x = torch.randn(6, 40) * 3
    y, s = K.dynamic_quant.reference(x)
    assert y.dtype == torch.int8 and s.shape == (6,)
    assert bool(((y.float() * s[:, None] - x).abs() <= s[:, None] / 2 + 1e-6).all())
    assert torch.equal(y.abs().amax(-1), torch.full((6,), 127, dtype=torch.int8))


def test_quant_matmul_is_exact_integer_maths() -> None:
    a = torch.randint(-128, 128, (5, 32), dtype=torch.int8)
    b = torch.randint(-128, 128, (32, 7), dtype=torch.int8)
    scale, tok = torch.rand(7), torch.rand(5)
    bias = torch.randint(-1000, 1000, (7,), dtype=torch.int32)
    out = K.quant_matmul.reference(a, b, scale, tok, bias, torch.float32)
    want = ((a.double() @ b.double()) + bias.double()) * scale.double() * tok.double()[:, None]
    assert torch.allclose(out.double(), want, rtol=1e-6)
    a4, b4 = torch.randint(-8, 8, (5, 32)), torch.randint(-8, 8, (7, 32))  # int4 form: x2 = [N, K/8]ᵀ
    out4 = K.quant_matmul.reference(K.pack_int4(a4), K.pack_int4(b4).t(), scale, None, None, torch.float32)
    assert torch.allclose(out4.double(), (a4.double() @ b4.double().t()) * scale.double(), rtol=1e-6)


def test_kronecker_quant_reference_is_the_kronecker_transform() -> None:
    """p1 @ X @ p2 with p1 = leftᵀ equals x @ (left ⊗ right) in row-major flattening; int4 error <= step / 2."""
    left, right = torch.randn(8, 8), torch.randn(16, 16)
    x = torch.randn(4, 128)
    q, s = K.kronecker_quant.reference(x.reshape(4, 8, 16), left.t(), right, 1.0)
    xt = x @ torch.kron(left, right)
    deq = K.unpack_int4(q).reshape(4, 128).float() * s[:, None]
    assert q.shape == (4, 8, 2) and q.dtype == torch.int32
    assert bool(((deq - xt).abs() <= s[:, None] / 2 + 1e-4).all())


def test_weight_quant_bmm_reference_per_group() -> None:
    w4 = torch.randint(-8, 8, (64, 16))  # [K, N]
    scale = torch.rand(2, 16) + 0.1  # group 32
    x = torch.randn(3, 64)
    y = K.weight_quant_batchmatmul.reference(x, K.pack_int4(w4), scale, 32)
    assert torch.allclose(y, x @ (w4.float() * scale.repeat_interleave(32, 0)), atol=1e-5)
