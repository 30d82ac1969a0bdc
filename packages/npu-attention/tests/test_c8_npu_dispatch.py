# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The C8 (int8 KV cache) NPU path of the GQA backend against the documented stand-in torch_npu of
test_npu_dispatch.py: ``npu_quantize`` + ``npu_scatter_nd_update_`` on write, FIA with ``antiquant_scale`` (BSH
``[2, H]`` in the query dtype for Q_S = 1, ``[2, Nkv, D]`` float16 for TND) on read; results against the plain
fake-quant dense reference (float16 tolerances)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from attn_harness import TOLERANCES, dense_reference, make_batch, make_builder
from test_npu_dispatch import fake_npu  # noqa: F401 (the fixture)
from vllm_npu.attention.backends.gqa import AscendAttentionBackend, AscendAttentionImpl
from vllm_npu.attention.metadata import AscendAttentionState as S
from vllm_npu.attention.ops.c8_cache import quantize_reference
from vllm_npu.interface import ConfigError

NKV, D, N = 2, 64, 8
CASES = {
    "prefill_no_cache": ([5, 17, 1, 40], [0, 0, 0, 0], S.PrefillNoCache, 0, "TND,sparse_mode=3"),
    "decode_only": ([1, 1, 1, 1], [4, 127, 128, 300], S.DecodeOnly, 0, "BSH,qs1"),
    "chunked_mixed": ([1, 1, 7, 30], [9, 200, 0, 20], S.ChunkedPrefill, 0, "TND,sparse_mode=3"),
    "prefix_hit": ([12, 20], [128, 256], S.PrefillCacheHit, 0, "TND,sparse_mode=3"),
    "spec_decoding": ([4, 1, 3], [10, 130, 0], S.SpecDecoding, 3, "TND,sparse_mode=3"),
}


def _fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.double().view(NKV, D)
    return torch.round(x.double() / s).clamp(-128, 127) * s


@pytest.mark.parametrize("case", sorted(CASES))
def test_c8_npu_path_matches_fake_quant(fake_npu, case: str) -> None:  # noqa: F811
    q_lens, ctx_lens, state, spec, kernel = CASES[case]
    batch = make_batch(
        q_lens, ctx_lens, num_heads=N, num_kv_heads=NKV, head_size=D, block_size=128, dtype=torch.float16,
        num_pad=3, seed=len(case),
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    k_scale, v_scale = (torch.empty(NKV * D).uniform_(0.01, 0.04, generator=g) for _ in range(2))
    cache = torch.empty(batch.kv_cache.shape, dtype=torch.int8)
    for i, s in ((0, k_scale), (1, v_scale)):
        cache[i] = quantize_reference(batch.kv_cache[i].reshape(-1, NKV, D), s).view(cache[i].shape)
    md = make_builder(128, NKV, D, torch.int8, spec).build(0, batch.common)
    assert md.attn_state is state
    impl = AscendAttentionImpl(N, D, D**-0.5, NKV, None, None, "int8", None, "decoder")
    layer = SimpleNamespace(layer_name="layer.0", key_antiquant_scale=k_scale, value_antiquant_scale=v_scale)
    out = torch.full_like(batch.query, 7.0)
    impl.forward(layer, batch.query, batch.key, batch.value, cache, md, output=out)
    assert fake_npu[:4] == ["npu_quantize", "npu_scatter_nd_update_"] * 2, fake_npu
    assert len(fake_npu) == 5 and kernel in fake_npu[4], fake_npu
    batch.full_k = [_fake_quant(k, k_scale) for k in batch.full_k]
    batch.full_v = [_fake_quant(v, v_scale) for v in batch.full_v]
    expected = dense_reference(batch, num_heads=N, num_kv_heads=NKV, head_size=D)
    n = batch.num_tokens
    torch.testing.assert_close(out[:n].double(), expected, **TOLERANCES[torch.float16])
    assert bool((out[n:] == 0).all())


def test_c8_npu_alignment_refusals(fake_npu) -> None:  # noqa: F811
    with pytest.raises(ConfigError, match="head_size=48: int8 K/V need a multiple of 32"):
        AscendAttentionImpl(4, 48, 1.0, 2, None, None, "int8", None, "decoder")
    with pytest.raises(ConfigError, match="multiple of 32 on the NPU"):
        AscendAttentionBackend.get_kv_cache_shape(4, 16, 2, 64, "int8")
