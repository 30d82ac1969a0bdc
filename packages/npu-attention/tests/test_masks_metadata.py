# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Masks, batch classification, builder configuration checks, kernel twin contracts, NPU-only layer checks."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from attn_harness import make_batch, make_builder
from vllm_npu.attention.backends.gqa import AscendAttentionBackend, AscendAttentionImpl
from vllm_npu.attention.masks import COMPRESSED_MASK_SIZE, AttentionMaskBuilder, masked_value
from vllm_npu.attention.metadata import AscendAttentionMetadataBuilder, AscendAttentionState, classify_batch
from vllm_npu.attention.ops.flash_attention import ENCODER_ATTENTION, PREFILL_NO_CACHE
from vllm_npu.attention.ops.kv_cache import RESHAPE_AND_CACHE
from vllm_npu.attention.ops.paged_attention import PAGED_DECODE, PAGED_PREFILL
from vllm_npu.attention.selftest import selftest_cases
from vllm_npu.interface import ConfigError, KernelContractError

# --- masks ---------------------------------------------------------------------------------------------------------


def test_splitfuse_and_pooling_masks() -> None:
    mb = AttentionMaskBuilder("cpu")
    sf = mb.splitfuse_mask()
    assert sf.dtype == torch.int8 and sf.shape == (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE)
    i, j = torch.meshgrid(torch.arange(2048), torch.arange(2048), indexing="ij")
    assert torch.equal(sf.bool(), j > i)  # 1 = masked, strictly above the diagonal
    assert mb.splitfuse_mask() is sf  # cached
    pm = mb.pooling_mask()
    assert pm.dtype == torch.bool and torch.equal(pm, j > i)
    assert mb.pooling_mask() is pm


@pytest.mark.parametrize(
    ("dtype", "value"), [(torch.float16, float("-inf")), (torch.bfloat16, 1.0), (torch.float32, float("-inf"))]
)
def test_float_causal_mask_by_dtype_grows_on_demand(dtype: torch.dtype, value: float) -> None:
    mb = AttentionMaskBuilder("cpu")
    m = mb.causal_mask(5, dtype)
    assert m.shape == (5, 5) and m.dtype == dtype
    expected = torch.zeros(5, 5, dtype=dtype).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), value)
    assert torch.equal(m, expected)
    assert masked_value(dtype) == value
    storage = mb._causal[dtype]
    assert mb.causal_mask(100, dtype).data_ptr() == storage.data_ptr()  # within the cached size: a view
    big = mb.causal_mask(1000, dtype)
    assert big.shape == (1000, 1000) and mb._causal[dtype].shape[0] >= 1000
    assert torch.equal(big[:5, :5], expected)
    with pytest.raises(ValueError):
        mb.causal_mask(0, dtype)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        masked_value(torch.int8)


# --- batch classification and builder -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("q", "seq", "threshold", "state"),
    [
        ([3, 5], [3, 5], 1, AscendAttentionState.PrefillNoCache),
        ([1, 1], [1, 1], 1, AscendAttentionState.PrefillNoCache),  # 1-token prompts: still nothing cached
        ([1, 1, 1], [4, 9, 2], 1, AscendAttentionState.DecodeOnly),
        ([1, 1, 1], [4, 9, 2], 4, AscendAttentionState.DecodeOnly),
        ([1, 3, 4], [4, 9, 6], 4, AscendAttentionState.SpecDecoding),
        ([1, 3, 4], [4, 9, 6], 1, AscendAttentionState.ChunkedPrefill),
        ([1, 8], [4, 8], 1, AscendAttentionState.ChunkedPrefill),  # decode + first prefill
        ([6, 8], [10, 8], 1, AscendAttentionState.PrefillCacheHit),
        ([6, 8], [10, 8], 4, AscendAttentionState.PrefillCacheHit),
    ],
)
def test_classify_batch(q: list[int], seq: list[int], threshold: int, state: AscendAttentionState) -> None:
    assert classify_batch(torch.tensor(q), torch.tensor(seq), threshold) is state


def test_builder_thresholds_and_host_lists() -> None:
    assert make_builder(16, 2, 32, torch.float32).reorder_batch_threshold == 1
    b = make_builder(16, 2, 32, torch.float32, num_speculative_tokens=3)
    assert b.reorder_batch_threshold == 4 and b.decode_threshold == 4
    with pytest.raises(ConfigError, match="num_speculative_tokens <= 15"):
        make_builder(16, 2, 32, torch.float32, num_speculative_tokens=16)

    batch = make_batch([2, 1, 9], [3, 7, 0], num_heads=4, num_kv_heads=2, head_size=16, block_size=16, num_pad=2)
    md = b.build(0, batch.common)
    assert md.attn_state is AscendAttentionState.ChunkedPrefill
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (2, 3, 1)
    assert md.query_start_loc_list == [0, 2, 3, 12] and md.actual_seq_lengths_q == [2, 3, 12]
    assert md.seq_lens_list == [5, 8, 9]
    assert md.num_actual_tokens == 12 and md.slot_mapping.shape[0] == 14
    assert md.attn_mask is None and md.splitfuse_mask is None  # reference backend: no kernel masks built


def test_reference_builder_slots_and_decode_plan() -> None:
    # The reference KV write's guarantee: no negative slot, vLLM's padding (-1) on slot 0 (null block 0), real
    # slots unchanged, in one persistent buffer whose tail past a shorter step holds 0 too (captured graphs read it).
    b = make_builder(16, 2, 32, torch.float32)
    big = make_batch([1, 1, 1], [4, 9, 20], num_heads=4, num_kv_heads=2, head_size=16, block_size=16, num_pad=3)
    md = b.build(0, big.common)
    vllm_slots = big.common.slot_mapping
    assert (vllm_slots[3:] == -1).all()
    assert torch.equal(md.slot_mapping[:3], vllm_slots[:3]) and (md.slot_mapping[3:] == 0).all()
    assert md.decode_plan is not None and md.decode_plan.context_lens is md.seq_lens_list
    assert md.decode_plan.masked.shape == (3, 1, 1, 1, 32) and md.decode_plan.num_blocks == 2
    first = md.slot_mapping
    small = make_batch([1], [5], num_heads=4, num_kv_heads=2, head_size=16, block_size=16)
    md2 = b.build(0, small.common)
    assert md2.slot_mapping.data_ptr() == first.data_ptr()  # the same persistent buffer
    assert torch.equal(md2.slot_mapping, small.common.slot_mapping) and (first[1:] == 0).all()
    prefill = make_batch([4], [0], num_heads=4, num_kv_heads=2, head_size=16, block_size=16)
    assert b.build(0, prefill.common).decode_plan is None  # only DecodeOnly steps get a plan


def test_builder_for_graph_capture_builds_a_decode_batch() -> None:
    from vllm.v1.attention.backends.utils import AttentionCGSupport

    b = make_builder(16, 2, 32, torch.float32)
    assert b.cudagraph_support is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # vLLM captures full graphs with one token per request and sequence lengths 1: equal query and sequence
    # lengths, which build() would classify as a first prefill.
    batch = make_batch([1, 1, 1], [0, 0, 0], num_heads=4, num_kv_heads=2, head_size=16, block_size=16)
    assert b.build(0, batch.common).attn_state is AscendAttentionState.PrefillNoCache
    md = b.build_for_cudagraph_capture(batch.common)
    assert md.attn_state is AscendAttentionState.DecodeOnly
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (3, 3, 0) and md.seq_lens_list == [1, 1, 1]
    assert md.capture
    with pytest.raises(ValueError, match=r"only for decode batches of at most 1 tokens per request"):
        b.build_for_cudagraph_capture(
            make_batch([2], [0], num_heads=4, num_kv_heads=2, head_size=16, block_size=16).common
        )
    # With 2 speculative tokens (the torchair mode captures verification batches): vLLM's dummy batch of 7 tokens is
    # [3, 3, 1] tokens per request with sequence lengths equal to them, a SpecDecoding batch of decodes only.
    spec = make_builder(16, 2, 32, torch.float32, num_speculative_tokens=2)
    md = spec.build_for_cudagraph_capture(
        make_batch([3, 3, 1], [0, 0, 0], num_heads=4, num_kv_heads=2, head_size=16, block_size=16).common
    )
    assert md.attn_state is AscendAttentionState.SpecDecoding and md.capture
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (3, 7, 0)


def test_builder_rejects_decode_context_parallel() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    cfg = SimpleNamespace(speculative_config=None, parallel_config=SimpleNamespace(decode_context_parallel_size=2))
    with pytest.raises(ConfigError, match="decode_context_parallel_size=1"):
        AscendAttentionMetadataBuilder(spec, ["l"], cfg, torch.device("cpu"))


def test_backend_surface() -> None:
    assert AscendAttentionBackend.accept_output_buffer is True
    assert AscendAttentionBackend.get_name() == "ASCEND"
    assert AscendAttentionBackend.get_kv_cache_shape(7, 128, 4, 64) == (2, 7, 128, 4, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        AscendAttentionBackend.get_kv_cache_shape(7, 24, 4, 64)
    assert AscendAttentionBackend.get_builder_cls() is AscendAttentionMetadataBuilder
    assert AscendAttentionBackend.get_impl_cls() is AscendAttentionImpl


# --- kernel twins ----------------------------------------------------------------------------------------------------


# Every kernel pair of the package (the selftest covers each): the twins' shared signature is checked, not trusted
# (ops/__init__.py says why it is not one argument object per family).
_ALL_KERNELS = sorted({case.kernel.name: case.kernel for case in selftest_cases()}.values(), key=lambda k: k.name)


def test_every_kernel_pair_is_checked() -> None:
    names = {k.name for k in _ALL_KERNELS}
    assert {
        k.name for k in (RESHAPE_AND_CACHE, PAGED_DECODE, PAGED_PREFILL, PREFILL_NO_CACHE, ENCODER_ATTENTION)
    } <= names
    assert {"paged_decode_window", "graph_decode", "mla_decode", "mla_graph_decode", "mla_spec_decode"} <= names
    assert len(names) >= 21


@pytest.mark.parametrize("kernel", _ALL_KERNELS, ids=lambda k: k.name)
def test_twins_share_one_signature(kernel) -> None:
    npu, ref = inspect.signature(kernel.npu), inspect.signature(kernel.reference)
    assert list(npu.parameters) == list(ref.parameters)
    assert [p.kind for p in npu.parameters.values()] == [p.kind for p in ref.parameters.values()]
    assert kernel.select("reference") is kernel.reference and kernel.select("npu") is kernel.npu


def test_reference_kernels_reject_bad_shapes() -> None:
    q = torch.randn(4, 6, 16)
    cache = torch.randn(3, 16, 2, 16)
    with pytest.raises(KernelContractError, match="num_heads=8"):
        PAGED_DECODE.reference(
            q,
            cache,
            cache,
            torch.zeros(4, 1, dtype=torch.int32),
            [1, 1, 1, 1],
            num_heads=8,
            num_kv_heads=2,
            scale=1.0,
            out=q.clone(),
        )
    with pytest.raises(KernelContractError, match="more new tokens"):
        PAGED_PREFILL.reference(
            q,
            cache,
            cache,
            torch.zeros(1, 1, dtype=torch.int32),
            [0, 4],
            [3],
            num_heads=6,
            num_kv_heads=2,
            scale=1.0,
            attn_mask=None,
            out=q.clone(),
        )
    with pytest.raises(KernelContractError, match="do not pack"):
        PREFILL_NO_CACHE.reference(
            q, q[:, :2], q[:, :2], [3], num_heads=6, num_kv_heads=2, scale=1.0, attn_mask=None, out=q.clone()
        )
    with pytest.raises(KernelContractError, match="soft-capping"):
        PAGED_DECODE.npu(
            q,
            cache,
            cache,
            torch.zeros(4, 1, dtype=torch.int32),
            [1, 1, 1, 1],
            num_heads=6,
            num_kv_heads=2,
            scale=1.0,
            out=q.clone(),
            logits_soft_cap=30.0,
        )


# --- impl configuration ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"alibi_slopes": [1.0, 2.0]}, "ALiBi"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
        ({"attn_type": "encoder_decoder"}, "cross attention"),
        ({"sinks": torch.zeros(4)}, "sinks"),
        ({"num_kv_heads": 3}, "multiple"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"some_future_option": 1}, "some_future_option"),
    ],
)
def test_impl_rejects_unsupported_layers(kwargs: dict, needle: str) -> None:
    args = {"num_heads": 4, "head_size": 16, "scale": 0.25, "num_kv_heads": 2, **kwargs}
    with pytest.raises(ConfigError, match=needle):
        AscendAttentionImpl(**args)


def test_npu_only_checks() -> None:
    # On an NPU the impl refuses what no torch_npu kernel computes; exercised without hardware by calling the check.
    impl = AscendAttentionImpl(4, 64, 0.125, 2, logits_soft_cap=30.0)
    with pytest.raises(ConfigError, match="soft-capping"):
        impl._check_npu_support()
    impl = AscendAttentionImpl(4, 72, 0.125, 2)
    with pytest.raises(ConfigError, match="head_size=72"):
        impl._check_npu_support()
    impl = AscendAttentionImpl(4, 64, 0.125, 2)
    with pytest.raises(ConfigError, match="float16/bfloat16"):
        impl._check_npu_support()  # default dtype here is float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        impl._check_npu_support()
    finally:
        torch.set_default_dtype(old)
