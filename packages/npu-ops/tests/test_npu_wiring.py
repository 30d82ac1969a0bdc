# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The NPU side of every override, run against a stand-in ``torch_npu`` (no Ascend hardware here).

The stand-in checks each call against torch_npu 2.8.0's documented signature (parsed from the wheel by
``npu_testkit.torch_npu_docs``: positional count, keyword names, required parameters) and computes the documented
formula independently. Layers are built with their NPU kernels, so this proves the wiring the AST contract check
cannot see: argument order and values at run time, and how each layer unpacks the op's outputs. It does not prove
the Ascend kernels' numerics (that needs an NPU).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from npu_testkit.npu_binding_rules import ACL_FORMAT_FRACTAL_NZ, NZFormats
from npu_testkit.torch_npu_docs import load_docs


def _rms(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.double()
    rstd = 1.0 / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps)
    return xf * rstd, rstd.float()


def _rotate(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "half":
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    out = torch.empty_like(x)
    out[..., ::2], out[..., 1::2] = -x[..., 1::2], x[..., ::2]
    return out


class FakeTorchNPU(types.ModuleType):
    """``torch_npu`` with documented-signature checks and the documented formulas (float64 math)."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.docs = load_docs()
        self.calls: list[str] = []
        self.formats = NZFormats()  # FRACTAL_NZ tensors may not be reshaped (npu_binding_rules.NZFormats)

    def _check(self, name: str, args: tuple, kwargs: dict) -> None:
        problems = self.docs.check_call("", name, len(args), list(kwargs))
        assert not problems, problems
        self.calls.append(name)

    def npu_rms_norm(self, *a, **k):
        self._check("npu_rms_norm", a, k)
        x, gamma, eps = a[0], a[1], (a[2] if len(a) > 2 else k.get("epsilon", 1e-6))
        n, rstd = _rms(x, eps)
        return (n * gamma.double()).to(x.dtype), rstd

    def npu_add_rms_norm(self, *a, **k):
        self._check("npu_add_rms_norm", a, k)
        x1, x2, gamma, eps = a[0], a[1], a[2], (a[3] if len(a) > 3 else k.get("epsilon", 1e-6))
        s = x1.double() + x2.double()
        n, rstd = _rms(s, eps)
        return (n * gamma.double()).to(x1.dtype), rstd, s.to(x1.dtype)

    def npu_gemma_rms_norm(self, *a, **k):
        self._check("npu_gemma_rms_norm", a, k)
        x, gamma, eps = a[0], a[1], (a[2] if len(a) > 2 else k.get("epsilon", 1e-6))
        n, rstd = _rms(x, eps)
        return (n * (1.0 + gamma.double())).to(x.dtype), rstd

    def npu_swiglu(self, *a, **k):
        self._check("npu_swiglu", a, k)
        x, dim = a[0], (a[1] if len(a) > 1 else k.get("dim", -1))
        g, u = x.double().chunk(2, dim=dim)
        return (g * torch.sigmoid(g) * u).to(x.dtype)

    def npu_fast_gelu(self, *a, **k):
        self._check("npu_fast_gelu", a, k)
        x = a[0].double()
        return (x / (1 + torch.exp(-1.702 * x))).to(a[0].dtype)

    def npu_rotary_mul(self, *a, **k):
        self._check("npu_rotary_mul", a, k)
        x, r1, r2 = a[:3]
        mode = a[3] if len(a) > 3 else k.get("rotary_mode", "half")
        assert x.dim() == 4 and r1.dim() == 4 and r1.shape[2] == 1, "BSND input with 1S1D cos/sin"
        xd = x.double()
        return (r1.double() * xd + r2.double() * _rotate(xd, mode)).to(x.dtype)

    def npu_mrope(self, *a, **k):
        self._check("npu_mrope", a, k)
        positions, q, key, cache, head_size = a[:5]
        section, mode = k.get("mrope_section", [0, 0, 0]), k.get("rotary_mode", "half")
        assert q.dim() == 2 and key.dim() == 2, "npu_mrope takes 2-D query/key"
        cos, sin = cache.double()[positions].chunk(2, dim=-1)
        if positions.dim() == 2:
            bounds = [0, section[0], section[0] + section[1], sum(section)]
            cos = torch.cat([cos[i, :, bounds[i] : bounds[i + 1]] for i in range(3)], dim=-1)
            sin = torch.cat([sin[i, :, bounds[i] : bounds[i + 1]] for i in range(3)], dim=-1)
        else:
            assert list(section) == [0, 0, 0]
        cos, sin = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
        r = cache.shape[-1]

        def apply(x: torch.Tensor) -> torch.Tensor:
            x3 = x.double().view(x.shape[0], -1, head_size)
            rot = x3[..., :r] * cos + _rotate(x3[..., :r], mode) * sin
            return torch.cat((rot, x3[..., r:]), -1).reshape(x.shape).to(x.dtype)

        return apply(q), apply(key)

    def npu_format_cast(self, *a, **k):
        self._check("npu_format_cast", a, k)
        return self.formats.cast(a[0], a[1])


@pytest.fixture
def fake_npu(monkeypatch, vllm_ctx):

    fake = FakeTorchNPU()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    # Layers pick their kernel when built: build them with the NPU backend.
    monkeypatch.setattr("vllm_npu.interface.device.kernel_backend", lambda: "npu")
    with fake.formats:
        yield fake


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def test_norms_on_npu_kernels(fake_npu) -> None:
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    from vllm_npu.ops import layernorm

    norm, gemma = RMSNorm(40), GemmaRMSNorm(40)
    assert norm._norm is layernorm.rms_norm_npu and norm._add_norm is layernorm.add_rms_norm_npu
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 40))
        gemma.weight.copy_(torch.linspace(-0.2, 0.2, 40))
    x, r = torch.randn(3, 40), torch.randn(3, 40)
    _close(norm(x), norm.forward_native(x))
    out, res = norm(x, r)
    ref_out, ref_res = norm.forward_native(x, r)
    _close(out, ref_out)
    _close(res, ref_res)
    _close(gemma(x), gemma.forward_native(x))
    _close(gemma(x, r)[0], gemma.forward_native(x, r)[0])
    assert fake_npu.calls == ["npu_rms_norm", "npu_add_rms_norm", "npu_gemma_rms_norm", "npu_gemma_rms_norm"]


def test_activations_on_npu_kernels(fake_npu) -> None:
    from vllm.model_executor.layers.activation import QuickGELU, SiluAndMul

    x = torch.randn(2, 3, 18)
    _close(SiluAndMul()(x), F.silu(x[..., :9]) * x[..., 9:])
    _close(QuickGELU()(x), x * torch.sigmoid(1.702 * x))
    with pytest.raises(ValueError, match="even last dimension"):
        SiluAndMul()(torch.ones(2, 7))  # rejected before the kernel launch
    assert fake_npu.calls == ["npu_swiglu", "npu_fast_gelu"]


@pytest.mark.parametrize("neox,rot", [(True, 32), (False, 32), (True, 16)], ids=["neox", "gptj", "partial"])
def test_rope_on_npu_kernel(fake_npu, neox, rot) -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    rope = RotaryEmbedding(32, rot, 512, 10000.0, neox, torch.float32)
    pos = torch.tensor([0, 7, 300, 511, 2])
    q, k = torch.randn(5, 3 * 32), torch.randn(5, 32)
    out_q, out_k = rope(pos, q, k)
    ref_q, ref_k = rope.forward_native(pos, q.clone(), k.clone())
    _close(out_q, ref_q)
    _close(out_k, ref_k)
    assert fake_npu.calls == ["npu_rotary_mul", "npu_rotary_mul"]


def test_mrope_on_npu_kernel(fake_npu) -> None:
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

    rope = MRotaryEmbedding(32, 32, 256, 10000.0, True, torch.float32, mrope_section=[4, 6, 6])
    assert rope.uses_mrope_kernel
    q, k = torch.randn(6, 2 * 32), torch.randn(6, 32)
    pos3 = torch.randint(0, 1000, (3, 6))
    for pos in (pos3, pos3[1]):
        out_q, out_k = rope(pos, q, k)
        ref_q, ref_k = rope.forward_native(pos, q.clone(), k.clone())
        _close(out_q, ref_q)
        _close(out_k, ref_k)
    assert fake_npu.calls == ["npu_mrope", "npu_mrope"]


def _mla_impl(kv_b_proj, n: int, lora: int, nope: int, rope: int, v: int, kind: str = "mla"):
    from types import SimpleNamespace

    from vllm_npu.attention.backends.mla import AscendMLAImpl
    from vllm_npu.attention.backends.sfa import AscendSFAImpl

    extra = (
        {"indexer": SimpleNamespace(topk_indices_buffer=torch.zeros(4, 2, dtype=torch.int32))} if kind == "sfa" else {}
    )
    return (AscendSFAImpl if kind == "sfa" else AscendMLAImpl)(
        n, lora + rope, 0.1, 1, None, None, "auto", None, "decoder", None,
        q_lora_rank=None, kv_lora_rank=lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        qk_head_dim=nope + rope, v_head_dim=v, kv_b_proj=kv_b_proj, **extra,
    )  # fmt: skip


def _expected_split(w: torch.Tensor, n: int, lora: int, nope: int, v: int):
    """``W_UK_T [N, P, L]`` and ``W_UV [N, L, V]`` recomputed from the checkpoint weight ``[N * (P + V), L]``."""
    per_head = w.T.reshape(lora, n, nope + v)
    return per_head[..., :nope].permute(1, 2, 0), per_head[..., nope:].transpose(0, 1)


def test_mla_kv_b_proj_is_split_from_an_nd_weight(fake_npu, tp1_group) -> None:
    """Issue #27: the loader runs the linear layer's post-load step, then the MLA impl's, which ``.T/.view/.split``s
    ``kv_b_proj.weight`` into ``W_UK_T``/``W_UV``; that reshape must see an ND weight, never a FRACTAL_NZ one."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    n, lora, nope, rope, v = 2, 16, 8, 4, 6
    kv_b_proj = ColumnParallelLinear(lora, n * (nope + v), bias=False, params_dtype=torch.bfloat16)
    w = torch.randn(n * (nope + v), lora).to(torch.bfloat16)
    with torch.no_grad():
        kv_b_proj.weight.copy_(w)
    kv_b_proj.quant_method.process_weights_after_loading(kv_b_proj)
    impl = _mla_impl(kv_b_proj, n, lora, nope, rope, v)
    impl.process_weights_after_loading(torch.bfloat16)
    uk_t, uv = _expected_split(w, n, lora, nope, v)
    assert torch.equal(impl.W_UK_T, uk_t) and torch.equal(impl.W_UV, uv)
    x = torch.randn(3, lora).to(torch.bfloat16)
    _close(kv_b_proj(x)[0], x @ w.T, tol=1e-2)


@pytest.mark.parametrize("kind", ["mla", "sfa"])
def test_mla_impl_reverts_an_nz_kv_b_proj_to_nd_before_the_split(fake_npu, kind: str) -> None:
    """Whatever left ``kv_b_proj.weight`` in FRACTAL_NZ (a quant method, ``allow_internal_format`` set elsewhere),
    the impl casts it back to ND before vLLM reshapes it, as vllm-ascend v0.11.0 does."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    n, lora, nope, rope, v = 2, 16, 8, 4, 6
    w = torch.randn(n * (nope + v), lora)
    kv_b_proj = torch.nn.Module()
    kv_b_proj.weight = torch.nn.Parameter(fake_npu.formats.cast(w, ACL_FORMAT_FRACTAL_NZ), requires_grad=False)
    kv_b_proj.quant_method = UnquantizedLinearMethod()
    impl = _mla_impl(kv_b_proj, n, lora, nope, rope, v, kind)
    impl.process_weights_after_loading(torch.float32)
    uk_t, uv = _expected_split(w, n, lora, nope, v)
    assert torch.equal(impl.W_UK_T, uk_t) and torch.equal(impl.W_UV, uv)
    assert fake_npu.formats.format_of(kv_b_proj.weight) != ACL_FORMAT_FRACTAL_NZ
