# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Static W8A8 linear layers on an Ascend 310P (the emulated one): the weight keeps ``[N, K]``, is cast to NZ at load
and reaches ``npu_quant_matmul`` transposed, as vllm-ascend v0.11.0 runs it there; the answer is the quant
simulation's, in float16 (the chip's dtype)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from test_schemes import BOUND, HEAD, NH, NKV, H, build_qkv, rel
from vllm_npu.interface import reset_chip
from vllm_npu.quant import kernels as K

CALLS: list[tuple[str, tuple[int, ...], bool]] = []


@pytest.fixture(autouse=True)
def soc_310p(monkeypatch) -> Iterator[None]:
    monkeypatch.setenv("VLLM_NPU_EMULATED_SOC", "310P")
    reset_chip()
    with torch.no_grad():
        yield
    monkeypatch.delenv("VLLM_NPU_EMULATED_SOC")
    reset_chip()


def test_310p_w8a8_keeps_n_by_k_weights_and_matches_the_simulation(vllm_ctx: object) -> None:
    layer, x, w_f, b_f, sims = build_qkv("W8A8", dtype=torch.float16)
    assert layer.weight.shape == ((NH + 2 * NKV) * HEAD, H)  # [N, K]: not transposed at load on a 310P
    y, _ = layer(x)
    y_sim = torch.cat([s(x.float()) for s in sims], dim=-1)
    assert y.dtype == torch.float16
    assert float((y.float() - y_sim).abs().max()) <= 5e-3 * float(y_sim.abs().max())  # as test_schemes' fp16 case
    assert rel(y, F.linear(x.float(), w_f, b_f)) <= BOUND["W8A8"]


def _npu_format_cast(input, acl_format, customize_dtype=None):  # noqa: A002  (the documented parameter name)
    CALLS.append(("npu_format_cast", tuple(input.shape), acl_format == 29))
    return input


def _npu_quant_matmul(x1, x2, scale, *, pertoken_scale=None, bias=None, output_dtype=None, **kwargs):
    CALLS.append(("npu_quant_matmul", tuple(x2.shape), x2.is_contiguous()))
    return K.quant_matmul.reference(x1, x2, scale, pertoken_scale, bias, output_dtype)


def test_310p_npu_calls_cast_to_nz_and_take_the_transpose(monkeypatch) -> None:
    from npu_testkit import npu_binding_rules as rules

    fake = types.ModuleType("torch_npu")
    fake.npu_format_cast = rules.documented(_npu_format_cast, name="npu_format_cast")
    fake.npu_quant_matmul = rules.documented(_npu_quant_matmul, name="npu_quant_matmul")
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    CALLS.clear()
    w = torch.randint(-128, 128, (48, 64), dtype=torch.int8)
    nz = K.weight_to_nz.npu(w)
    x = torch.randint(-128, 128, (5, 64), dtype=torch.int8)
    scale = torch.rand(48) + 0.5
    out = K.quant_matmul.npu(x, nz.transpose(1, 0), scale, None, None, torch.float16)
    assert CALLS == [("npu_format_cast", (48, 64), True), ("npu_quant_matmul", (64, 48), False)]
    torch.testing.assert_close(out, K.quant_matmul.reference(x, w.t().contiguous(), scale, None, None, torch.float16))
