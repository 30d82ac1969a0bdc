# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Golden tests: RMSNorm (+ fused residual add), GemmaRMSNorm, SiluAndMul, QuickGELU references vs vLLM's
forward_native and HF transformers, in fp32/fp16/bf16 on odd shapes (1 token, non-power-of-two hidden sizes).

Tolerances (atol = rtol): fp32 1e-5, fp16 2e-3, bf16 1.6e-2. Our references compute in fp32 and round once; vLLM's
native code rounds some intermediates to the input dtype, so half precision may differ by about one output ulp.
"""

from __future__ import annotations

import pytest
import torch

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
SHAPES = pytest.mark.parametrize("tokens,hidden", [(1, 72), (7, 1030), (3, 4096)])


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@DTYPES
@SHAPES
def test_rms_norm_matches_vllm_and_hf(vllm_ctx, dtype, tokens, hidden) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm_npu.ops.layernorm import NPURMSNorm, rms_norm_reference

    layer = RMSNorm(hidden, eps=1e-6).to(dtype)
    assert type(layer) is NPURMSNorm and layer._norm is rms_norm_reference
    with torch.no_grad():
        layer.weight.copy_(1.0 + 0.1 * _rand(hidden, dtype=torch.float32, seed=1))
    x = _rand(tokens, hidden, dtype=dtype)
    out = layer(x)  # dispatches to forward_oot on our platform
    assert out.dtype == dtype
    close(out, layer.forward_native(x), dtype)

    hf = LlamaRMSNorm(hidden, eps=1e-6).to(dtype)
    hf.weight.data.copy_(layer.weight.data)
    close(out, hf(x), dtype)


@DTYPES
@SHAPES
def test_fused_add_rms_norm_matches_vllm(vllm_ctx, dtype, tokens, hidden) -> None:
    from vllm.model_executor.layers.layernorm import RMSNorm

    layer = RMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(1.0 + 0.1 * _rand(hidden, dtype=torch.float32, seed=2))
    x, residual = _rand(tokens, hidden, dtype=dtype, seed=3), _rand(tokens, hidden, dtype=dtype, seed=4)
    x0, r0 = x.clone(), residual.clone()
    out, new_residual = layer(x, residual)
    ref_out, ref_residual = layer.forward_native(x0.clone(), r0.clone())
    close(out, ref_out, dtype)
    close(new_residual, ref_residual, dtype)
    assert torch.equal(x, x0) and torch.equal(residual, r0), "inputs must not be modified"


def test_add_rms_norm_kernel_contract() -> None:
    """(y, rstd, x_sum): rstd fp32 [..., 1], x_sum in the input dtype, y computed from the unrounded sum."""
    from vllm_npu.ops.layernorm import add_rms_norm_reference, rms_norm_reference

    x1, x2 = _rand(2, 5, 40, dtype=torch.bfloat16), _rand(2, 5, 40, dtype=torch.bfloat16, seed=9)
    gamma = _rand(40, dtype=torch.bfloat16, seed=5)
    y, rstd, s = add_rms_norm_reference(x1, x2, gamma, 1e-6)
    assert y.shape == (2, 5, 40) and y.dtype == torch.bfloat16
    assert rstd.shape == (2, 5, 1) and rstd.dtype == torch.float32
    assert s.dtype == torch.bfloat16 and torch.equal(s, (x1.float() + x2.float()).to(torch.bfloat16))
    y2, rstd2 = rms_norm_reference((x1.float() + x2.float()), gamma, 1e-6)
    torch.testing.assert_close(rstd, rstd2)
    torch.testing.assert_close(y.float(), y2.float(), atol=1.6e-2, rtol=1.6e-2)


def test_rms_norm_unsupported_variants_keep_vllm_native(vllm_ctx) -> None:
    from vllm.model_executor.layers.layernorm import RMSNorm

    partial = RMSNorm(64, var_hidden_size=32)
    no_weight = RMSNorm(64, has_weight=False)
    for layer in (partial, no_weight):
        assert layer._forward_method == layer.forward_native
    x = _rand(1, 2, 64, dtype=torch.float32)
    torch.testing.assert_close(partial(x), RMSNorm.forward_native(partial, x))


@DTYPES
@SHAPES
def test_gemma_rms_norm_matches_vllm_and_hf(vllm_ctx, dtype, tokens, hidden) -> None:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm
    from vllm_npu.ops.layernorm import NPUGemmaRMSNorm

    layer = GemmaRMSNorm(hidden, eps=1e-6).to(dtype)
    assert type(layer) is NPUGemmaRMSNorm
    with torch.no_grad():
        layer.weight.copy_(0.1 * _rand(hidden, dtype=torch.float32, seed=6))
    x, residual = _rand(tokens, hidden, dtype=dtype, seed=7), _rand(tokens, hidden, dtype=dtype, seed=8)
    close(layer(x), layer.forward_native(x), dtype)
    out, res = layer(x, residual)
    ref_out, ref_res = layer.forward_native(x, residual)
    close(out, ref_out, dtype)
    close(res, ref_res, dtype)  # vLLM keeps an fp32 residual for fp16 input; ours stays fp16 (within 1 ulp)
    hf = HFGemmaRMSNorm(hidden, eps=1e-6).to(dtype)
    hf.weight.data.copy_(layer.weight.data)
    close(layer(x), hf(x), dtype)


@DTYPES
@pytest.mark.parametrize("shape", [(1, 2 * 37), (5, 2 * 100), (2, 3, 2 * 48)])
def test_silu_and_mul_matches_vllm_and_hf(vllm_ctx, dtype, shape) -> None:
    from transformers.activations import ACT2FN
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm_npu.ops.activation import NPUSiluAndMul

    act = SiluAndMul()
    assert type(act) is NPUSiluAndMul
    x = _rand(*shape, dtype=dtype)
    out = act(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    close(out, act.forward_native(x), dtype)
    d = shape[-1] // 2
    close(out, ACT2FN["silu"](x[..., :d]) * x[..., d:], dtype)


def test_silu_and_mul_rejects_odd_width(vllm_ctx) -> None:
    from vllm.model_executor.layers.activation import SiluAndMul

    with pytest.raises(ValueError, match="even last dimension"):
        SiluAndMul()(torch.ones(2, 7))


@DTYPES
@pytest.mark.parametrize("shape", [(1, 37), (5, 1000)])
def test_quick_gelu_matches_vllm_and_hf(vllm_ctx, dtype, shape) -> None:
    from transformers.activations import ACT2FN
    from vllm.model_executor.layers.activation import QuickGELU
    from vllm_npu.ops.activation import NPUQuickGELU

    act = QuickGELU()
    assert type(act) is NPUQuickGELU
    x = 3 * _rand(*shape, dtype=dtype)
    close(act(x), act.forward_native(x), dtype)
    close(act(x), ACT2FN["quick_gelu"](x), dtype)
