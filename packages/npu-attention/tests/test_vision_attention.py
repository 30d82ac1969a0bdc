# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The vision-attention reference twin vs dense attention with a block-diagonal mask built from ``cu_seqlens``."""

from __future__ import annotations

import pytest
import torch
from vllm_npu.attention.ops.vision_attention import VISION_ATTENTION, vision_attention_reference
from vllm_npu.interface import KernelContractError


def _dense_block_diagonal(q, k, v, cu_seqlens, scale):
    """Plain-torch oracle: one SDPA over all T tokens, masked so token i sees token j iff both lie in one segment."""
    t = q.shape[0]
    segment = torch.bucketize(torch.arange(t), cu_seqlens[1:], right=True)
    mask = segment[:, None] == segment[None, :]
    groups = q.shape[1] // k.shape[1]
    kk, vv = (x.float().repeat_interleave(groups, dim=1).transpose(0, 1) for x in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), kk, vv, attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["float32", "bfloat16"]
)
@pytest.mark.parametrize(("n", "nkv"), [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_reference_equals_dense_block_diagonal(dtype, atol, n, nkv):
    # Two images of different patch counts, an empty segment and two video frames of one grid.
    seq_lens = [16, 48, 0, 12, 12]
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    t, d = sum(seq_lens), 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (n, nkv, nkv))
    out = torch.full_like(q, float("nan"))
    vision_attention_reference(
        q, k, v, torch.tensor(seq_lens, dtype=torch.int32), num_heads=n, num_kv_heads=nkv, scale=d**-0.5, out=out
    )
    assert out.dtype == dtype
    expected = _dense_block_diagonal(q, k, v, cu, d**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)


def test_segments_do_not_see_each_other():
    d = 8
    q = torch.randn(6, 2, d)
    k, v = torch.randn(6, 2, d), torch.randn(6, 2, d)
    seq_lens = torch.tensor([2, 4], dtype=torch.int32)
    base = torch.empty_like(q)
    vision_attention_reference(q, k, v, seq_lens, num_heads=2, num_kv_heads=2, scale=0.3, out=base)
    v2 = v.clone()
    v2[2:] += 100.0  # change only the second segment's values
    moved = torch.empty_like(q)
    vision_attention_reference(q, k, v2, seq_lens, num_heads=2, num_kv_heads=2, scale=0.3, out=moved)
    torch.testing.assert_close(moved[:2], base[:2])
    assert not torch.allclose(moved[2:], base[2:])


@pytest.mark.parametrize(
    ("seq_lens", "match"),
    [
        ([3, 4], "do not pack"),
        (torch.tensor([3, 3], dtype=torch.int64), "int32"),
        (torch.tensor([0, 3, 6], dtype=torch.int32), "do not pack"),  # cumulative offsets instead of lengths
    ],
)
def test_bad_seq_lens_name_the_fix(seq_lens, match):
    q = torch.randn(6, 2, 8)
    lens = seq_lens if isinstance(seq_lens, torch.Tensor) else torch.tensor(seq_lens, dtype=torch.int32)
    with pytest.raises(KernelContractError, match=match):
        vision_attention_reference(q, q, q, lens, num_heads=2, num_kv_heads=2, scale=1.0, out=torch.empty_like(q))


def test_kernel_pair_is_named_and_paired():
    assert VISION_ATTENTION.name == "vision_attention"
    assert VISION_ATTENTION.reference is vision_attention_reference
    assert VISION_ATTENTION.npu.__name__ == "vision_attention_npu"


def test_npu_twin_passes_the_documented_arguments(monkeypatch):
    """The NPU path against a stand-in ``torch_npu._npu_flash_attention_unpad`` written from the 2.8.0 binding
    (``query, key, value, seq_len, scale_value, num_heads, num_kv_heads, out``; per-sequence int32 lengths on the
    host; fp16/bf16): the result equals the reference twin's."""
    import sys
    import types

    from vllm_npu.attention.ops.vision_attention import vision_attention_npu

    calls = []

    def _npu_flash_attention_unpad(*, query, key, value, seq_len, scale_value, num_heads, num_kv_heads, out):
        assert query.dtype in (torch.float16, torch.bfloat16) and key.dtype == value.dtype == query.dtype
        assert seq_len.dtype == torch.int32 and seq_len.device.type == "cpu"
        assert query.shape[1] == num_heads and key.shape[1] == num_kv_heads
        cu = torch.tensor([0, *seq_len.cumsum(0).tolist()])
        out.copy_(_dense_block_diagonal(query, key, value, cu, scale_value).to(out.dtype))
        calls.append(seq_len.tolist())

    monkeypatch.setitem(
        sys.modules, "torch_npu", types.SimpleNamespace(_npu_flash_attention_unpad=_npu_flash_attention_unpad)
    )
    seq_lens = torch.tensor([16, 48, 12, 12], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(88, h, 16, generator=g).to(torch.bfloat16) for h in (4, 2, 2))
    npu_out, ref_out = torch.empty_like(q), torch.empty_like(q)
    kw = dict(num_heads=4, num_kv_heads=2, scale=0.25)
    vision_attention_npu(q, k, v, seq_lens, out=npu_out, **kw)
    vision_attention_reference(q, k, v, seq_lens, out=ref_out, **kw)
    assert calls == [[16, 48, 12, 12]]
    torch.testing.assert_close(npu_out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
