# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The paged-decode reference twin reading long contexts without a fresh copy per layer (issue 35, item 2).

Two ways, both inside the twin (the NPU kernel reads its cache in place anyway, and the NPU path is unchanged):
pages that lie in the cache as one strided run (a lone request's consecutive blocks) are read through a view, no
gather at all; other tables gather into the metadata builder's :class:`PageScratch`, one buffer reused by every
layer and step instead of a fresh ``[B, S, Nkv, D]`` allocation per layer. Both give what the gather gave: checked
against a float64 dense oracle on long contexts with many blocks (block size 16 and 128, up to 8k tokens), with
sliding windows and soft-capping, and against the twin's own gather path.
"""

from __future__ import annotations

import pytest
import torch
from vllm_npu.attention.ops.paged_attention import (
    DecodePlan,
    PageScratch,
    paged_decode_reference,
    paged_decode_window_reference,
)

FP32_TOL = dict(rtol=1e-5, atol=2e-5)  # test_gqa_attention.py's fp32 bound against the float64 oracle
BF16_TOL = dict(rtol=3e-2, atol=3e-2)


def _oracle(query, k, v, lens, scale, window=None, cap=None):  # type: ignore[no-untyped-def]
    """Dense float64 attention of one query token per request over its first ``lens[b]`` tokens of ``k``/``v``
    (``[B, L, Nkv, D]``), with a window ``W`` keeping the last ``W`` of them."""
    b, n, d = query.shape
    nkv = k.shape[2]
    out = torch.empty(b, n, d, dtype=torch.float64)
    for i, length in enumerate(lens):
        lo = 0 if window is None else max(0, length - window)
        kk = k[i, lo:length].double().repeat_interleave(n // nkv, dim=1)  # [S, N, D]
        vv = v[i, lo:length].double().repeat_interleave(n // nkv, dim=1)
        s = torch.einsum("nd,snd->ns", query[i].double(), kk) * scale
        if cap:
            s = torch.tanh(s / cap) * cap
        out[i] = torch.einsum("ns,snd->nd", torch.softmax(s, -1), vv)
    return out


def _cache(lens: list[int], nkv: int, d: int, bs: int, layout: str, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    """vLLM's per-layer ``[2, blocks, bs, Nkv, D]`` cache unbound, each request's blocks placed per ``layout``:
    ``run`` (request ``b``'s blocks consecutive, the requests one after another), ``shuffled``; plus each request's
    K/V ``[B, L, Nkv, D]`` and the block table (spare columns past a request's blocks point at real data)."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-n // bs) for n in lens]
    width = max(per) + 2
    total = sum(per) + 2 * len(lens) + 1
    order = torch.arange(1, total) if layout == "run" else torch.randperm(total - 1, generator=g) + 1
    kv = torch.randn(2, total, bs, nkv, d, generator=g).to(dtype)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for i, p in enumerate(per):
        table[i, :p] = order[used : used + p].to(torch.int32)
        used += p
    for i, p in enumerate(per):  # spare columns after every request's own blocks (real, unmasked-looking pages)
        table[i, p:] = order[used : used + width - p].to(torch.int32) if used + width - p < total else 1
    key_cache, value_cache = kv.unbind(0)
    k = key_cache[table.long()].flatten(1, 2)
    v = value_cache[table.long()].flatten(1, 2)
    query = torch.randn(len(lens), 2 * nkv, d, generator=g).to(dtype)
    return key_cache, value_cache, table, k, v, query


def _decode(query, key_cache, value_cache, table, lens, plan, window=None, cap=None):  # type: ignore[no-untyped-def]
    n, nkv, d = query.shape[1], key_cache.shape[2], query.shape[2]
    out = torch.empty_like(query)
    kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, out=out, logits_soft_cap=cap, plan=plan)
    if window is None:
        paged_decode_reference(query, key_cache, value_cache, table, lens, **kw)
    else:
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        paged_decode_window_reference(query, key_cache, value_cache, table, seq_lens, lens, sliding_window=window, **kw)
    return out


LONG = [
    ([8192], 128),  # one 8k request: 64 blocks of 128
    ([1000, 2047, 37, 1500], 16),  # mixed lengths, up to 128 blocks of 16
    ([1024, 1024, 1024], 128),  # equal lengths: a run of runs when laid out one after another
]


@pytest.mark.parametrize("lens,bs", LONG)
@pytest.mark.parametrize("layout", ["run", "shuffled"])
@pytest.mark.parametrize("window,cap", [(None, None), (300, None), (None, 30.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_context_matches_float64(
    lens: list[int], bs: int, layout: str, window: int | None, cap: float | None, dtype: torch.dtype
) -> None:
    key_cache, value_cache, table, k, v, query = _cache(lens, 2, 32, bs, layout, dtype, len(lens) * bs)
    plan = DecodePlan.build(lens, bs, key_cache.device, PageScratch())
    out = _decode(query, key_cache, value_cache, table, lens, plan, window, cap)
    expect = _oracle(query, k, v, lens, 32**-0.5, window, cap)
    torch.testing.assert_close(out.double(), expect, **(FP32_TOL if dtype == torch.float32 else BF16_TOL))
    # one request, or equal lengths laid out one after another: a strided run, read in place
    assert (plan.run(table) is not None) == (layout == "run" and len(set(lens)) == 1)


@pytest.mark.parametrize("window,cap", [(None, None), (20, None), (None, 30.0)])
def test_in_place_view_equals_the_gather(window: int | None, cap: float | None) -> None:
    lens = [300, 300, 300]
    key_cache, value_cache, table, _, _, query = _cache(lens, 2, 32, 16, "run", torch.float32, 7)
    plan = DecodePlan.build(lens, 16, key_cache.device)
    assert plan.run(table) == (1, 19)  # blocks 1.., 20.., 39..: 19 blocks apart, a view per cache
    viewed = _decode(query, key_cache, value_cache, table, lens, plan, window, cap)
    copied = table.clone()  # the same pages at another address: the memo is per block table, this one copies...
    plan._runs[(copied.data_ptr(), copied.shape[0], copied.stride(0))] = None  # ...because it is told it is no run
    gathered = _decode(query, key_cache, value_cache, copied, lens, plan, window, cap)
    torch.testing.assert_close(viewed, gathered, rtol=1e-6, atol=1e-6)


def test_run_detection() -> None:
    def run(rows: list[list[int]], lens: list[int]) -> tuple[int, int] | None:
        return DecodePlan.build(lens, 16, torch.device("cpu")).run(torch.tensor(rows, dtype=torch.int32))

    assert run([[5, 6, 7, 0]], [40]) == (5, 0)  # only the first ceil(40 / 16) = 3 columns count
    assert run([[5, 6, 7], [9, 10, 11]], [40, 33]) == (5, 4)
    assert run([[5, 6, 7], [5, 6, 7]], [40, 33]) == (5, 0)  # two rows over the same pages (spacing 0) still a view
    assert run([[9, 10, 11], [5, 6, 7]], [40, 33]) is None  # negative spacing: no view
    assert run([[5, 6, 7], [9, 10, 12]], [40, 40]) is None
    assert run([[5, 6, 7], [9, 10, 0]], [40, 20]) is None  # a shorter row's table tail is block 0
    assert run([[5, 7, 6]], [40]) is None


def test_gathers_land_in_the_scratch_reused_by_every_layer() -> None:
    lens = [500, 120, 333]
    scratch = PageScratch()
    layers = [_cache(lens, 2, 32, 16, "shuffled", torch.float32, seed) for seed in (1, 2)]
    table, query = layers[0][2], layers[0][5]  # one block table and query for the step, two layers' caches
    plan = DecodePlan.build(lens, 16, torch.device("cpu"), scratch)
    outs = [_decode(query, kc, vc, table, lens, plan) for kc, vc, *_ in layers]
    buffer = scratch._buffer
    assert buffer is not None and buffer.numel() == 2 * 3 * plan.num_blocks * 16 * 2 * 32
    again = _decode(query, layers[0][0], layers[0][1], table, lens, plan)
    assert scratch._buffer is buffer  # the same buffer, not a new allocation per layer
    for (kc, vc, *_), out in zip(layers, outs, strict=True):
        # each layer's output is its own, though the next layer's gather overwrote the scratch
        k, v = kc[table.long()].flatten(1, 2), vc[table.long()].flatten(1, 2)
        torch.testing.assert_close(out.double(), _oracle(query, k, v, lens, 32**-0.5), **FP32_TOL)
    assert torch.equal(again, outs[0])


def test_run_reads_no_page_copy() -> None:
    lens = [4000]
    key_cache, value_cache, table, k, v, query = _cache(lens, 2, 32, 16, "run", torch.float32, 3)
    scratch = PageScratch()
    plan = DecodePlan.build(lens, 16, key_cache.device, scratch)
    out = _decode(query, key_cache, value_cache, table, lens, plan)
    assert scratch._buffer is None  # read through a view of the cache: nothing gathered
    torch.testing.assert_close(out.double(), _oracle(query, k, v, lens, 32**-0.5), **FP32_TOL)


def test_builder_plans_share_one_scratch() -> None:
    from attn_harness import make_batch, make_builder

    b = make_builder(16, 2, 32, torch.float32)
    first = b.build(0, make_batch([1, 1], [4, 9], num_heads=4, num_kv_heads=2, head_size=16, block_size=16).common)
    second = b.build(0, make_batch([1], [5], num_heads=4, num_kv_heads=2, head_size=16, block_size=16).common)
    assert first.decode_plan is not None and second.decode_plan is not None
    assert (
        isinstance(first.decode_plan.scratch, PageScratch) and second.decode_plan.scratch is first.decode_plan.scratch
    )
