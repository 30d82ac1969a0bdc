# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The lean reference twins (RMSNorm, add+RMSNorm, Gemma RMSNorm, SwiGLU, RoPE of q and k together) pinned to the
previous twins, kept here as oracles. The maths is the same in the same order (in-place variants of the same ops,
one element-wise pass over q|k instead of two), so every check is bit-identical (``torch.equal``). The golden tests
against float64 / HF / vLLM's forward_native keep their own tolerances in test_norm_activation_golden.py and
test_rope_golden.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from vllm_npu.ops.layernorm import add_rms_norm_reference, gemma_rms_norm_reference, rms_norm_reference
from vllm_npu.ops.rotary_embedding import rotary_mul_qk_reference, rotary_mul_reference
from vllm_npu.ops.swiglu import swiglu_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rms_oracle(x, gamma, eps):  # type: ignore[no-untyped-def]
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def _add_rms_oracle(x1, x2, gamma, eps):  # type: ignore[no-untyped-def]
    s = x1.float() + x2.float()
    rstd = torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (s * rstd * gamma.float()).to(x1.dtype), rstd, s.to(x1.dtype)


def _gemma_oracle(x, gamma, eps):  # type: ignore[no-untyped-def]
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * (1.0 + gamma.float())).to(x.dtype), rstd


def _swiglu_oracle(x):  # type: ignore[no-untyped-def]
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def _same(a, b) -> bool:  # type: ignore[no-untyped-def]
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8, 256), (3, 5, 64), (1, 4096)])
def test_norms_and_swiglu_bit_identical(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    gamma = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    x_before = x.clone()
    assert _same(rms_norm_reference(x, gamma, 1e-6), _rms_oracle(x, gamma, 1e-6))
    assert _same(add_rms_norm_reference(x, r, gamma, 1e-5), _add_rms_oracle(x, r, gamma, 1e-5))
    assert _same(gemma_rms_norm_reference(x, gamma, 1e-6), _gemma_oracle(x, gamma, 1e-6))
    assert _same(swiglu_reference(x), _swiglu_oracle(x))
    assert torch.equal(x, x_before)  # the in-place steps touch only temporaries


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["half", "interleave"])
@pytest.mark.parametrize("adjacent", [True, False])
def test_rope_qk_bit_identical_to_two_calls(dtype: torch.dtype, mode: str, adjacent: bool) -> None:
    t, n, nkv, d = 7, 8, 2, 32
    g = torch.Generator().manual_seed(3)
    cos = torch.randn(1, t, 1, d, generator=g).to(dtype)
    sin = torch.randn(1, t, 1, d, generator=g).to(dtype)
    if adjacent:  # q and k column slices of one fused qkv output, as in vLLM's attention layers
        qkv = torch.randn(t, (n + 2 * nkv) * d, generator=g).to(dtype)
        q, k = qkv[:, : n * d], qkv[:, n * d : (n + nkv) * d]
    else:
        q, k = torch.randn(t, n * d, generator=g).to(dtype), torch.randn(t, nkv * d, generator=g).to(dtype)
    q4, k4 = q.view(1, t, n, d), k.view(1, t, nkv, d)
    q_before, k_before = q.clone(), k.clone()
    qo, ko = rotary_mul_qk_reference(q4, k4, cos, sin, mode)
    assert _same(qo, rotary_mul_reference(q4, cos, sin, mode))
    assert _same(ko, rotary_mul_reference(k4, cos, sin, mode))
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # inputs untouched, outputs new
    assert qo.view_as(q).shape == q.shape and ko.view_as(k).shape == k.shape


def test_rope_qk_never_views_past_q_into_other_data() -> None:
    # k right after q in memory but with another row stride is not adjacent in the [T, N + Nkv, R] sense
    base = torch.randn(4 * 96)
    q = base[: 4 * 64].view(4, 64)
    k = base[4 * 64 :].view(4, 32)
    cos, sin = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 1, 16)
    qo, ko = rotary_mul_qk_reference(q.view(1, 4, 4, 16), k.view(1, 4, 2, 16), cos, sin, "half")
    assert _same(ko, rotary_mul_reference(k.view(1, 4, 2, 16), cos, sin, "half"))
    assert _same(qo, rotary_mul_reference(q.view(1, 4, 4, 16), cos, sin, "half"))
