# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""AscendAttentionImpl (reference kernels) against a dense softmax(QK^T)V reference, state by state.

Tolerances (max abs / rel vs the float64 dense reference): float32 2e-5 / 1e-5, float16 4e-3 / 4e-3,
bfloat16 3e-2 / 3e-2 (inputs are N(0, 1); the kernels compute in fp32 and round once at the output).
"""

from __future__ import annotations

import pytest
import torch
from attn_harness import TOLERANCES, dense_reference, make_batch, run_impl
from vllm_npu.attention.metadata import AscendAttentionState as S

NUM_KV_HEADS = 2
HEAD_SIZE = 32

# (q_lens, ctx_lens, expected state, num_speculative_tokens)
CASES = {
    "prefill_no_cache": ([5, 17, 1, 40], [0, 0, 0, 0], S.PrefillNoCache, 0),
    "decode_only": ([1, 1, 1, 1, 1], [4, 15, 16, 33, 140], S.DecodeOnly, 0),
    "chunked_mixed": ([1, 1, 1, 7, 30], [9, 31, 128, 0, 20], S.ChunkedPrefill, 0),
    "prefix_hit": ([12, 20, 3], [16, 32, 128], S.PrefillCacheHit, 0),
    "spec_decoding": ([4, 1, 3, 4], [10, 25, 130, 0], S.SpecDecoding, 3),
}


def _check(batch, out, expected, dtype):
    n = batch.num_tokens
    torch.testing.assert_close(out[:n].double(), expected, **TOLERANCES[dtype])
    if batch.num_pad:  # rows past num_actual_tokens are zeroed (the impl fills its whole output buffer)
        assert bool((out[n:] == 0).all())


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("block_size", [16, 128])
def test_states_fp32(case: str, gqa: int, block_size: int) -> None:
    q_lens, ctx_lens, state, spec = CASES[case]
    nh = NUM_KV_HEADS * gqa
    batch = make_batch(
        q_lens,
        ctx_lens,
        num_heads=nh,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        block_size=block_size,
        num_pad=3,
        seed=gqa * 100 + block_size,
    )
    out, md = run_impl(batch, num_heads=nh, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, num_speculative_tokens=spec)
    assert md.attn_state is state
    expected = dense_reference(batch, num_heads=nh, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE)
    _check(batch, out, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["chunked_mixed", "decode_only", "prefill_no_cache"])
def test_states_half_precision(dtype: torch.dtype, case: str) -> None:
    q_lens, ctx_lens, _, spec = CASES[case]
    batch = make_batch(
        q_lens, ctx_lens, num_heads=8, num_kv_heads=2, head_size=64, block_size=128, dtype=dtype, num_pad=2, seed=5
    )
    out, _ = run_impl(batch, num_heads=8, num_kv_heads=2, head_size=64, num_speculative_tokens=spec)
    assert out.dtype == dtype
    expected = dense_reference(batch, num_heads=8, num_kv_heads=2, head_size=64)
    _check(batch, out, expected, dtype)


def test_kv_cache_write_skips_padding_slots() -> None:
    batch = make_batch(
        [3, 1, 6], [0, 9, 20], num_heads=4, num_kv_heads=2, head_size=16, block_size=16, num_pad=4, seed=11
    )
    before = batch.kv_cache.clone()
    run_impl(batch, num_heads=4, num_kv_heads=2, head_size=16)
    slots = batch.common.slot_mapping
    flat_k = batch.kv_cache[0].reshape(-1, 2, 16)
    flat_v = batch.kv_cache[1].reshape(-1, 2, 16)
    real = slots[: batch.num_tokens]
    torch.testing.assert_close(flat_k[real], batch.key[: batch.num_tokens], rtol=0, atol=0)
    torch.testing.assert_close(flat_v[real], batch.value[: batch.num_tokens], rtol=0, atol=0)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[real] = False
    assert torch.equal(flat_k[untouched], before[0].reshape(-1, 2, 16)[untouched])
    assert torch.equal(flat_v[untouched], before[1].reshape(-1, 2, 16)[untouched])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [1, 5, 24])
def test_sliding_window(case: str, window: int) -> None:
    q_lens, ctx_lens, state, spec = CASES[case]
    batch = make_batch(
        q_lens, ctx_lens, num_heads=4, num_kv_heads=2, head_size=HEAD_SIZE, block_size=16, num_pad=1, seed=window
    )
    out, md = run_impl(
        batch, num_heads=4, num_kv_heads=2, head_size=HEAD_SIZE, sliding_window=window, num_speculative_tokens=spec
    )
    assert md.attn_state is state
    expected = dense_reference(batch, num_heads=4, num_kv_heads=2, head_size=HEAD_SIZE, sliding_window=window)
    _check(batch, out, expected, torch.float32)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_soft_cap(case: str) -> None:
    q_lens, ctx_lens, _, spec = CASES[case]
    batch = make_batch(q_lens, ctx_lens, num_heads=4, num_kv_heads=1, head_size=HEAD_SIZE, block_size=16, seed=3)
    # scale 1.0 makes raw scores ~N(0, 32): the cap of 5 changes the result a lot, so a missing cap would fail.
    kw = {"num_heads": 4, "num_kv_heads": 1, "head_size": HEAD_SIZE, "logits_soft_cap": 5.0, "scale": 1.0}
    out, _ = run_impl(batch, num_speculative_tokens=spec, **kw)
    expected = dense_reference(batch, **kw)
    _check(batch, out, expected, torch.float32)
    uncapped = dense_reference(batch, **{**kw, "logits_soft_cap": None})
    assert (expected - uncapped).abs().max() > 0.1


@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 3])
def test_encoder_only_bidirectional(gqa: int, window: int | None) -> None:
    nh = 2 * gqa
    q_lens = [7, 1, 19, 33]
    batch = make_batch(
        q_lens,
        [0] * len(q_lens),
        num_heads=nh,
        num_kv_heads=2,
        head_size=HEAD_SIZE,
        block_size=16,
        num_pad=2,
        causal=False,
        seed=gqa,
    )
    before = batch.kv_cache.clone()
    out, md = run_impl(
        batch, num_heads=nh, num_kv_heads=2, head_size=HEAD_SIZE, encoder_only=True, sliding_window=window
    )
    assert not md.causal
    expected = dense_reference(
        batch, num_heads=nh, num_kv_heads=2, head_size=HEAD_SIZE, causal=False, sliding_window=window
    )
    _check(batch, out, expected, torch.float32)
    assert torch.equal(batch.kv_cache, before)  # encoder-only attention never writes a cache
    causal = dense_reference(batch, num_heads=nh, num_kv_heads=2, head_size=HEAD_SIZE)
    assert (expected - causal).abs().max() > 0.1


def test_long_and_short_requests_in_one_batch() -> None:
    # 64 decodes + 2 spec-like short rows + one long chunk: exercises the batched short path and the per-request loop.
    q_lens = [1] * 64 + [300]
    ctx_lens = [int(x) for x in torch.randint(1, 200, (64,), generator=torch.Generator().manual_seed(0))] + [50]
    batch = make_batch(q_lens, ctx_lens, num_heads=8, num_kv_heads=2, head_size=16, block_size=16, seed=9)
    out, md = run_impl(batch, num_heads=8, num_kv_heads=2, head_size=16)
    assert md.attn_state is S.ChunkedPrefill
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens) == (64, 1, 64)
    expected = dense_reference(batch, num_heads=8, num_kv_heads=2, head_size=16)
    _check(batch, out, expected, torch.float32)


def test_profile_run_zero_fills_output() -> None:
    from vllm_npu.attention.backends.gqa import AscendAttentionImpl

    impl = AscendAttentionImpl(4, 16, 0.25, 2, None, None, "auto", None, "decoder")
    output = torch.full((5, 4, 16), 3.0)
    q = torch.randn(5, 4, 16)
    k = torch.randn(5, 2, 16)
    assert impl.forward(None, q, k, k, torch.empty(0), None, output=output) is output
    assert bool((output == 0).all())


@pytest.mark.parametrize("seed", range(12))
def test_random_batches(seed: int) -> None:
    # Random request mix, GQA ratio, head size, block size, window and spec depth; decodes first as vLLM orders them.
    g = torch.Generator().manual_seed(1000 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    nkv, gqa, d, bs = pick([1, 2, 4]), pick([1, 2, 4]), pick([16, 32, 64]), pick([16, 32, 128])
    spec = pick([0, 0, 2])
    window = pick([None, None, 7, 40])
    num_decodes, num_prefills = int(torch.randint(0, 6, (1,), generator=g)), int(torch.randint(0, 4, (1,), generator=g))
    num_decodes += num_decodes + num_prefills == 0
    q_lens = [int(torch.randint(1, 2 + spec, (1,), generator=g)) for _ in range(num_decodes)]
    q_lens += [int(torch.randint(spec + 2, 70, (1,), generator=g)) for _ in range(num_prefills)]
    ctx_lens = [int(torch.randint(0, 300, (1,), generator=g)) for _ in q_lens]
    batch = make_batch(
        q_lens,
        ctx_lens,
        num_heads=nkv * gqa,
        num_kv_heads=nkv,
        head_size=d,
        block_size=bs,
        num_pad=int(torch.randint(0, 4, (1,), generator=g)),
        seed=seed,
    )
    kw = {"num_heads": nkv * gqa, "num_kv_heads": nkv, "head_size": d, "sliding_window": window}
    out, _ = run_impl(batch, num_speculative_tokens=spec, **kw)
    _check(batch, out, dense_reference(batch, **kw), torch.float32)
