# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The ops that differ on an Ascend 310P: the chip picks them, the NPU sequence is vllm-ascend's 310P one (checked
against a stand-in ``torch_npu`` written from the documented contracts), and the twins model it."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from vllm_npu.interface import reset_chip
from vllm_npu.ops.chip_310p import (
    ADD_RMS_NORM_310P,
    SWIGLU_310P,
    add_rms_norm_310p_npu,
    add_rms_norm_kernel,
    swiglu_310p_npu,
    swiglu_kernel,
)
from vllm_npu.ops.layernorm import ADD_RMS_NORM, rms_norm_reference
from vllm_npu.ops.swiglu import SWIGLU

SEEN: list[tuple[str, torch.dtype]] = []


def _npu_swiglu(x, dim=-1):
    SEEN.append(("npu_swiglu", x.dtype))
    a, b = x.chunk(2, dim)
    return F.silu(a) * b  # documented: A * sigmoid(A) * B, in the input's dtype


def _npu_rms_norm(x, gamma, epsilon=1e-6):
    SEEN.append(("npu_rms_norm", x.dtype))
    return rms_norm_reference(x, gamma, epsilon)  # documented: fp32 maths, cast once; rstd fp32


@pytest.fixture
def fake_torch_npu(monkeypatch):
    SEEN.clear()
    monkeypatch.setitem(
        sys.modules, "torch_npu", types.SimpleNamespace(npu_swiglu=_npu_swiglu, npu_rms_norm=_npu_rms_norm)
    )


@pytest.fixture
def soc(monkeypatch):
    def set_soc(value: str) -> None:
        monkeypatch.setenv("VLLM_NPU_EMULATED_SOC", value)
        reset_chip()

    yield set_soc
    monkeypatch.delenv("VLLM_NPU_EMULATED_SOC", raising=False)
    reset_chip()


def test_the_chip_picks_the_pairs(soc):
    soc("310P")
    assert swiglu_kernel() is SWIGLU_310P and add_rms_norm_kernel() is ADD_RMS_NORM_310P
    from vllm_npu.ops.layernorm import NPURMSNorm

    assert NPURMSNorm(8)._add_norm is ADD_RMS_NORM_310P.reference
    soc("none")
    assert swiglu_kernel() is SWIGLU and add_rms_norm_kernel() is ADD_RMS_NORM
    assert NPURMSNorm(8)._add_norm is ADD_RMS_NORM.reference


def test_310p_swiglu_runs_the_npu_kernel_in_float32(fake_torch_npu):
    x = torch.randn(5, 16, dtype=torch.float16)
    y = swiglu_310p_npu(x)
    assert [("npu_swiglu", torch.float32)] == SEEN and y.dtype == torch.float16
    torch.testing.assert_close(y, SWIGLU_310P.reference(x), atol=0, rtol=0)
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu_310p_npu(torch.randn(2, 3, dtype=torch.float16))


def test_310p_add_rms_norm_is_an_add_in_the_input_dtype_then_the_norm(fake_torch_npu):
    g = torch.Generator().manual_seed(0)
    x1, x2 = (torch.randn(7, 64, generator=g).mul_(300).half() for _ in range(2))
    gamma = torch.randn(64, generator=g).half()
    y, rstd, summed = add_rms_norm_310p_npu(x1, x2, gamma, 1e-6)
    assert [("npu_rms_norm", torch.float16)] == SEEN
    assert torch.equal(summed, x1 + x2)  # the residual the next layer gets: rounded to float16
    ref = ADD_RMS_NORM_310P.reference(x1, x2, gamma, 1e-6)
    for got, want in zip((y, rstd, summed), ref):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    # The A2/A3 twin keeps the sum in float32 (the fused kernel): another rounding, another answer.
    fused = ADD_RMS_NORM.reference(x1, x2, gamma, 1e-6)
    assert not torch.equal(fused[1], rstd)


def test_the_310p_selftest_runs_the_chips_pairs_in_float16(soc):
    from vllm_npu.ops.moe.experts import GROUPED_MATMUL
    from vllm_npu.ops.moe.gating import TOPK_SOFTMAX
    from vllm_npu.ops.moe.routing import INIT_ROUTING, INIT_ROUTING_310P
    from vllm_npu.ops.selftest import selftest_cases

    soc("310P")
    rows = selftest_cases()
    kernels = {c.kernel.name for c in rows}
    assert {c.dtype for c in rows} == {"float16"}
    assert {SWIGLU_310P.name, ADD_RMS_NORM_310P.name, INIT_ROUTING_310P.name, GROUPED_MATMUL.name} <= kernels
    assert not {SWIGLU.name, ADD_RMS_NORM.name, TOPK_SOFTMAX.name, INIT_ROUTING.name} & kernels
    soc("none")
    assert {SWIGLU.name, TOPK_SOFTMAX.name, INIT_ROUTING.name, INIT_ROUTING_310P.name} <= {
        c.kernel.name for c in selftest_cases()
    }
