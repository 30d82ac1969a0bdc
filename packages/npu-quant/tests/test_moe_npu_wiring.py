# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The NPU path of the W8A8_DYNAMIC experts against a stand-in ``torch_npu`` that knows the documented dtype pairs.

``npu_grouped_matmul``'s per-token int8 mode takes a bfloat16 scale for bfloat16 output and a float32 scale for
float16 output, nothing else (the torch_npu 2.8.0 docs' data-type table, ``npu_testkit.npu_binding_rules``); the fake
rejects any other pair and otherwise computes the documented maths in float64. The experts on the NPU kernels must
then equal the experts on the reference kernels.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from npu_testkit import npu_binding_rules as rules
from vllm_npu.quant.moe_experts import W8A8DynamicExperts


def _fake_torch_npu(calls: list[str]) -> types.ModuleType:
    m = types.ModuleType("torch_npu")

    def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
        calls.append("npu_dynamic_quant")
        assert smooth_scales is None and group_index is None and dst_type is None
        scale = x.float().abs().amax(-1) / 127.0
        return torch.round(x.float() / scale.clamp_min(1e-30)[..., None]).clamp(-128, 127).to(torch.int8), scale

    def npu_grouped_matmul(
        x, weight, *, scale=None, per_token_scale=None, group_list=None, split_item=0, group_type=None,
        group_list_type=0, output_dtype=None, bias=None,
    ):  # fmt: skip
        calls.append("npu_grouped_matmul")
        (xx,), (w,), (s,), (tok,) = x, weight, scale, per_token_scale
        rules.grouped_matmul_quant_dtypes(s, tok, output_dtype, None if bias is None else bias[0])
        assert xx.dtype == w.dtype == torch.int8 and split_item == 2 and group_type == 0 and group_list_type == 1
        assert group_list.dtype == torch.int64 and int(group_list.sum()) == xx.shape[0]
        out, start = torch.empty(xx.shape[0], w.shape[-1], dtype=torch.float64), 0
        for g, n in enumerate(group_list.tolist()):
            acc = xx[start : start + n].double() @ w[g].double()
            out[start : start + n] = acc * s[g].double() * tok[start : start + n, None].double()
            start += n
        return [out.to(output_dtype)]

    m.npu_dynamic_quant = rules.documented(npu_dynamic_quant)
    m.npu_grouped_matmul = rules.documented(npu_grouped_matmul)
    return m


def _layer(e: int, h: int, i: int) -> torch.nn.Module:
    """Processed W8A8_DYNAMIC expert weights as moe_method leaves them: int8 ``[E, H, 2I]`` / ``[E, I, H]``, float32
    per-channel scales ``[E, N]``."""
    g = torch.Generator().manual_seed(11)
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.randint(-127, 128, (e, h, 2 * i), dtype=torch.int8, generator=g), False)
    layer.w2_weight = torch.nn.Parameter(torch.randint(-127, 128, (e, i, h), dtype=torch.int8, generator=g), False)
    layer.w13_weight_scale = torch.nn.Parameter(torch.rand(e, 2 * i, generator=g) * 1e-3 + 1e-4, False)
    layer.w2_weight_scale = torch.nn.Parameter(torch.rand(e, h, generator=g) * 1e-3 + 1e-4, False)
    return layer


def _silu_mul(x: torch.Tensor) -> torch.Tensor:
    a, b = x.float().chunk(2, -1)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8a8_dynamic_experts_on_npu_kernels(monkeypatch, dtype: torch.dtype) -> None:
    """Issue #42: the float32 load-time scales must reach the kernel as bfloat16 for a bfloat16 model."""
    layer = _layer(3, 32, 16)
    rows = (torch.randn(7, 32, generator=torch.Generator().manual_seed(2)) * 0.5).to(dtype)
    counts = torch.tensor([3, 0, 4])
    ref = W8A8DynamicExperts(layer, _silu_mul)(rows, counts)
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
    monkeypatch.setattr("vllm_npu.interface.device.kernel_backend", lambda: "npu")
    out = W8A8DynamicExperts(layer, _silu_mul)(rows, counts)
    assert calls == ["npu_dynamic_quant", "npu_grouped_matmul"] * 2
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
