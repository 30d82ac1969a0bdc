# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The lean reference attention (matmuls, one page gather, the decode mask built once per step) pinned to the
previous twins, kept here as oracles: bit-identical (``torch.equal``) where the maths is the same in the same order
(the same GEMMs einsum dispatched to, the same fp32 softmax, the same mask values). The decode twins' fused
attention (``scaled_dot_product_attention``, an online softmax) sums in another order: there new == old holds within
fp32 rounding, ``DECODE_FP32_TOL`` (measured: at most 4.8e-7 absolute on O(1) outputs); a bf16 output within one
bf16 rounding step (measured on Intel hosts: every element equal; on an AMD EPYC host one element in 2048 rounds to
the neighbouring bf16 value, relative 0.0042); soft-capped decode keeps the matmul path and stays bit-identical.
The golden tests against float64 and vLLM live in test_gqa_attention.py with their own tolerances; this file only
pins new == old.
"""

from __future__ import annotations

import pytest
import torch
from vllm_npu.attention.ops._reference import _MASKED, attend, gather_pages, window_allowed
from vllm_npu.attention.ops.paged_attention import (
    DecodePlan,
    paged_decode_reference,
    paged_decode_window_reference,
    paged_prefill_reference,
)

BS = 16
DECODE_FP32_TOL = dict(rtol=1e-5, atol=1e-6)  # a few fp32 ulps: the fused decode attention's summation order
# One bf16 rounding step of the same fp32 result: bf16 keeps 8 significant bits, so neighbouring values differ by up
# to 2**-7 relative (just above a power of two); 2**-8 held only where no element landed on the other side.
DECODE_BF16_TOL = dict(rtol=2**-7, atol=1e-6)


def _attend_oracle(query, key, value, allowed, scale, logits_soft_cap=None):  # type: ignore[no-untyped-def]
    """The previous ``attend``: two einsums."""
    *batch, sq, n, d = query.shape
    nkv = key.shape[-2]
    q = query.float().reshape(*batch, sq, nkv, n // nkv, d)
    scores = torch.einsum("...qhgd,...khd->...hgqk", q, key.float()) * scale
    if logits_soft_cap:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    if allowed is not None:
        scores = scores.masked_fill(~allowed[..., None, None, :, :], _MASKED)
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("...hgqk,...khd->...qhgd", probs, value.float()).reshape(*batch, sq, n, d)


def _decode_oracle(query, key_cache, value_cache, block_table, context_lens, scale, window, cap):  # type: ignore[no-untyped-def]
    """The previous ``paged_decode(_window)_reference``: per-layer lengths, positions and mask, einsum attention."""
    lens = torch.tensor(context_lens, dtype=torch.long)
    k = gather_pages(key_cache, block_table, max(context_lens))
    v = gather_pages(value_cache, block_table, max(context_lens))
    k_pos = torch.arange(k.shape[1])
    q_pos = (lens - 1)[:, None]
    allowed = window_allowed(q_pos, k_pos[None, :].expand(len(context_lens), -1), causal=True, sliding_window=window)
    return _attend_oracle(query[:, None], k, v, allowed, scale, cap)[:, 0]


def _paged(lens: list[int], nkv: int, d: int, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    per = -(-max(lens) // BS) + 1  # one spare page per row: the table's tail points at real, unmasked-looking data
    nblocks = len(lens) * per + 1
    key_cache = torch.randn(nblocks, BS, nkv, d, generator=g).to(dtype)
    value_cache = torch.randn(nblocks, BS, nkv, d, generator=g).to(dtype)
    table = (torch.randperm(nblocks - 1, generator=g)[: len(lens) * per] + 1).view(len(lens), per).int()
    return key_cache, value_cache, table, g


CASES = [
    ([5, 17, 33, 1], 8, 2, 32),
    ([16, 32, 48], 4, 4, 16),
    ([100], 12, 4, 64),
    ([3, 7, 64, 65, 2, 9, 40, 1], 8, 1, 32),
]


@pytest.mark.parametrize("lens,n,nkv,d", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,cap", [(None, None), (7, None), (None, 30.0)])
@pytest.mark.parametrize("with_plan", [False, True])
@pytest.mark.parametrize("paired", [False, True])
def test_paged_decode_matches_previous_twin(
    lens: list[int],
    n: int,
    nkv: int,
    d: int,
    dtype: torch.dtype,
    window: int | None,
    cap: float | None,
    with_plan: bool,
    paired: bool,
) -> None:
    key_cache, value_cache, table, g = _paged(lens, nkv, d, dtype, len(lens) * n)
    if paired:  # the halves of one [2, ...] tensor, as vLLM allocates a layer's cache: one gather serves both
        key_cache, value_cache = torch.stack([key_cache, value_cache]).unbind(0)
    query = torch.randn(len(lens), n, d, generator=g).to(dtype)
    plan = DecodePlan.build(lens, BS, key_cache.device) if with_plan else None
    out = torch.empty(len(lens), n, d, dtype=dtype)
    kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, out=out, logits_soft_cap=cap, plan=plan)
    if window is None:
        paged_decode_reference(query, key_cache, value_cache, table, lens, **kw)
    else:
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        paged_decode_window_reference(query, key_cache, value_cache, table, seq_lens, lens, sliding_window=window, **kw)
    expect = _decode_oracle(query, key_cache, value_cache, table, lens, d**-0.5, window, cap).to(dtype)
    if cap is not None:  # the matmul path, as before
        assert torch.equal(out, expect)
    else:
        torch.testing.assert_close(out, expect, **(DECODE_FP32_TOL if dtype == torch.float32 else DECODE_BF16_TOL))


def test_one_gather_for_paired_caches_and_pages_made_once() -> None:
    lens = [5, 30, 17]
    key_cache, value_cache, table, g = _paged(lens, 2, 16, torch.float32, 1)
    pair = torch.stack([key_cache, value_cache])
    query = torch.randn(3, 4, 16, generator=g)
    plan = DecodePlan.build(lens, BS, key_cache.device)
    kw = dict(num_heads=4, num_kv_heads=2, scale=0.25, plan=plan)
    apart, together = torch.empty(3, 4, 16), torch.empty(3, 4, 16)
    paged_decode_reference(query, key_cache, value_cache, table, lens, out=apart, **kw)
    paged_decode_reference(query, *pair.unbind(0), table, lens, out=together, **kw)
    assert torch.equal(apart, together)  # the same pages gathered, the same attention
    pages = plan.pages(table)
    assert torch.equal(pages, table[:, : plan.num_blocks].reshape(-1)) and plan.pages(table) is pages
    other = table.flip(0).contiguous()  # another block table (another KV-cache group): its own pages
    assert torch.equal(plan.pages(other), other[:, : plan.num_blocks].reshape(-1))
    # Caches that are not the two halves of one tensor (a view with other strides) take a gather each.
    k_t = key_cache.transpose(2, 3).contiguous().transpose(2, 3)
    out = torch.empty(3, 4, 16)
    paged_decode_reference(query, k_t, value_cache, table, lens, out=out, **kw)
    assert torch.equal(out, apart)


def test_plan_for_other_lengths_is_not_used() -> None:
    lens = [5, 30]
    key_cache, value_cache, table, g = _paged(lens, 2, 16, torch.float32, 0)
    query = torch.randn(2, 4, 16, generator=g)
    stale = DecodePlan.build([1, 1], BS, key_cache.device)  # another step's plan (a captured graph's, say)
    out = torch.empty(2, 4, 16)
    paged_decode_reference(
        query, key_cache, value_cache, table, lens, num_heads=4, num_kv_heads=2, scale=0.25, out=out, plan=stale
    )
    expect = _decode_oracle(query, key_cache, value_cache, table, lens, 0.25, None, None)
    torch.testing.assert_close(out, expect, **DECODE_FP32_TOL)


@pytest.mark.parametrize(
    "shape", [((1, 5, 8, 32), (1, 130, 2, 32)), ((37, 8, 32), (37, 2, 32)), ((3, 4, 12, 64), (3, 384, 4, 64))]
)
@pytest.mark.parametrize("causal", [False, True])
def test_attend_bit_identical_to_einsum(shape: tuple[tuple[int, ...], tuple[int, ...]], causal: bool) -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(shape[0], generator=g), torch.randn(shape[1], generator=g), torch.randn(shape[1], generator=g)
    sq, sk = q.shape[-3], k.shape[-3]
    allowed = None
    if causal:
        allowed = window_allowed(torch.arange(sk - sq, sk), torch.arange(sk), causal=True, sliding_window=None)
        allowed = allowed.expand(*q.shape[:-3], sq, sk)
    assert torch.equal(attend(q, k, v, allowed, 0.2), _attend_oracle(q, k, v, allowed, 0.2))


def test_paged_prefill_mixed_batch_bit_identical() -> None:
    # decodes, a short chunk (padded group) and a long chunk (per request) in one batch
    seq_lens, q_lens = [9, 40, 70], [1, 5, 30]
    key_cache, value_cache, table, g = _paged(seq_lens, 2, 32, torch.float32, 3)
    qsl = [0, 1, 6, 36]
    query = torch.randn(36, 8, 32, generator=g)
    out = torch.empty(36, 8, 32)
    paged_prefill_reference(
        query,
        key_cache,
        value_cache,
        table,
        qsl,
        seq_lens,
        num_heads=8,
        num_kv_heads=2,
        scale=0.3,
        attn_mask=None,
        out=out,
    )
    for i, (s, q) in enumerate(zip(seq_lens, q_lens)):
        k = gather_pages(key_cache, table[i : i + 1], s)[0, :s]
        v = gather_pages(value_cache, table[i : i + 1], s)[0, :s]
        pos = torch.arange(s)
        allowed = window_allowed(pos[s - q :], pos, causal=True, sliding_window=None)
        expect = _attend_oracle(query[qsl[i] : qsl[i + 1]], k, v, allowed, 0.3)
        # per-request oracle (unpadded keys): the padded short group sums over more masked slots, so 1e-6 absolute
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], expect, rtol=0, atol=1e-6)


def _refresh_with(monkeypatch: pytest.MonkeyPatch, metadata: object, batch: int):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    import vllm.forward_context
    from vllm_npu.attention.backends.gqa import decode_lens_refresh

    context = SimpleNamespace(attn_metadata={"l0": metadata, "l1": metadata})
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    return decode_lens_refresh("l0", batch), decode_lens_refresh("l1", batch)


def test_graph_refresh_hands_the_step_plan_to_the_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full batch: the refresh gives the metadata's own list and plan (so the twin's identity check takes it);
    a padded batch: one padded list and plan per step, shared by every layer, the plan built for that list."""
    from types import SimpleNamespace

    from vllm_npu.attention.ops.paged_attention import _plan_for

    lens = [5, 30, 17]
    key_cache = torch.zeros(8, BS, 2, 16)
    md = SimpleNamespace(seq_lens_list=lens, decode_plan=DecodePlan.build(lens, BS, key_cache.device))
    first, second = _refresh_with(monkeypatch, md, 3)
    params = first()
    assert params["context_lens"] is lens and params["plan"] is md.decode_plan
    assert _plan_for(params["plan"], params["context_lens"], key_cache) is md.decode_plan

    first, second = _refresh_with(monkeypatch, md, 5)
    a, b = first(), second()
    assert a["context_lens"] == [5, 30, 17, 1, 1] and a["context_lens"] is b["context_lens"] and a["plan"] is b["plan"]
    assert _plan_for(a["plan"], a["context_lens"], key_cache) is a["plan"]
    fresh = DecodePlan.build([5, 30, 17, 1, 1], BS, key_cache.device)
    assert torch.equal(a["plan"].bias, fresh.bias) and torch.equal(a["plan"].masked, fresh.masked)

    md_next = SimpleNamespace(
        seq_lens_list=[6, 31, 18], decode_plan=DecodePlan.build([6, 31, 18], BS, key_cache.device)
    )
    first, _ = _refresh_with(monkeypatch, md_next, 5)
    assert first()["context_lens"] == [6, 31, 18, 1, 1]  # the next step's list, not the memo of the last

    npu_md = SimpleNamespace(seq_lens_list=[4, 9], decode_plan=None)  # NPU backend: no plan, only the lengths
    first, _ = _refresh_with(monkeypatch, npu_md, 4)
    assert first() == {"context_lens": [4, 9, 1, 1], "plan": None}
