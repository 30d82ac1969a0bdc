# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The NPU code path of the GQA backend, run against a stand-in ``torch_npu`` written from the torch_npu 2.8.0 docs.

No Ascend hardware exists here, so the ``torch_npu`` module is replaced by a fake whose ops follow the documented
semantics (layouts, cumulative vs per-request lengths, ``sparse_mode`` 3 = right-down causal, 4 = band from the
right-down corner, masks where 1/True = masked), check the documented constraints (contiguity, slot range,
mask shape/dtype, block size) and the rules torch_npu 2.8.0's bindings add (``npu_testkit.npu_binding_rules``: the
``PA_NZ`` cache mode ``npu_scatter_pa_kv_cache`` hard-codes, int32 slots of ``_npu_reshape_and_cache``, ``pre_tokens``
/ ``sparse_mode`` ignored when Q_S == 1). Running the impl with the kernel backend forced to ``npu`` then checks the argument
plumbing of every NPU twin: the result must match the dense reference like the reference path does.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import vllm_npu.attention.backends.gqa as gqa_mod
import vllm_npu.attention.metadata as metadata_mod
from attn_harness import TOLERANCES, dense_reference, make_batch, run_impl
from npu_testkit import npu_binding_rules as rules
from vllm_npu.attention.metadata import AscendAttentionState as S

CALLS: list[str] = []


def _attend(q, k, v, allowed, scale, n, nkv):
    """q [Sq, N, D], k/v [Sk, Nkv, D], allowed [Sq, Sk] -> [Sq, N, D] in float64."""
    group = n // nkv
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(n):
        s = q[:, h].double() @ k[:, h // group].double().T * scale
        s = s.masked_fill(~allowed, float("-inf"))
        out[:, h] = torch.softmax(s, -1) @ v[:, h // group].double()
    return out


def _pages(cache, row, length):
    bs = cache.shape[1]
    nblk = -(-length // bs)
    return cache[row[:nblk].long()].reshape(-1, *cache.shape[2:])[:length]


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, **kw):
    CALLS.append("npu_scatter_pa_kv_cache")
    rules.scatter_pa_kv_cache_nz_shapes(key, key_cache, value, value_cache)  # 2.8.0 hard-codes cacheMode PA_NZ
    raise AssertionError("an NZ-shaped KV cache is not a layout this backend allocates")


def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    CALLS.append("_npu_reshape_and_cache")
    rules.reshape_and_cache(key, value, key_cache, value_cache, slot_indices)
    keep = slot_indices >= 0  # negative slots are skipped by the kernel
    slots = slot_indices.long()[keep]
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep]
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep]


def _npu_paged_attention_v2(
    query,
    key_cache,
    block_table,
    context_lens,
    *,
    value_cache,
    num_kv_heads,
    num_heads,
    scale_value,
    mask=None,
    mask_type=0,
    workspace=None,
    out,
):
    CALLS.append("_npu_paged_attention_v2")
    rules.paged_attention_v2_call(query, key_cache, value_cache, block_table, context_lens, mask_type, out)
    assert mask is None and mask_type == 0 and isinstance(context_lens, list)
    for b, length in enumerate(context_lens):
        k, v = _pages(key_cache, block_table[b], length), _pages(value_cache, block_table[b], length)
        allowed = torch.ones(1, length, dtype=torch.bool)
        out[b] = _attend(query[b : b + 1], k, v, allowed, scale_value, num_heads, num_kv_heads)[0].to(out.dtype)
    return out


def npu_fused_infer_attention_score(
    query,
    key,
    value,
    *,
    block_table,
    input_layout,
    block_size,
    actual_seq_lengths,
    actual_seq_lengths_kv,
    num_key_value_heads,
    num_heads,
    scale,
    atten_mask=None,
    sparse_mode=0,
    pre_tokens=2147483647,
    next_tokens=2147483647,
    query_rope=None,
    key_rope=None,
    antiquant_scale=None,
    antiquant_mode=0,
):
    assert query_rope is None and key_rope is None, "the GQA paths never use the MLA mode"
    assert antiquant_mode == 0, "per-channel antiquant only (C8)"
    assert input_layout in ("TND", "BSH") and key.dim() == 3 and key.shape[1] == block_size
    assert block_size % 16 == 0 and block_size <= 512 and query.dtype in (torch.float16, torch.bfloat16)
    d = query.shape[-1] if input_layout == "TND" else query.shape[-1] // num_heads
    if input_layout == "BSH":  # [B, S, N*D] -> packed [B*S, N, D] with per-request ends
        b, s_len = query.shape[:2]
        ends = [(i + 1) * s_len for i in range(b)]
        q = query.reshape(b * s_len, num_heads, d)
    else:
        ends, q = list(actual_seq_lengths), query
    assert ends == sorted(ends) and ends[-1] == q.shape[0] and len(ends) == len(actual_seq_lengths_kv)
    qs1 = rules.fia_query_s_is_one(query, input_layout, actual_seq_lengths)
    if qs1:  # the kernel ignores pre_tokens / next_tokens / sparse_mode (rules.FIA_QS1_IGNORES)
        user_mask = atten_mask is not None and atten_mask.shape != (2048, 2048)
        if user_mask:
            rules.fia_paged_mask(atten_mask, len(ends), block_table, block_size)
        mode = "qs1+mask" if user_mask else "qs1"
    else:
        assert input_layout == "TND"
        rules.fia_paged_tnd(block_size, query)
        assert atten_mask.shape == (2048, 2048) and atten_mask.dtype in (torch.int8, torch.bool, torch.uint8)
        assert bool((atten_mask.bool() == torch.ones(2048, 2048, dtype=torch.bool).triu(1)).all())
        mode = f"sparse_mode={sparse_mode}"
    CALLS.append(f"npu_fused_infer_attention_score[{input_layout},{mode}]")
    kc = key.view(key.shape[0], block_size, -1, d)
    vc = value.view(value.shape[0], block_size, -1, d)
    if antiquant_scale is not None:  # C8: int8 pages, per-channel scales [2, H] (BSH, query dtype) / fp16 (Q_S >= 2)
        assert key.dtype == value.dtype == torch.int8 and d % 32 == 0 and block_size % 32 == 0
        assert antiquant_scale.dtype == (query.dtype if qs1 else torch.float16)
        assert antiquant_scale.shape == ((2, kc.shape[2] * d) if input_layout == "BSH" else (2, kc.shape[2], d))
        sc = antiquant_scale.double().reshape(2, 1, 1, kc.shape[2], d)
        kc, vc = kc.double() * sc[0], vc.double() * sc[1]
    else:
        assert key.dtype == query.dtype
    out = torch.empty_like(q)
    start = 0
    for b, (end, kv_len) in enumerate(zip(ends, actual_seq_lengths_kv)):
        q_len = end - start
        k, v = _pages(kc, block_table[b], kv_len), _pages(vc, block_table[b], kv_len)
        diag = kv_len - q_len + torch.arange(q_len)[:, None]  # right-down aligned position of each query row
        j = torch.arange(kv_len)[None, :]
        if qs1:
            allowed = j <= diag
            if mode == "qs1+mask":
                allowed = allowed & ~atten_mask[b, :, :kv_len].bool()
        elif sparse_mode == 3:
            allowed = j <= diag
        elif sparse_mode == 4:
            allowed = (j >= diag - pre_tokens) & (j <= diag + next_tokens)
        else:
            raise AssertionError(f"unexpected sparse_mode {sparse_mode}")
        out[start:end] = _attend(q[start:end], k, v, allowed, scale, num_heads, num_key_value_heads).to(out.dtype)
        start = end
    return out.view(query.shape), torch.zeros(1)


def npu_fused_infer_attention_score_out(query, key, value, *, workspace=None, out, **kwargs):
    """The ``.out`` overload (registered schema: ``..., Tensor? workspace=None, Tensor[] out``): the functional
    semantics written into ``out[0]``; ``out[1]`` is the softmax LSE buffer (not computed: ``softmax_lse_flag``
    is off)."""
    attention_out, lse = out
    result, _ = npu_fused_infer_attention_score(query, key, value, **kwargs)
    attention_out.copy_(result.view(attention_out.shape))
    return attention_out, lse


def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
    CALLS.append("npu_quantize")
    assert dtype == torch.qint8 and axis == -1 and div_mode and zero_points is None
    assert scales.dtype in (torch.float32, torch.bfloat16) and scales.shape == (input.shape[-1],)
    return torch.round(input.float() / scales.float()).clamp(-128, 127).to(torch.int8)


def npu_scatter_nd_update_(input, indices, updates):
    CALLS.append("npu_scatter_nd_update_")
    assert input.dtype == updates.dtype and indices.dtype in (torch.int32, torch.int64)
    assert updates.shape == indices.shape[:-1] + input.shape[indices.shape[-1] :]
    assert bool((indices >= 0).all()), "indices out of range are not supported (docs)"
    input[tuple(indices.long().unbind(-1))] = updates
    return input


def _npu_fused_infer_attention_score_get_max_workspace(query, key, value, **kwargs):
    CALLS.append("get_max_workspace")
    return torch.empty(64, dtype=torch.uint8)


def _npu_paged_attention_v2_get_workspace(query, key_cache, block_table, context_lens, **kwargs):
    CALLS.append(f"_npu_paged_attention_v2_get_workspace{list(context_lens)}")
    return torch.empty(16 * len(context_lens), dtype=torch.uint8)


def _npu_flash_attention_v2(query, key, value, seq_len, *, mask, mask_type, scale_value, num_heads, num_kv_heads, out):
    CALLS.append("_npu_flash_attention_v2")
    rules.flash_attention_v2_call(query, mask, mask_type, seq_len, out)
    start = 0
    for length in seq_len:
        allowed = mask[:length, :length] == 0
        end = start + length
        out[start:end] = _attend(
            query[start:end], key[start:end], value[start:end], allowed, scale_value, num_heads, num_kv_heads
        ).to(out.dtype)
        start = end
    return out


def npu_fusion_attention(
    query,
    key,
    value,
    head_num,
    input_layout,
    *,
    atten_mask,
    scale,
    pre_tockens,
    next_tockens,
    actual_seq_qlen,
    actual_seq_kvlen,
    sparse_mode,
):
    CALLS.append(f"npu_fusion_attention[sparse_mode={sparse_mode}]")
    assert input_layout == "TND" and sparse_mode == 4 and atten_mask.dtype == torch.bool
    assert atten_mask.shape == (2048, 2048) and list(actual_seq_qlen) == list(actual_seq_kvlen)
    out = torch.empty_like(query)
    start = 0
    for end in actual_seq_qlen:
        length = end - start
        i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
        allowed = (j >= i - pre_tockens) & (j <= i + next_tockens)  # band from the (square) right-down corner
        out[start:end] = _attend(
            query[start:end], key[start:end], value[start:end], allowed, scale, head_num, key.shape[1]
        ).to(out.dtype)
        start = end
    return out, None, None, None, 0, 0, 0


@pytest.fixture
def fake_npu(monkeypatch):
    fake = types.ModuleType("torch_npu")  # every op behind its documented 2.8.0 signature
    for op in (
        npu_scatter_pa_kv_cache,
        _npu_reshape_and_cache,
        npu_fused_infer_attention_score,
        npu_fusion_attention,
        _npu_fused_infer_attention_score_get_max_workspace,
        npu_quantize,
        npu_scatter_nd_update_,
    ):
        setattr(fake, op.__name__, rules.documented(op))
    fake.npu_fused_infer_attention_score.out = rules.documented(
        npu_fused_infer_attention_score_out, name="npu_fused_infer_attention_score.out"
    )
    fake.atb = types.SimpleNamespace(
        **{
            op.__name__: rules.documented(op, namespace="atb")
            for op in (_npu_paged_attention_v2, _npu_flash_attention_v2, _npu_paged_attention_v2_get_workspace)
        }
    )
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(gqa_mod, "kernel_backend", lambda: "npu")
    monkeypatch.setattr(metadata_mod, "kernel_backend", lambda: "npu")
    CALLS.clear()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)  # vLLM builds layers under the model dtype; the NPU impl checks it
    yield CALLS
    torch.set_default_dtype(old)


CASES = {
    "prefill_no_cache": ([5, 17, 1, 40], [0, 0, 0, 0], S.PrefillNoCache, 0, "_npu_flash_attention_v2"),
    "decode_only": ([1, 1, 1, 1], [4, 127, 128, 300], S.DecodeOnly, 0, "_npu_paged_attention_v2"),
    "chunked_mixed": ([1, 1, 7, 30], [9, 200, 0, 20], S.ChunkedPrefill, 0, "sparse_mode=3"),
    "prefix_hit": ([12, 20], [128, 256], S.PrefillCacheHit, 0, "sparse_mode=3"),
    "spec_decoding": ([4, 1, 3], [10, 130, 0], S.SpecDecoding, 3, "sparse_mode=3"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [None, 6])
def test_npu_path_matches_dense_reference(fake_npu, case: str, window: int | None) -> None:
    q_lens, ctx_lens, state, spec, kernel = CASES[case]
    batch = make_batch(
        q_lens,
        ctx_lens,
        num_heads=8,
        num_kv_heads=2,
        head_size=64,
        block_size=128,
        dtype=torch.float16,
        num_pad=3,
        seed=len(case),
    )
    out, md = run_impl(
        batch, num_heads=8, num_kv_heads=2, head_size=64, sliding_window=window, num_speculative_tokens=spec
    )
    assert md.attn_state is state and md.splitfuse_mask is not None
    expected = dense_reference(batch, num_heads=8, num_kv_heads=2, head_size=64, sliding_window=window)
    n = batch.num_tokens
    torch.testing.assert_close(out[:n].double(), expected, **TOLERANCES[torch.float16])
    assert bool((out[n:] == 0).all())  # padded rows zeroed: the impl fills its whole output buffer
    assert fake_npu[0] == "_npu_reshape_and_cache" and len(fake_npu) == 2
    # a single-token decode with a window cannot rely on pre_tokens (ignored when Q_S == 1): BSH with a window mask
    expected_kernel = kernel if window is None else ("BSH,qs1+mask" if state is S.DecodeOnly else "sparse_mode=4")
    assert expected_kernel in fake_npu[1], fake_npu


@pytest.mark.parametrize("window", [None, 4])
def test_npu_encoder_path(fake_npu, window: int | None) -> None:
    batch = make_batch(
        [6, 1, 25],
        [0, 0, 0],
        num_heads=4,
        num_kv_heads=2,
        head_size=32,
        block_size=128,
        dtype=torch.float16,
        num_pad=1,
        causal=False,
        seed=2,
    )
    out, md = run_impl(batch, num_heads=4, num_kv_heads=2, head_size=32, encoder_only=True, sliding_window=window)
    assert md.attn_mask is not None and md.attn_mask.dtype == torch.bool
    assert fake_npu == ["npu_fusion_attention[sparse_mode=4]"]  # no cache write for encoder-only layers
    expected = dense_reference(batch, num_heads=4, num_kv_heads=2, head_size=32, causal=False, sliding_window=window)
    torch.testing.assert_close(out[: batch.num_tokens].double(), expected, **TOLERANCES[torch.float16])


def test_npu_builder_requires_block_128(fake_npu) -> None:
    from attn_harness import make_builder
    from vllm_npu.interface import ConfigError

    with pytest.raises(ConfigError, match="--block-size 128"):
        make_builder(16, 2, 64, torch.float16)
