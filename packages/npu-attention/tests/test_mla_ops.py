# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Golden tests of the MLA kernel references (vLLM's forward_native and plain math as the truth)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm")

from vllm_npu.attention.ops.mla_attention import (  # noqa: E402
    merge_attention_states,
    mla_decode_npu,
    mla_decode_reference,
    ring_mla_npu,
    ring_mla_reference,
)
from vllm_npu.attention.ops.mla_cache import (  # noqa: E402
    deinterleave,
    kv_rmsnorm_rope_cache_reference,
    latent_cache_planes,
    paged_cache_load_reference,
)
from vllm_npu.interface import KernelContractError  # noqa: E402


def test_planes_are_contiguous_and_disjoint() -> None:
    cache = torch.zeros(5, 16, 40)
    nope, rope = latent_cache_planes(cache, 32, 8)
    assert nope.shape == (5, 16, 1, 32) and rope.shape == (5, 16, 1, 8)
    assert nope.is_contiguous() and rope.is_contiguous()
    nope.fill_(1.0)
    rope.fill_(2.0)
    assert int((cache == 1).sum()) == 5 * 16 * 32 and int((cache == 2).sum()) == 5 * 16 * 8
    with pytest.raises(KernelContractError, match="kv_lora_rank"):
        latent_cache_planes(cache, 30, 8)


def test_fused_norm_rope_write_matches_hf_and_vllm() -> None:
    """``npu_kv_rmsnorm_rope_cache`` semantics: HF DeepSeek-V3's RMSNorm on the latent and its interleaved RoPE
    (``apply_rotary_pos_emb_interleave``: de-interleave, then NeoX rotation) on k_pe. vLLM rotates the same channels
    GPT-J style in place; the two layouts differ by the de-interleave permutation and give the same q.k products."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RMSNorm,
        apply_rotary_pos_emb_interleave,
    )
    from vllm.model_executor.layers.rotary_embedding.common import apply_rotary_emb_torch

    torch.manual_seed(0)
    T, L, R, eps = 11, 32, 8, 1e-6
    kv = torch.randn(T, L + R)
    positions = torch.randint(0, 200, (T,)).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, R, 2).float() / R))
    freqs = positions[:, None] * inv_freq[None, :]  # [T, R/2]
    half_cos, half_sin = freqs.cos(), freqs.sin()
    cos, sin = torch.cat([half_cos, half_cos], -1), torch.cat([half_sin, half_sin], -1)

    norm = DeepseekV3RMSNorm(L, eps=eps)
    norm.weight.data.uniform_(0.5, 1.5)
    want_c = norm(kv[:, :L])
    q = torch.randn(T, R)
    hf_q, hf_k = apply_rotary_pos_emb_interleave(
        q.view(1, 1, T, R), kv[:, L:].reshape(1, 1, T, R), cos[None], sin[None]
    )
    vllm_q = apply_rotary_emb_torch(q.view(T, 1, R), half_cos, half_sin, is_neox_style=False).view(T, R)
    vllm_k = apply_rotary_emb_torch(kv[:, L:].reshape(T, 1, R), half_cos, half_sin, is_neox_style=False).view(T, R)

    cache = torch.zeros(4, 16, L + R)
    nope, rcache = latent_cache_planes(cache, L, R)
    slots = torch.tensor([3, 17, 18, 40, -1, 5, 6, 7, 60, 61, 33])
    k_pe, kv_c = kv_rmsnorm_rope_cache_reference(kv, norm.weight.data, cos, sin, slots, nope, rcache, eps)

    torch.testing.assert_close(kv_c, want_c, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_pe, hf_k.view(T, R), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_pe, deinterleave(vllm_k), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close((vllm_q * vllm_k).sum(-1), (hf_q.view(T, R) * k_pe).sum(-1), atol=1e-5, rtol=1e-5)
    ok = slots >= 0
    torch.testing.assert_close(nope.view(-1, L)[slots[ok]], kv_c[ok])
    torch.testing.assert_close(rcache.view(-1, R)[slots[ok]], k_pe[ok])
    assert not nope.view(-1, L)[[i for i in range(64) if i not in slots[ok].tolist()]].any()


def test_paged_cache_load_gathers_request_slices_in_order() -> None:
    torch.manual_seed(1)
    nope = torch.randn(8, 4, 1, 6)
    rope = torch.randn(8, 4, 1, 2)
    bt = torch.tensor([[5, 2, 7, 0], [3, 1, 0, 0], [6, 4, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([5, 0, 3], dtype=torch.int32)
    starts = torch.tensor([4, 0, 4], dtype=torch.int32)
    kv_c, k_pe = paged_cache_load_reference(nope, rope, bt, lens, starts)
    want = []
    for b in range(3):
        for p in range(int(starts[b]), int(starts[b] + lens[b])):
            want.append(int(bt[b, p // 4]) * 4 + p % 4)
    torch.testing.assert_close(kv_c, nope.view(-1, 6)[want])
    torch.testing.assert_close(k_pe, rope.view(-1, 2)[want])


def test_ring_steps_merged_by_lse_equal_one_pass() -> None:
    """Attention over [context | new] in one pass == new (causal) then context chunks, merged by LSE."""
    torch.manual_seed(2)
    N, P, R, V = 3, 8, 4, 5
    q_lens, ctx_lens = [4, 1, 6], [7, 0, 12]
    T = sum(q_lens)
    qn, qr = torch.randn(T, N, P), torch.randn(T, N, R)
    new = [(torch.randn(q, N, P), torch.randn(q, 1, R), torch.randn(q, N, V)) for q in q_lens]
    ctx = [(torch.randn(c, N, P), torch.randn(c, 1, R), torch.randn(c, N, V)) for c in ctx_lens]
    scale = 0.4

    def cat(parts, i):
        return torch.cat([p[i] for p in parts])

    full = [tuple(torch.cat([c[i], n[i]]) for i in range(3)) for c, n in zip(ctx, new, strict=True)]
    want, want_lse = ring_mla_reference(
        qn,
        qr,
        cat(full, 0),
        cat(full, 1),
        cat(full, 2),
        q_lens,
        [c + q for c, q in zip(ctx_lens, q_lens, strict=True)],
        scale,
        True,
    )
    out, lse = ring_mla_reference(qn, qr, cat(new, 0), cat(new, 1), cat(new, 2), q_lens, q_lens, scale, True)
    for lo, hi in [(0, 5), (5, 12)]:  # two context chunks
        part = [tuple(t[lo:hi] for t in c) for c in ctx]
        out, lse = ring_mla_reference(
            qn, qr, cat(part, 0), cat(part, 1), cat(part, 2), q_lens, [p[0].shape[0] for p in part], scale, False,
            prev_out=out, prev_lse=lse,
        )  # fmt: skip
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_merge_with_empty_side_is_identity() -> None:
    out = torch.randn(2, 3, 4)
    lse = torch.randn(3, 2)
    empty_out, empty_lse = torch.zeros(2, 3, 4), torch.full((3, 2), float("-inf"))
    m, mlse = merge_attention_states(out, lse, empty_out, empty_lse)
    torch.testing.assert_close(m, out)
    torch.testing.assert_close(mlse, lse)
    m, mlse = merge_attention_states(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.all(m == 0) and torch.all(torch.isinf(mlse))


def test_decode_reference_equals_plain_softmax_per_request() -> None:
    torch.manual_seed(3)
    B, N, L, R, bs = 3, 2, 8, 4, 16
    cache = torch.randn(6, bs, L + R)
    nope, rope = latent_cache_planes(cache, L, R)
    bt = torch.tensor([[4, 2], [1, 0], [5, 3]], dtype=torch.int32)
    lens = [20, 3, 32]
    ql, qp = torch.randn(B, N, L), torch.randn(B, N, R)
    got = torch.full((B, N, L), float("nan"))
    assert mla_decode_reference(ql, qp, nope, rope, bt, lens, 0.3, out=got) is None
    for b in range(B):
        slots = [int(bt[b, p // bs]) * bs + p % bs for p in range(lens[b])]
        kc, kr = nope.view(-1, L)[slots], rope.view(-1, R)[slots]
        p = torch.softmax(0.3 * (ql[b] @ kc.T + qp[b] @ kr.T), -1)
        torch.testing.assert_close(got[b], p @ kc, atol=1e-5, rtol=1e-5)


def test_npu_twins_refuse_shapes_outside_the_documented_limits() -> None:
    """The NPU kernels document fixed MLA sizes; other shapes fail loudly before any torch_npu call."""
    cache = torch.zeros(4, 16, 48)
    nope, rope = latent_cache_planes(cache, 32, 16)
    with pytest.raises(KernelContractError, match="kv_lora_rank 512"):
        mla_decode_npu(
            torch.zeros(1, 4, 32), torch.zeros(1, 4, 16), nope, rope, torch.zeros(1, 1, dtype=torch.int32), [1], 1.0,
            out=torch.zeros(1, 4, 32),
        )  # fmt: skip
    z = torch.zeros(2, 4, 24)
    with pytest.raises(KernelContractError, match="qk_nope_head_dim 128"):
        ring_mla_npu(z, torch.zeros(2, 4, 16), z, torch.zeros(2, 1, 16), torch.zeros(2, 4, 20), [2], [2], 1.0, True)


def test_scale_is_applied_once() -> None:
    q = torch.randn(1, 1, 4)
    k = torch.randn(2, 1, 4)
    v = torch.randn(2, 1, 3)
    out, lse = ring_mla_reference(q, torch.zeros(1, 1, 0), k, torch.zeros(2, 1, 0), v, [1], [2], 0.5, False)
    s = 0.5 * (k[:, 0] @ q[0, 0])
    torch.testing.assert_close(lse[0, 0], torch.logsumexp(s, 0))
    torch.testing.assert_close(out[0, 0], torch.softmax(s, 0) @ v[:, 0])
    assert math.isfinite(float(lse[0, 0]))
