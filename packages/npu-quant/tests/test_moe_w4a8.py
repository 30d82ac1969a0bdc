# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""W4A8_DYNAMIC experts as vllm-ascend v0.11.0 runs them on hardware (int8 rows x int4 weights, :mod:`moe_w4a8`).

- the reference twin of ``npu_grouped_matmul`` (int8 x int4, int64 scale, float32 bias) against plain quantized maths
  written here: with the load-time scale bias the kernel's activation offset cancels (``y = s * xq @ W_deq``);
  without it the offset shows (the contract the bias exists for);
- the load-time layout against vllm-ascend's construction (numpy uint32 pairs viewed as int64, float16-rounded
  ``s1 * s2``; int4 values 8 per int32, value j in bits 4j..4j+3, what a 1.0.0 checkpoint's bytes viewed as int32 are);
- the NPU twin against the stand-in ``torch_npu`` (the documented signature, the mode's dtypes and shapes);
- the checkpoint side: ``vllm-npu quantize`` writes the real 1.0.0 ``scale_bias``, a wrong one is refused at load, the
  simulation computes the expert linears with int8 activations (the dense ones stay weight-only).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from npu_testkit.fake_torch_npu import fake_torch_npu
from npu_testkit.npu_binding_rules import BindingRuleError
from quant_moe_harness import PREFIX, TOP_K, E, G, H, build, float_experts
from vllm_npu.interface import KernelContractError
from vllm_npu.quant import kernels
from vllm_npu.quant.moe_w4a8 import (
    _grouped_a8w4_npu,
    a8w4_bias,
    a8w4_scale,
    grouped_a8w4_matmul,
    process_a8w4_expert_weight,
)
from vllm_npu.quant.params import QuantLoadError
from vllm_npu.quant.tools.quantize_math import quantize_w4a8


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def _experts(seed: int, e: int = 3, n: int = 16, k: int = 64, group: int = 16):
    g = torch.Generator().manual_seed(seed)
    w4 = torch.randint(-8, 8, (e, n, k), generator=g, dtype=torch.int8)  # checkpoint layout [E, N, K]
    s1 = torch.rand(e, n, 1, generator=g) * 1e-2 + 1e-3
    s2 = torch.rand(e, n, k // group, generator=g) * 10 + 1
    return w4, s1, s2


def _rows(seed: int, counts: list[int], k: int = 64):
    g = torch.Generator().manual_seed(seed)
    m = sum(counts)
    xq = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    return xq, torch.rand(m, generator=g) * 1e-2, torch.tensor(counts)


def _plain(xq, pertoken, counts, w4, scale_f, offset_bias):
    """Row by row: ``pertoken * (xq @ (W4 * scale)ᵀ + offset_bias)``, float64 (scale_f [E, N, K] float)."""
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        w = (w4[e].double() * scale_f[e].double()).t()  # [K, N]
        out.append(pertoken[start : start + c, None].double() * (xq[start : start + c].double() @ w + offset_bias[e]))
        start += c
    return torch.cat(out)


def test_twin_with_the_load_time_bias_is_plain_quantized_maths() -> None:
    """The processed weights through the twin: ``y = s_token * xq @ (W4 * fp16(s1 * s2))ᵀ`` plus the (tiny) residual
    of the bias computed from the unrounded scales, as vllm-ascend does; an empty expert in the middle."""
    w4, s1, s2 = _experts(0)
    xq, pertoken, counts = _rows(1, [5, 0, 4])
    weight, scale, bias = process_a8w4_expert_weight(w4, s1, s2, None)
    y = grouped_a8w4_matmul.reference(xq, weight, scale, bias, pertoken, counts, torch.float32)
    s_fp16 = (s1 * s2).half().float().repeat_interleave(16, dim=2)  # [E, N, K]
    residual = 8 * (w4.double() * (s1 * s2.repeat_interleave(16, dim=2)).double()).sum(-1) - 8 * (
        w4.double() * s_fp16.double()
    ).sum(-1)
    want = _plain(xq, pertoken, counts, w4, s_fp16, residual)
    assert float((y.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    # the residual is rounding only: against the unrounded scales the result is within float16's precision
    exact = _plain(xq, pertoken, counts, w4, s1 * s2.repeat_interleave(16, dim=2), torch.zeros(3, 16))
    assert float((y.double() - exact).abs().max()) <= 2e-3 * float(exact.abs().max())


def test_twin_without_the_bias_shows_the_kernels_activation_offset() -> None:
    """The int4 split of the rows (``x = 16 hi + lo + 8``) leaves ``- 8 * sum_k W4 * S``: the scale bias' reason."""
    w4, s1, s2 = _experts(2)
    xq, pertoken, counts = _rows(3, [2, 3, 1])
    weight, scale, _ = process_a8w4_expert_weight(w4, s1, s2, None)
    zero = torch.zeros(3, 16)
    y = grouped_a8w4_matmul.reference(xq, weight, scale, zero, pertoken, counts, torch.float32)
    s = kernels.decode_scale(scale).transpose(1, 2).repeat_interleave(16, dim=2)  # [E, N, K]
    want = _plain((xq.to(torch.int16) - 8), pertoken, counts, w4, s, zero)
    assert float((y.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_rows_past_the_counts_are_zero_and_bad_operands_are_refused() -> None:
    w4, s1, s2 = _experts(4)
    xq, pertoken, _ = _rows(5, [3, 3, 3])
    weight, scale, bias = process_a8w4_expert_weight(w4, s1, s2, None)
    full = grouped_a8w4_matmul.reference(xq, weight, scale, bias, pertoken, torch.tensor([3, 3, 3]), torch.bfloat16)
    short = grouped_a8w4_matmul.reference(xq, weight, scale, bias, pertoken, torch.tensor([3, 3, 1]), torch.bfloat16)
    assert full.dtype == torch.bfloat16 and torch.equal(short[:7], full[:7]) and not short[7:].any()
    with pytest.raises(KernelContractError, match="scale int64"):
        grouped_a8w4_matmul.reference(xq, weight, scale.float(), bias, pertoken, torch.tensor([3, 3, 3]), torch.float32)


def test_load_time_layout_is_vllm_ascends() -> None:
    """vllm-ascend v0.11.0 ``quantization/w4a8_dynamic.py:399-434``: float16-rounded ``s1 * s2`` as uint32 in the even
    halves of a uint32 pair array viewed as int64 ``[E, G, N]``; bias ``8 * sum_k W4 * s1 * s2``."""
    w4, s1, s2 = _experts(6)
    scale = a8w4_scale(s1, s2)
    s = (s1.transpose(1, 2) * s2.transpose(1, 2)).to(torch.float16).to(torch.float32).numpy().copy()
    s.dtype = np.uint32
    pairs = np.zeros((*s.shape[:2], s.shape[2] * 2), dtype=np.uint32)
    pairs[..., ::2] = s
    want = torch.from_numpy(np.frombuffer(pairs.tobytes(), dtype=np.int64).copy()).reshape(scale.shape)
    assert scale.dtype == torch.int64 and torch.equal(scale, want)
    wk = w4.transpose(1, 2).float()  # vllm-ascend's transposed [E, K, N]
    high = (wk.reshape(3, 4, 16, 16) * s2.transpose(1, 2).reshape(3, 4, 1, 16)).reshape(3, 64, 16)
    assert torch.allclose(a8w4_bias(w4, s1, s2), 8 * (high * s1.transpose(1, 2)).sum(1), rtol=1e-5, atol=1e-6)
    # int4 values 8 per int32 along N: the 1.0.0 checkpoint's bytes (two per byte along N, even index low) as int32
    weight, _, _ = process_a8w4_expert_weight(w4, s1, s2, None)
    disk = torch.stack([kernels.pack_int4_pairs_dim0(w4[e]) for e in range(3)])  # [E, N/2, K]
    assert torch.equal(weight, disk.transpose(1, 2).contiguous().view(torch.int32))


def test_npu_twin_calls_the_documented_mode_on_the_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NPU twin through the stand-in ``torch_npu`` (signature-checked): equal to the reference for bfloat16 and
    float16 output; float32 output (no such kernel) and a float scale (not the mode's operands) are refused."""
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(quant=True, checked=True))
    w4, s1, s2 = _experts(7)
    xq, pertoken, counts = _rows(8, [4, 1, 2])
    weight, scale, bias = process_a8w4_expert_weight(w4, s1, s2, None)
    for dt in (torch.bfloat16, torch.float16):
        got = _grouped_a8w4_npu(xq, weight, scale, bias, pertoken, counts, dt)
        assert torch.equal(got, grouped_a8w4_matmul.reference(xq, weight, scale, bias, pertoken, counts, dt))
    with pytest.raises(KernelContractError, match="--dtype bfloat16"):
        _grouped_a8w4_npu(xq, weight, scale, bias, pertoken, counts, torch.float32)
    with pytest.raises(BindingRuleError, match="scale must be int64"):
        _grouped_a8w4_npu(xq, weight, kernels.decode_scale(scale), bias, pertoken, counts, torch.bfloat16)


def test_quantizer_writes_the_kernels_scale_bias() -> None:
    """Version 1.0.0: ``scale_bias`` is ``8 * sum_k W4 * s1 * s2``, in 16 partial sums over K for row-parallel layers."""
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(9)) * 0.1
    for row_parallel, cols in ((False, 1), (True, 16)):
        t = quantize_w4a8(w, 16, "1.0.0", row_parallel, torch.float32)
        w4 = kernels.unpack_int4_pairs_dim0(t["weight"])[None]
        want = a8w4_bias(w4, t["weight_scale"][None], t["weight_scale_second"][None])[0]
        assert t["scale_bias"].shape == (32, cols)
        assert torch.allclose(t["scale_bias"].sum(-1), want, rtol=1e-5, atol=1e-6)
        if row_parallel:  # chunk c covers K columns 4c..4c+3
            chunk = 8 * (w4[0, :, :4].float() * t["weight_scale"] * t["weight_scale_second"][:, :1]).sum(-1)
            assert torch.allclose(t["scale_bias"][:, 0], chunk, rtol=1e-5, atol=1e-6)


def test_a_wrong_packed_scale_bias_is_refused(vllm_ctx: object, tp1_group: None) -> None:
    """A 1.0.0 checkpoint with zero scale bias (what `vllm-npu quantize` wrote before) would shift every expert
    output by ``8 * s_token * sum_k W4 * S``: refused at load, naming the tensor and the fix."""
    weights = float_experts(seed=3)
    v1 = {k: quantize_w4a8(w, G, "1.0.0", k[1] == "down_proj", torch.float32) for k, w in weights.items()}
    for e in range(E):
        v1[(e, "down_proj")]["scale_bias"] = torch.zeros_like(v1[(e, "down_proj")]["scale_bias"])
    layer = build("W4A8_DYNAMIC", v1, version="1.0.0")
    with pytest.raises(QuantLoadError, match=rf"{PREFIX}\.w2_scale_bias is not 8 \* sum_k.*re-export"):
        layer.quant_method.process_weights_after_loading(layer)


def test_processed_experts_run_the_npu_kernels_like_the_reference(
    vllm_ctx: object, tp1_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded layer's experts on the NPU kernels (stand-in ``torch_npu``: npu_dynamic_quant, the A8W4 grouped
    matmul) equal the same experts on the reference kernels, bfloat16 rows."""
    from vllm_npu.quant.moe_w4a8 import W4A8DynamicExperts

    weights = float_experts(seed=5)
    v0 = {k: quantize_w4a8(w, G, "0", False, torch.float32) for k, w in weights.items()}
    layer = build("W4A8_DYNAMIC", v0)
    layer.quant_method.process_weights_after_loading(layer)
    act = layer.quant_method._plan.activation
    rows = torch.randn(7, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    counts = torch.tensor([2, 0, 4, 1])
    ref = W4A8DynamicExperts(layer, act)(rows, counts)
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(quant=True, checked=True))
    monkeypatch.setattr("vllm_npu.interface.device.kernel_backend", lambda: "npu")
    npu = W4A8DynamicExperts(layer, act)
    assert npu._gmm.__name__ == "_grouped_a8w4_npu"
    assert torch.equal(npu(rows, counts), ref)
    assert TOP_K == 2  # the harness' routing, unchanged by this module


def test_simulation_runs_experts_int8_and_dense_layers_weight_only() -> None:
    from vllm_npu.quant.tools.simulate import SimulatedQuantLinear

    t = quantize_w4a8(
        torch.randn(16, 32, generator=torch.Generator().manual_seed(2)) * 0.1, 16, "0", False, torch.float32
    )
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(3))
    settings = {"group_size": 16, "version": "0"}
    dense = SimulatedQuantLinear("W4A8_DYNAMIC", t, None, settings)(x)
    expert = SimulatedQuantLinear("W4A8_DYNAMIC", t, None, settings, expert=True)(x)
    w_deq = t["weight"].float() * t["weight_scale"] * t["weight_scale_second"].repeat_interleave(16, dim=1)
    assert torch.allclose(dense, x @ w_deq.t(), atol=1e-6)
    s = x.abs().amax(-1, keepdim=True) / 127
    want = s * (torch.round(x / s) @ w_deq.t())  # the bias cancels the offset up to the float16 rounding of scales
    assert float((expert - want).abs().max()) <= 2e-3 * float(want.abs().max())
    assert not torch.allclose(expert, dense, atol=1e-6)  # the int8 activations are simulated


def test_scales_outside_float16_are_refused_at_load(vllm_ctx: object, tp1_group: None) -> None:
    """The kernel's scales are float16-rounded (as vllm-ascend's): a product that underflows to 0 would zero its
    weights on the NPU, so it is refused, naming both tensors."""
    weights = float_experts(seed=3)
    v0 = {k: quantize_w4a8(w, G, "0", False, torch.float32) for k, w in weights.items()}
    v0[(1, "gate_proj")]["weight_scale"] = v0[(1, "gate_proj")]["weight_scale"] * 1e-8
    layer = build("W4A8_DYNAMIC", v0)
    with pytest.raises(QuantLoadError, match=rf"{PREFIX}\.w13_weight_scale \* w13_weight_scale_second leaves float16"):
        layer.quant_method.process_weights_after_loading(layer)
