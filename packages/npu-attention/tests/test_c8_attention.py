# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The int8 KV cache (C8) in every attention state, against plain fake-quant maths.

The golden form: every K/V a request attends to is ``clamp(round(x / s), -128, 127) * s`` (per channel ``s``), then
the dense float64 ``softmax(QK^T)V`` of attn_harness. The impl runs the C8 write (new tokens quantized into the
int8 cache) and the C8 kernels over it; the cached context is quantized the same way before the step.
Tolerances: float32 2e-5 / 1e-5 (the dequantized values are exact in float32; only the attention sums differ),
bfloat16 3e-2 / 3e-2 as the float states.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from attn_harness import TOLERANCES, dense_reference, make_batch, make_builder
from vllm_npu.attention.backends.gqa import AscendAttentionBackend, AscendAttentionImpl
from vllm_npu.attention.metadata import AscendAttentionState as S
from vllm_npu.attention.ops.c8_cache import C8_KV_WRITE, quantize_reference
from vllm_npu.attention.selector import GQA_BACKEND, select_backend
from vllm_npu.interface import ConfigError, KernelContractError

NKV, D = 2, 32
CASES = {
    "prefill_no_cache": ([5, 17, 1, 40], [0, 0, 0, 0], S.PrefillNoCache, 0),
    "decode_only": ([1, 1, 1, 1, 1], [4, 15, 16, 33, 140], S.DecodeOnly, 0),
    "chunked_mixed": ([1, 1, 1, 7, 30], [9, 31, 128, 0, 20], S.ChunkedPrefill, 0),
    "prefix_hit": ([12, 20, 3], [16, 32, 128], S.PrefillCacheHit, 0),
    "spec_decoding": ([4, 1, 3, 4], [10, 25, 130, 0], S.SpecDecoding, 3),
}


def _scales(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # per channel, around max|N(0,1)| / 127, some channels clipping (small scale), some coarse (large)
    return tuple(torch.empty(NKV * D).uniform_(0.01, 0.05, generator=g) for _ in range(2))  # type: ignore[return-value]


def _fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Plain fake-quant, written out independently of the kernels: round half to even, clamp, rescale."""
    s = scale.double().view(NKV, D)
    return (torch.round(x.double() / s).clamp(-128, 127) * s).to(x.dtype)


def _run(case: str, gqa: int, block_size: int, dtype: torch.dtype):
    q_lens, ctx_lens, state, spec = CASES[case]
    nh = NKV * gqa
    batch = make_batch(
        q_lens, ctx_lens, num_heads=nh, num_kv_heads=NKV, head_size=D, block_size=block_size, dtype=dtype,
        num_pad=3, seed=gqa * 10 + block_size,
    )  # fmt: skip
    k_scale, v_scale = _scales(block_size + gqa)
    cache = torch.empty(batch.kv_cache.shape, dtype=torch.int8)
    for i, s in ((0, k_scale), (1, v_scale)):  # the cached context (and unused pages) as a C8 cache holds them
        cache[i] = quantize_reference(batch.kv_cache[i].reshape(-1, NKV, D), s).view(cache[i].shape)
    batch.kv_cache = cache
    builder = make_builder(block_size, NKV, D, torch.int8, spec)
    md = builder.build(0, batch.common)
    assert md.attn_state is state
    impl = AscendAttentionImpl(nh, D, D**-0.5, NKV, None, None, "int8", None, "decoder")
    layer = SimpleNamespace(layer_name="layer.0", key_antiquant_scale=k_scale, value_antiquant_scale=v_scale)
    output = torch.full_like(batch.query, 7.0)
    impl.forward(layer, batch.query, batch.key, batch.value, batch.kv_cache, md, output=output)
    batch.full_k = [_fake_quant(k, k_scale) for k in batch.full_k]
    batch.full_v = [_fake_quant(v, v_scale) for v in batch.full_v]
    expected = dense_reference(batch, num_heads=nh, num_kv_heads=NKV, head_size=D)
    return batch, output, expected, (k_scale, v_scale)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("block_size", [16, 128])
def test_c8_states_match_fake_quant(case: str, gqa: int, block_size: int) -> None:
    batch, out, expected, _ = _run(case, gqa, block_size, torch.float32)
    n = batch.num_tokens
    torch.testing.assert_close(out[:n].double(), expected, **TOLERANCES[torch.float32])
    assert bool((out[n:] == 0).all())


@pytest.mark.parametrize("case", ["chunked_mixed", "decode_only", "prefix_hit"])
def test_c8_states_bfloat16(case: str) -> None:
    batch, out, expected, _ = _run(case, 2, 128, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[: batch.num_tokens].double(), expected, **TOLERANCES[torch.bfloat16])


def test_c8_write_stores_the_quantized_tokens_at_their_slots() -> None:
    batch, _, _, (k_scale, v_scale) = _run("chunked_mixed", 1, 16, torch.float32)
    n = batch.num_tokens
    slots = batch.common.slot_mapping[:n]
    flat = batch.kv_cache.view(2, -1, NKV, D)
    assert batch.kv_cache.dtype == torch.int8
    assert torch.equal(flat[0, slots], quantize_reference(batch.key[:n], k_scale))
    assert torch.equal(flat[1, slots], quantize_reference(batch.value[:n], v_scale))


def test_quantize_reference_rounds_and_saturates() -> None:
    s = torch.full((NKV * D,), 0.5)
    x = torch.zeros(1, NKV, D)
    x[0, 0, :4] = torch.tensor([0.25, 0.75, -100.0, 100.0])  # 0.5 -> 0 (half to even), 1.5 -> 2, saturate
    q = quantize_reference(x, s)
    assert q.dtype == torch.int8 and q[0, 0, :4].tolist() == [0, 2, -128, 127]


def test_c8_write_rejects_a_float_cache_and_bad_scales() -> None:
    key = torch.randn(2, NKV, D)
    with pytest.raises(KernelContractError, match="must be int8"):
        C8_KV_WRITE.reference(key, key, torch.zeros(4, 16, NKV, D), torch.zeros(4, 16, NKV, D), torch.tensor([0, 1]),
                              torch.ones(NKV * D), torch.ones(NKV * D))  # fmt: skip
    cache = torch.zeros(4, 16, NKV, D, dtype=torch.int8)
    with pytest.raises(KernelContractError, match="per-channel scales need"):
        C8_KV_WRITE.reference(key, key, cache, cache, torch.tensor([0, 1]), torch.ones(D), torch.ones(D))


def test_c8_layers_the_int8_cache_cannot_serve_are_refused_by_name() -> None:
    for args, why in (
        ((4, D, 1.0, NKV, None, None, "int8", None, "encoder_only"), "encoder-only"),
        ((4, D, 1.0, NKV, None, 64, "int8", None, "decoder"), "sliding-window"),
        ((4, D, 1.0, NKV, None, None, "int8", 30.0, "decoder"), "soft-capping"),
    ):
        with pytest.raises(ConfigError, match=f"int8 KV cache \\(C8.*{why}"):
            AscendAttentionImpl(*args)
    impl = AscendAttentionImpl(4, D, 1.0, NKV, None, None, "int8", None, "decoder")
    with pytest.raises(ConfigError, match="no C8 scales"):
        from vllm_npu.attention.backends.gqa import c8_scales

        c8_scales(SimpleNamespace(layer_name="l"))
    assert impl.c8


def test_selector_takes_int8_for_gqa_and_refuses_it_for_mla() -> None:
    assert select_backend(use_mla=False, use_sparse=False, kv_cache_dtype="int8") == GQA_BACKEND
    for mla, sparse in ((True, False), (True, True)):
        with pytest.raises(ConfigError, match="not supported for MLA models"):
            select_backend(use_mla=mla, use_sparse=sparse, kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="fp8"):
        select_backend(use_mla=False, use_sparse=False, kv_cache_dtype="fp8")


def test_int8_pages_are_half_the_bytes_of_bfloat16_pages() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    shape = AscendAttentionBackend.get_kv_cache_shape(10, 128, NKV, D, "int8")
    assert shape == (2, 10, 128, NKV, D)
    bf16 = FullAttentionSpec(block_size=128, num_kv_heads=NKV, head_size=D, dtype=torch.bfloat16)
    int8 = FullAttentionSpec(block_size=128, num_kv_heads=NKV, head_size=D, dtype=torch.int8)
    assert bf16.page_size_bytes == 2 * int8.page_size_bytes
