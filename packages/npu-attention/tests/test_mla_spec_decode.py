# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The multi-token MLA decode pair (speculative-decoding verification) against a dense float64 reference.

The reference twin packs mixed query lengths (1..1+k tokens per request) and masks causally inside each request's
draft window; the NPU twin pads every request to ``Q_S = max(query_lens)`` rows in BNSD and drops the padded rows
again, run here against a stand-in ``torch_npu`` that follows the torch_npu 2.8.0 docs of the MLA mode
(``query_rope``/``key_rope``, one KV head, paged, per-request ``actual_seq_lengths`` with right padding,
``sparse_mode=3`` right-down causal with the 2048 mask).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

pytest.importorskip("vllm")

from npu_testkit import npu_binding_rules as rules  # noqa: E402
from vllm_npu.attention.masks import AttentionMaskBuilder  # noqa: E402
from vllm_npu.attention.ops.mla_attention import (  # noqa: E402
    mla_decode_reference,
    mla_spec_decode_npu,
    mla_spec_decode_reference,
)
from vllm_npu.attention.ops.mla_cache import latent_cache_planes  # noqa: E402
from vllm_npu.interface import KernelContractError  # noqa: E402


def _setup(query_lens, seq_lens, *, n, L, R, bs, dtype, seed=0, spare_cols=2):
    """Random latent cache, a shuffled block table with unused columns, packed queries."""
    g = torch.Generator().manual_seed(seed)
    per_req = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(per_req) + 3
    perm = torch.randperm(num_blocks, generator=g)
    width = max(per_req) + spare_cols
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for b, k in enumerate(per_req):
        table[b, :k] = perm[used : used + k]
        table[b, k:] = perm[-1]  # padding columns point at a block no request owns
        used += k
    cache = torch.randn(num_blocks, bs, L + R, generator=g).to(dtype)
    nope, rope = latent_cache_planes(cache, L, R)
    t = sum(query_lens)
    ql = torch.randn(t, n, L, generator=g).to(dtype)
    qpe = torch.randn(t, n, R, generator=g).to(dtype)
    return ql, qpe, nope, rope, table


def _dense(ql, qpe, nope, rope, table, query_lens, seq_lens, scale):
    """Token by token in float64: token i of request b sees its first seq_len - q_len + i + 1 cached tokens."""
    bs, L, R = nope.shape[1], nope.shape[-1], rope.shape[-1]
    out = torch.empty(ql.shape, dtype=torch.float64)
    t = 0
    for b, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for i in range(q):
            visible = s - q + i + 1
            slots = [int(table[b, p // bs]) * bs + p % bs for p in range(visible)]
            kc, kr = nope.view(-1, L)[slots].double(), rope.view(-1, R)[slots].double()
            score = scale * (ql[t].double() @ kc.T + qpe[t].double() @ kr.T)
            out[t] = torch.softmax(score, -1) @ kc
            t += 1
    return out


# mixed k (1..4 tokens), a request whose whole sequence is its query (a short prompt scheduled as a decode),
# a block boundary inside a draft window
SPEC_CASES = {
    "mixed": ([4, 1, 3, 2], [10, 37, 16, 2]),
    "uniform": ([3, 3, 3], [3, 17, 40]),
    "single": ([1, 1], [5, 33]),
}


@pytest.mark.parametrize("case", sorted(SPEC_CASES))
def test_reference_matches_dense_float64(case: str) -> None:
    query_lens, seq_lens = SPEC_CASES[case]
    args = _setup(query_lens, seq_lens, n=4, L=32, R=8, bs=16, dtype=torch.float32)
    got = mla_spec_decode_reference(*args, query_lens, seq_lens, 0.3)
    want = _dense(*args, query_lens, seq_lens, 0.3)
    assert got.shape == args[0].shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_one_token_per_request_equals_the_decode_kernel() -> None:
    query_lens, seq_lens = [1, 1, 1], [20, 3, 32]
    args = _setup(query_lens, seq_lens, n=2, L=8, R=4, bs=16, dtype=torch.float32, seed=3)
    single = torch.empty_like(args[0])
    mla_decode_reference(*args, seq_lens, 0.5, out=single)
    torch.testing.assert_close(mla_spec_decode_reference(*args, query_lens, seq_lens, 0.5), single)


def test_reference_rejects_lengths_that_do_not_add_up() -> None:
    args = _setup([2, 1], [5, 5], n=2, L=8, R=4, bs=16, dtype=torch.float32)
    with pytest.raises(KernelContractError, match="do not describe 3 tokens"):
        mla_spec_decode_reference(*args, [1, 1], [5, 5], 1.0)
    with pytest.raises(KernelContractError, match="query_len <= seq_len"):
        mla_spec_decode_reference(*args, [2, 1], [1, 5], 1.0)


# --- NPU twin against a documented stand-in ---------------------------------------------------------------------

CALLS: list[dict] = []


def npu_fused_infer_attention_score(
    query,
    key,
    value,
    *,
    atten_mask=None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    block_table=None,
    query_rope=None,
    key_rope=None,
    num_heads=1,
    scale=1.0,
    input_layout="BSH",
    num_key_value_heads=0,
    sparse_mode=0,
    block_size=0,
    pre_tokens=2147483647,
    next_tokens=2147483647,
    antiquant_scale=None,
    antiquant_mode=0,
):
    """MLA mode, BNSD, paged: query ``[B, N, Q_S, 512]``, key ``[nb, 1, bs, 512]`` (key is value), rope 64.
    Each batch's first ``actual_seq_lengths[b]`` query rows are valid (right padding); with ``sparse_mode=3`` row
    ``i`` sees ``actual_seq_lengths_kv[b] - actual_seq_lengths[b] + i + 1`` keys."""
    assert input_layout == "BNSD" and query_rope is not None and key_rope is not None
    assert antiquant_scale is None and antiquant_mode == 0, "a float latent cache (C8 is GQA-only)"
    assert pre_tokens == next_tokens == 2147483647, "no band in the MLA mode"
    assert query.is_contiguous() and query_rope.is_contiguous(), "docs: query/query_rope must be contiguous"
    B, N, QS, L = query.shape
    assert num_heads == N and num_key_value_heads == 1 and L == 512 and query_rope.shape == (B, N, QS, 64)
    assert key.shape[1] == 1 and key.shape[2] == block_size and block_size in (16, 128)
    assert 1 <= QS <= 16, "docs: query_rope needs Q_S in 1..16"
    assert block_table.dtype == torch.int32 and block_table.shape[0] == B
    q_lens, kv_lens = list(actual_seq_lengths), list(actual_seq_lengths_kv)
    assert len(q_lens) == len(kv_lens) == B and all(1 <= q <= QS for q in q_lens)
    if QS > 1:  # docs: Q_S > 1 needs sparse 3 or 4 with the 2048 mask
        assert sparse_mode == 3 and atten_mask is not None and tuple(atten_mask.shape) == (2048, 2048)
        assert atten_mask.dtype in (torch.bool, torch.int8, torch.uint8)
        assert bool((atten_mask.bool() == torch.ones(2048, 2048, dtype=torch.bool).triu(1)).all())
    CALLS.append({"QS": QS, "q_lens": q_lens})
    kc = key.view(-1, L)
    kr = key_rope.reshape(-1, 64)
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)  # padded rows: garbage
    for b in range(B):
        slots = torch.tensor(
            [int(block_table[b, p // block_size]) * block_size + p % block_size for p in range(kv_lens[b])]
        )
        for i in range(q_lens[b]):
            visible = kv_lens[b] - q_lens[b] + i + 1
            k, r = kc[slots[:visible]].double(), kr[slots[:visible]].double()
            s = scale * (query[b, :, i].double() @ k.T + query_rope[b, :, i].double() @ r.T)
            out[b, :, i] = (torch.softmax(s, -1) @ k).to(out.dtype)
    return out, torch.zeros(1)


@pytest.fixture
def fake_npu(monkeypatch):
    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = rules.documented(npu_fused_infer_attention_score)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    CALLS.clear()
    return CALLS


@pytest.mark.parametrize("case", ["mixed", "uniform"])
def test_npu_twin_pads_per_request_and_matches_reference(fake_npu, case: str) -> None:
    query_lens, seq_lens = SPEC_CASES[case]
    args = _setup(query_lens, seq_lens, n=32, L=512, R=64, bs=16, dtype=torch.float16, seed=5)
    mask = AttentionMaskBuilder("cpu").splitfuse_mask()
    got = mla_spec_decode_npu(*args, query_lens, seq_lens, 0.05, attn_mask=mask)
    want = _dense(*args, query_lens, seq_lens, 0.05)
    assert fake_npu == [{"QS": max(query_lens), "q_lens": query_lens}]
    assert got.shape == args[0].shape and not torch.isnan(got).any()  # every padded row dropped
    torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=2e-3)
    ref = mla_spec_decode_reference(*args, query_lens, seq_lens, 0.05)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)


def test_npu_twin_refuses_what_the_kernel_does_not_document(fake_npu) -> None:
    args = _setup([2, 1], [5, 9], n=32, L=512, R=64, bs=16, dtype=torch.float16)
    with pytest.raises(KernelContractError, match="splitfuse mask"):
        mla_spec_decode_npu(*args, [2, 1], [5, 9], 1.0)
    big = _setup([17], [40], n=32, L=512, R=64, bs=16, dtype=torch.float16)
    with pytest.raises(KernelContractError, match="at most 16 query tokens"):
        mla_spec_decode_npu(*big, [17], [40], 1.0, attn_mask=AttentionMaskBuilder("cpu").splitfuse_mask())
    small = _setup([2], [5], n=4, L=32, R=8, bs=16, dtype=torch.float16)
    with pytest.raises(KernelContractError, match="kv_lora_rank 512"):
        mla_spec_decode_npu(*small, [2], [5], 1.0, attn_mask=AttentionMaskBuilder("cpu").splitfuse_mask())
    assert fake_npu == []
