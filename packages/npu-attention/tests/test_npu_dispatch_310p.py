# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The 310P NPU path of the GQA backend against a stand-in ``torch_npu`` written from the torch_npu 2.8.0 ATB docs.

Each fake op sits behind the wheel's documented signature (``rules.documented``) and reads the NZ layouts element by
element from the docs' description (cache ``[num_blocks, head_size * num_heads / 16, block_size, 16]``; masks as
column tiles of 16), independently of the plugin's ``ops/nz.py``. The fakes check what the 310P calls need: the
first prefill's 16-aligned token count, int32 lengths (host for the flash kernels, device for the paged ones),
masks cast to FRACTAL_NZ (29) right before the kernel, int32 slots. The impl, run with the kernel backend forced to
``npu`` on the emulated 310P, must then match the dense reference.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import vllm_npu.attention.backends.gqa as gqa_mod
import vllm_npu.attention.backends.gqa_310p as gqa_310p_mod
import vllm_npu.attention.metadata as metadata_mod
from attn_harness import TOLERANCES, dense_reference, make_batch, run_impl
from npu_testkit import npu_binding_rules as rules
from vllm_npu.attention.metadata import AscendAttentionState as S
from vllm_npu.interface import reset_chip

CALLS: list[str] = []
CAST: list[torch.Tensor] = []  # the tensors npu_format_cast tagged FRACTAL_NZ


def _nz_token(cache: torch.Tensor, block: int, offset: int, nkv: int) -> torch.Tensor:
    """One cached token ``[Nkv, D]`` of a 310P cache ``[nb, H / 16, bs, 16]``: hidden ``h`` at ``[h // 16, s, h % 16]``."""
    tiles = cache.shape[1]
    flat = torch.stack([cache[block, c, offset, i] for c in range(tiles) for i in range(16)])
    return flat.reshape(nkv, -1)


def _nz_matrix(mask: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Element ``(r, c)`` of an NZ matrix ``[C16 / 16, R16, 16]`` at ``[c // 16, r, c % 16]``."""
    out = torch.empty(rows, cols, dtype=torch.float64)
    for c in range(cols):
        out[:, c] = mask[c // 16, :rows, c % 16].double()
    return out


def _attend(q, k, v, bias, scale):
    """q [Sq, N, D], k/v [Sk, Nkv, D], bias [Sq, Sk] additive -> [Sq, N, D] float64."""
    n, nkv = q.shape[1], k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(n):
        s = q[:, h].double() @ k[:, h // (n // nkv)].double().T * scale + bias
        out[:, h] = torch.softmax(s, -1) @ v[:, h // (n // nkv)].double()
    return out


def _check_cast(mask: torch.Tensor) -> None:
    assert CAST and mask is CAST[-1], "the mask must be cast to FRACTAL_NZ right before the kernel"


def npu_format_cast(input, acl_format, customize_dtype=None):  # noqa: A002  (the documented parameter name)
    CALLS.append(f"npu_format_cast[{acl_format}]")
    assert acl_format == 29 and input.is_contiguous()
    CAST.append(input)
    return input


def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    CALLS.append("_npu_reshape_and_cache")
    assert slot_indices.dtype == torch.int32 and key_cache.is_contiguous() and key_cache.dim() == 4
    nb, tiles, bs, tile = key_cache.shape
    assert tile == 16 and tiles * 16 == key[0].numel()
    for t, slot in enumerate(slot_indices.tolist()):
        for cache, src in ((key_cache, key), (value_cache, value)):
            flat = src[t].reshape(-1)
            for h in range(flat.numel()):
                cache[slot // bs, h // 16, slot % bs, h % 16] = flat[h]


def _npu_flash_attention(query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads, out):
    CALLS.append("_npu_flash_attention")
    _check_cast(mask)
    lens = seq_len.tolist()
    assert seq_len.dtype == torch.int32 and seq_len.device.type == "cpu"
    total16 = -(-sum(lens) // 16) * 16
    assert query.shape[0] == key.shape[0] == value.shape[0] == out.shape[0] == total16  # ATB constraint 4 (310P)
    s16 = -(-max(lens) // 16) * 16
    assert mask.shape == (len(lens), s16 // 16, s16, 16) and mask.dtype == torch.float16
    start = 0
    for b, n in enumerate(lens):
        bias = _nz_matrix(mask[b], n, n)
        rows = slice(start, start + n)
        out[rows] = _attend(query[rows], key[rows], value[rows], bias, scale_value).to(out.dtype)
        start += n


def _npu_paged_attention(
    query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table, context_lens, out, workspace=None
):
    CALLS.append("_npu_paged_attention")
    assert context_lens.dtype == torch.int32 and context_lens.device == query.device
    bs = key_cache.shape[2]
    for b, n in enumerate(context_lens.tolist()):
        blocks = block_table[b].tolist()
        k = torch.stack([_nz_token(key_cache, blocks[p // bs], p % bs, num_kv_heads) for p in range(n)])
        v = torch.stack([_nz_token(value_cache, blocks[p // bs], p % bs, num_kv_heads) for p in range(n)])
        out[b : b + 1] = _attend(query[b : b + 1], k, v, torch.zeros(1, n, dtype=torch.float64), scale_value)


def _npu_paged_attention_splitfuse(
    query, key_cache, value_cache, block_table, context_lens, mask, seq_len, num_kv_heads, num_heads, scale_value, out
):
    CALLS.append("_npu_paged_attention_splitfuse")
    _check_cast(mask)
    assert seq_len.dtype == torch.int32 and seq_len.device.type == "cpu"
    assert context_lens.dtype == torch.int32 and context_lens.device == query.device
    qlens, lens = seq_len.tolist(), context_lens.tolist()
    assert mask.shape[0] == 1 and mask.shape[2] == -(-sum(qlens) // 16) * 16
    bias = _nz_matrix(mask[0], sum(qlens), max(lens))
    bs, start = key_cache.shape[2], 0
    for b, (q, n) in enumerate(zip(qlens, lens)):
        blocks = block_table[b].tolist()
        k = torch.stack([_nz_token(key_cache, blocks[p // bs], p % bs, num_kv_heads) for p in range(n)])
        v = torch.stack([_nz_token(value_cache, blocks[p // bs], p % bs, num_kv_heads) for p in range(n)])
        rows = slice(start, start + q)
        out[rows] = _attend(query[rows], k, v, bias[rows, :n], scale_value).to(out.dtype)
        start += q


@pytest.fixture
def fake_npu_310p(monkeypatch):
    monkeypatch.setenv("VLLM_NPU_EMULATED_SOC", "310P")
    reset_chip()
    fake = types.ModuleType("torch_npu")
    for op in (
        npu_format_cast,
        _npu_reshape_and_cache,
        _npu_flash_attention,
        _npu_paged_attention,
        _npu_paged_attention_splitfuse,
    ):
        setattr(fake, op.__name__, rules.documented(op))
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    for mod in (gqa_mod, gqa_310p_mod, metadata_mod):
        monkeypatch.setattr(mod, "kernel_backend", lambda: "npu")
    CALLS.clear()
    CAST.clear()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)  # vLLM builds layers under the model dtype; the NPU impl checks it
    yield CALLS
    torch.set_default_dtype(old)
    monkeypatch.delenv("VLLM_NPU_EMULATED_SOC")
    reset_chip()


CASES = {
    "prefill_no_cache": ([5, 17, 1], [0, 0, 0], S.PrefillNoCache, "_npu_flash_attention"),
    "decode_only": ([1, 1, 1], [4, 127, 130], S.DecodeOnly, "_npu_paged_attention"),
    "chunked_mixed": ([1, 7, 20], [9, 0, 13], S.ChunkedPrefill, "_npu_paged_attention_splitfuse"),
    "prefix_hit": ([6, 3], [16, 130], S.PrefillCacheHit, "_npu_paged_attention_splitfuse"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_310p_npu_path_matches_dense_reference(fake_npu_310p, case):
    q_lens, ctx_lens, state, kernel = CASES[case]
    dims = {"num_heads": 4, "num_kv_heads": 2, "head_size": 16}
    batch = make_batch(q_lens, ctx_lens, block_size=128, dtype=torch.float16, num_pad=2, seed=len(case), **dims)
    two, nb, bs, nkv, d = batch.kv_cache.shape
    batch.kv_cache = batch.kv_cache.reshape(two, nb, bs, nkv * d // 16, 16).permute(0, 1, 3, 2, 4).contiguous()
    out, md = run_impl(batch, block_size=bs, **dims)
    assert md.attn_state is state
    n = batch.num_tokens
    torch.testing.assert_close(out[:n].double(), dense_reference(batch, **dims), **TOLERANCES[torch.float16])
    assert bool((out[n:] == 0).all())
    casts = ["npu_format_cast[29]"] if state is not S.DecodeOnly else []
    assert fake_npu_310p == ["_npu_reshape_and_cache", *casts, kernel], fake_npu_310p
