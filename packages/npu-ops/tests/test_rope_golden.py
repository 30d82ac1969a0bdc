# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Golden tests: rotary embedding overrides vs vLLM's forward_native (and HF for plain NeoX RoPE), in
fp32/fp16/bf16, NeoX and GPT-J styles, full and partial rotary_dim, 1 token and odd token counts; and the
once-per-forward cos/sin cache.

Tolerances (atol = rtol): fp32 1e-5, fp16 2e-3, bf16 1.6e-2 (ours computes in fp32, vLLM in the input dtype);
positions go up to 4000 so the cos/sin of large angles are exercised.
"""

from __future__ import annotations

import pytest
import torch

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _qkp(tokens: int, heads: int, kv_heads: int, head: int, dtype: torch.dtype, max_pos: int = 4096, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads * head, generator=g).to(dtype)
    k = torch.randn(tokens, kv_heads * head, generator=g).to(dtype)
    pos = torch.randint(0, max_pos, (tokens,), generator=g)
    return pos, q, k


@DTYPES
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head,rot", [(64, 64), (64, 32), (80, 40)])
@pytest.mark.parametrize("tokens", [1, 13])
def test_rotary_embedding_matches_vllm(vllm_ctx, dtype, neox, head, rot, tokens) -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm_npu.ops.rotary_embedding import NPURotaryEmbedding

    rope = RotaryEmbedding(head, rot, 4096, 10000.0, neox, dtype)
    assert type(rope) is NPURotaryEmbedding
    pos, q, k = _qkp(tokens, 3, 1, head, dtype)
    q0, k0 = q.clone(), k.clone()
    out_q, out_k = rope(pos, q, k)
    ref_q, ref_k = rope.forward_native(pos, q0.clone(), k0.clone())
    close(out_q, ref_q, dtype)
    close(out_k, ref_k, dtype)
    # 3-D [T, N, D] inputs and key=None follow vLLM's contract too
    out3, none = rope(pos, q.view(tokens, 3, head))
    assert none is None and out3.shape == (tokens, 3, head)
    close(out3.reshape(tokens, -1), ref_q, dtype)


def test_rotary_embedding_matches_hf_llama(vllm_ctx) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    head, heads, kv, tokens = 32, 4, 2, 9
    cfg = LlamaConfig(
        hidden_size=head * heads,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2048,
        rope_theta=10000.0,
    )
    hf_rope = LlamaRotaryEmbedding(cfg)
    rope = RotaryEmbedding(head, head, 2048, 10000.0, True, torch.float32)
    pos, q, k = _qkp(tokens, heads, kv, head, torch.float32, max_pos=2048)
    out_q, out_k = rope(pos, q, k)
    cos, sin = hf_rope(q, pos[None])
    hq, hk = apply_rotary_pos_emb(
        q.view(1, tokens, heads, head).transpose(1, 2), k.view(1, tokens, kv, head).transpose(1, 2), cos, sin
    )
    torch.testing.assert_close(out_q, hq.transpose(1, 2).reshape(tokens, -1), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out_k, hk.transpose(1, 2).reshape(tokens, -1), atol=2e-5, rtol=2e-5)


@DTYPES
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_yarn_matches_vllm(vllm_ctx, dtype, neox) -> None:
    from vllm.model_executor.layers.rotary_embedding.yarn_scaling_rope import YaRNScalingRotaryEmbedding
    from vllm_npu.ops.rotary_embedding import NPUYaRNScalingRotaryEmbedding

    rope = YaRNScalingRotaryEmbedding(64, 48, 1024, 10000.0, neox, 4.0, dtype, beta_fast=32, beta_slow=1)
    assert type(rope) is NPUYaRNScalingRotaryEmbedding
    pos, q, k = _qkp(11, 2, 2, 64, dtype, max_pos=4096)
    out_q, out_k = rope(pos, q, k)
    ref_q, ref_k = rope.forward_native(pos, q.clone(), k.clone())
    close(out_q, ref_q, dtype)
    close(out_k, ref_k, dtype)


@DTYPES
@pytest.mark.parametrize(
    "neox,head,rot", [(False, 64, 64), (False, 96, 64), (True, 64, 64)], ids=["gptj-full", "gptj-partial", "neox-full"]
)
def test_deepseek_scaling_matches_vllm(vllm_ctx, dtype, neox, head, rot) -> None:
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import DeepseekScalingRotaryEmbedding
    from vllm_npu.ops.rotary_embedding import NPUDeepseekScalingRotaryEmbedding

    rope = DeepseekScalingRotaryEmbedding(
        head, rot, 512, 10000.0, neox, 40.0, dtype, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0
    )
    assert type(rope) is NPUDeepseekScalingRotaryEmbedding
    tokens = 7
    pos, q, k = _qkp(tokens, 3, 1, head, dtype, max_pos=512 * 40)
    q3, k3 = q.view(tokens, 3, head), k.view(tokens, 1, head)  # DeepSeek passes [T, N, D]
    out_q, out_k = rope(pos, q3, k3)
    ref_q, ref_k = rope.forward_native(pos, q3.clone(), k3.clone())
    # vLLM's NeoX branch broadcasts to [1, T, N, D]; compare in the input layout
    close(out_q, ref_q.reshape(q3.shape), dtype)
    close(out_k, ref_k.reshape(k3.shape), dtype)
    offsets = torch.full_like(pos, 3)
    out_q, _ = rope(pos, q3, k3, offsets)
    ref_q, _ = rope.forward_native(pos, q3.clone(), k3.clone(), offsets)
    close(out_q, ref_q.reshape(q3.shape), dtype)


@DTYPES
@pytest.mark.parametrize(
    "head,rot,sections,interleaved,kernel",
    [(32, 32, [4, 6, 6], False, True), (24, 16, [2, 3, 3], False, False), (32, 32, [4, 6, 6], True, False)],
    ids=["mrope-kernel", "partial-generic", "interleaved-generic"],
)
def test_mrope_matches_vllm(vllm_ctx, dtype, head, rot, sections, interleaved, kernel) -> None:
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding
    from vllm_npu.ops.mrope import NPUMRotaryEmbedding

    rope = MRotaryEmbedding(
        head, rot, 1024, 10000.0, True, dtype, mrope_section=sections, mrope_interleaved=interleaved
    )
    assert type(rope) is NPUMRotaryEmbedding and rope.uses_mrope_kernel is kernel
    tokens = 9
    g = torch.Generator().manual_seed(5)
    q = torch.randn(tokens, 4 * head, generator=g).to(dtype)
    k = torch.randn(tokens, 2 * head, generator=g).to(dtype)
    pos3 = torch.randint(0, 4000, (3, tokens), generator=g)
    for pos in (pos3, pos3[0]):  # T/H/W positions, then text-only positions
        out_q, out_k = rope(pos, q, k)
        ref_q, ref_k = rope.forward_native(pos, q.clone(), k.clone())
        close(out_q, ref_q, dtype)
        close(out_k, ref_k, dtype)


def test_mrope_kernel_alignment_is_decided_at_build(vllm_ctx) -> None:
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

    fp32 = MRotaryEmbedding(16, 16, 64, 10000.0, True, torch.float32, mrope_section=[2, 3, 3])
    bf16 = MRotaryEmbedding(16, 16, 64, 10000.0, True, torch.bfloat16, mrope_section=[2, 3, 3])
    assert fp32.uses_mrope_kernel and not bf16.uses_mrope_kernel  # rotary_dim % 32 for half precision


@pytest.mark.parametrize("head,rot", [(32, 32), (24, 16)], ids=["mrope-kernel", "partial-generic"])
def test_mrope_3d_positions_without_sections_is_an_error(vllm_ctx, head, rot) -> None:
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

    rope = MRotaryEmbedding(head, rot, 64, 10000.0, True, torch.float32)  # no mrope_section
    assert rope.uses_mrope_kernel is (rot == head)
    q, k = torch.randn(4, 2 * head), torch.randn(4, head)
    with pytest.raises(ValueError, match="need mrope_section"):
        rope(torch.zeros(3, 4, dtype=torch.long), q, k)
    out_q, out_k = rope(torch.arange(4), q, k)  # text-only positions need no sections
    ref_q, ref_k = rope.forward_native(torch.arange(4), q.clone(), k.clone())
    close(out_q, ref_q, torch.float32)
    close(out_k, ref_k, torch.float32)


def test_cos_sin_gathered_once_per_forward(vllm_ctx) -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    rope = RotaryEmbedding(64, 64, 4096, 10000.0, True, torch.float32)
    pos, q, k = _qkp(5, 2, 2, 64, torch.float32)
    first = rope(pos, q, k)
    for _ in range(3):  # later "layers" of the same forward: same positions tensor
        again = rope(pos, q, k)
        torch.testing.assert_close(again[0], first[0])
    assert rope._cos_sin.computed == 1
    pos.add_(1)  # the runner writes the next step's positions into the same buffer: version changes
    moved = rope(pos, q, k)
    assert rope._cos_sin.computed == 2
    torch.testing.assert_close(moved[0], rope.forward_native(pos, q.clone(), k.clone())[0], atol=1e-5, rtol=1e-5)
    rope(pos.clone(), q, k)  # a new positions tensor (next forward) is gathered again
    assert rope._cos_sin.computed == 3


def test_cos_sin_cache_keyed_by_forward_context(vllm_ctx) -> None:
    """Inference tensors have no version counter: then the vLLM forward context decides, and without one nothing
    is cached (correct, just not shared)."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    rope = RotaryEmbedding(32, 32, 256, 10000.0, True, torch.float32)
    with torch.inference_mode():
        pos, q, k = _qkp(3, 1, 1, 32, torch.float32, max_pos=256)
        rope(pos, q, k)
        rope(pos, q, k)
        assert rope._cos_sin.computed == 2
        with set_forward_context(None, vllm_ctx):
            rope(pos, q, k)
            rope(pos, q, k)
        assert rope._cos_sin.computed == 3
        with set_forward_context(None, vllm_ctx):
            rope(pos, q, k)  # a new forward, same buffer: gathered again
        assert rope._cos_sin.computed == 4


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head,rot", [(64, 64), (64, 32)])
def test_rope_traces_under_torch_compile(vllm_ctx, neox, head, rot) -> None:
    """Piecewise graph mode: Dynamo must capture forward_oot in one graph (fullgraph: no break at the per-forward
    cache, whose ``positions._version`` check cannot be traced), equal to vLLM's result, and leave the eager cache
    alone (nothing counted, nothing stored)."""
    import torch._dynamo
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    torch._dynamo.reset()
    rope = RotaryEmbedding(head, rot, 4096, 10000.0, neox, torch.float32)
    # q and k as column slices of one fused qkv output, as vLLM's attention layers pass them
    pos, qkv, _ = _qkp(7, 5, 1, head, torch.float32)
    q, k = qkv.split([4 * head, head], dim=-1)
    compiled = torch.compile(rope.forward_oot, backend="eager", fullgraph=True, dynamic=True)
    for p in (pos, (pos + 11) % 4096):
        out_q, out_k = compiled(p, q, k)
        ref_q, ref_k = rope.forward_native(p, q.clone(), k.clone())
        close(out_q, ref_q, torch.float32)
        close(out_k, ref_k, torch.float32)
    assert rope._cos_sin.computed == 0 and rope._cos_sin._value is None
    torch._dynamo.reset()


def test_mrope_traces_under_torch_compile(vllm_ctx) -> None:
    import torch._dynamo
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

    torch._dynamo.reset()
    rope = MRotaryEmbedding(24, 16, 1024, 10000.0, True, torch.float32, mrope_section=[2, 3, 3])
    assert not rope.uses_mrope_kernel  # the generic path, through the per-forward cache
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(6, 4 * 24, generator=g), torch.randn(6, 2 * 24, generator=g)
    pos = torch.randint(0, 1000, (3, 6), generator=g)
    out_q, out_k = torch.compile(rope.forward_oot, backend="eager", fullgraph=True)(pos, q, k)
    ref_q, ref_k = rope.forward_native(pos, q.clone(), k.clone())
    close(out_q, ref_q, torch.float32)
    close(out_k, ref_k, torch.float32)
    assert rope._cos_sin.computed == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("rot", [64, 32])
def test_rope_strided_inputs(vllm_ctx, rot) -> None:
    """q/k as column slices of a fused qkv (viewable, vLLM's case) and as a transposed buffer (not viewable: the
    reshape fallback) give vLLM's result in the input shape."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    rope = RotaryEmbedding(64, rot, 4096, 10000.0, True, torch.float32)
    g = torch.Generator().manual_seed(3)
    pos = torch.randint(0, 4096, (5,), generator=g)
    q, k, _ = torch.randn(5, 6 * 64, generator=g).split([4 * 64, 64, 64], dim=-1)
    qt = torch.randn(4 * 64, 5, generator=g).t()
    for qq, kk in ((q, k), (qt, k)):
        out_q, out_k = rope(pos, qq, kk)
        ref_q, ref_k = rope.forward_native(pos, qq.clone(), kk.clone())
        close(out_q, ref_q, torch.float32)
        close(out_k, ref_k, torch.float32)
