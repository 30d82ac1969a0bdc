# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The output-buffer contract behind npu-patches' ``attention-output-empty``: an impl that declares
``fills_output_buffer = True`` writes every element of ``output`` on every call, so vLLM's attention layer may
allocate it with ``torch.empty``. Each test hands the impl a NaN-poisoned buffer and requires no NaN afterwards,
the attention rows equal to the dense reference, and zeros in the padded rows / on the profile run.
"""

from __future__ import annotations

import pytest
import torch
from attn_harness import TOLERANCES, dense_reference, make_batch, make_builder
from mla_harness import assert_close, make_impl, make_scenario, make_sfa_impl, step_inputs
from mla_harness import dense_reference as mla_dense_reference
from mla_harness import make_builder as mla_builder
from vllm.attention.backends.abstract import AttentionType
from vllm_npu.attention.backends.gqa import AscendAttentionImpl
from vllm_npu.attention.backends.mla import AscendMLAImpl
from vllm_npu.attention.backends.sfa import AscendSFAImpl
from vllm_npu.attention.metadata import AscendAttentionState as S
from vllm_npu.interface import configure_kernels, fills_output_buffer


@pytest.fixture(autouse=True, scope="module")
def _reference_kernels():
    configure_kernels("reference")


@pytest.mark.parametrize("impl", [AscendAttentionImpl, AscendMLAImpl, AscendSFAImpl])
def test_every_impl_declares_the_contract(impl: type) -> None:
    # Read the way npu-patches reads it: through the interface's reader, not the bare attribute name.
    assert fills_output_buffer(impl)


# --- GQA ----------------------------------------------------------------------------------------------------------

NH, NKV, D = 4, 2, 16

# (q_lens, ctx_lens, expected state, num_speculative_tokens, encoder_only)
GQA_CASES = {
    "decode_only": ([1, 1, 1], [5, 17, 40], S.DecodeOnly, 0, False),
    "prefill_no_cache": ([6, 1, 13], [0, 0, 0], S.PrefillNoCache, 0, False),
    "prefix_hit": ([5, 9], [16, 20], S.PrefillCacheHit, 0, False),
    "chunked_mixed": ([1, 1, 8], [9, 30, 4], S.ChunkedPrefill, 0, False),
    "spec_decoding": ([4, 2, 3], [10, 7, 21], S.SpecDecoding, 3, False),
    "encoder_only": ([7, 3], [0, 0], None, 0, True),
}


def _gqa_impl(encoder_only: bool = False) -> AscendAttentionImpl:
    attn_type = AttentionType.ENCODER_ONLY if encoder_only else AttentionType.DECODER
    return AscendAttentionImpl(NH, D, D**-0.5, NKV, None, None, "auto", None, attn_type)


@pytest.mark.parametrize("num_pad", [0, 5], ids=["unpadded", "padded"])
@pytest.mark.parametrize("case", sorted(GQA_CASES))
def test_gqa_writes_every_element(case: str, num_pad: int) -> None:
    q_lens, ctx_lens, state, spec, encoder_only = GQA_CASES[case]
    batch = make_batch(
        q_lens,
        ctx_lens,
        num_heads=NH,
        num_kv_heads=NKV,
        head_size=D,
        block_size=16,
        num_pad=num_pad,
        causal=not encoder_only,
        seed=len(case) + num_pad,
    )
    md = make_builder(16, NKV, D, torch.float32, spec).build(0, batch.common)
    if state is not None:
        assert md.attn_state is state
    output = torch.full_like(batch.query, float("nan"))
    ret = _gqa_impl(encoder_only).forward(None, batch.query, batch.key, batch.value, batch.kv_cache, md, output=output)
    assert ret is output
    assert not output.isnan().any()
    n = batch.num_tokens
    expected = dense_reference(batch, num_heads=NH, num_kv_heads=NKV, head_size=D, causal=not encoder_only)
    torch.testing.assert_close(output[:n].double(), expected, **TOLERANCES[torch.float32])
    assert bool((output[n:] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_profile_run_zero_fills(dtype: torch.dtype) -> None:
    output = torch.full((9, NH, D), float("nan"), dtype=dtype)
    q = torch.randn(9, NH, D, dtype=dtype)
    kv = torch.randn(9, NKV, D, dtype=dtype)
    assert _gqa_impl().forward(None, q, kv, kv, torch.empty(0), None, output=output) is output
    assert bool((output == 0).all())


# --- MLA ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reqs, pad",
    [
        ([(40, 1), (3, 1), (0, 1)], 0),  # decode only
        ([(40, 1), (3, 1), (0, 1)], 4),  # decode only, padded
        ([(0, 11), (0, 4)], 3),  # prefill, no context, padded
        ([(30, 1), (17, 6), (0, 9)], 0),  # mixed decode + prefill with context
        ([(30, 1), (17, 6), (0, 9)], 6),  # mixed, padded
    ],
    ids=["decode", "decode_padded", "prefill_padded", "mixed", "mixed_padded"],
)
def test_mla_writes_every_element(reqs: list[tuple[int, int]], pad: int) -> None:
    s = make_scenario(reqs, 16, seed=sum(q for _, q in reqs) + pad, pad=pad)
    q, kv_c, k_pe, _, common = step_inputs(s)
    meta = mla_builder(s, chunk_tokens=32).build(0, common)
    output = torch.full((q.shape[0], s.dims.N * s.dims.V), float("nan"))
    assert make_impl(s).forward(None, q, kv_c, k_pe, s.kv_cache, meta, output=output) is output
    assert not output.isnan().any()
    n = meta.num_actual_tokens
    assert_close(s, output[:n], mla_dense_reference(s))
    assert bool((output[n:] == 0).all())


def test_mla_profile_run_zero_fills() -> None:
    s = make_scenario([(0, 4)], 16)
    output = torch.full((4, s.dims.N * s.dims.V), float("nan"))
    q = torch.zeros(4, s.dims.N, s.dims.P + s.dims.R)
    make_impl(s).forward(None, q, None, None, torch.tensor([]), None, output=output)
    assert bool((output == 0).all())


# --- SFA ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reqs, pad, topk",
    [
        ([(60, 1), (0, 1), (33, 17)], 0, 128),  # top-k covers every sequence: equals dense MLA
        ([(60, 1), (0, 1), (33, 17)], 5, 128),  # same, padded
        ([(40, 1), (3, 1)], 4, 8),  # decode only, padded, sparse selection
    ],
    ids=["dense_topk", "dense_topk_padded", "decode_sparse_padded"],
)
def test_sfa_writes_every_element(reqs: list[tuple[int, int]], pad: int, topk: int) -> None:
    from test_sfa_backend import run_sfa

    s = make_scenario(reqs, 16, seed=len(reqs) + pad, pad=pad)
    output, _, _, n = run_sfa(s, topk, seed=len(reqs) + pad, fill=float("nan"))
    assert not output.isnan().any()
    if topk >= max(c + q for c, q in reqs):
        assert_close(s, output[:n], mla_dense_reference(s))
    assert output.shape[0] == n + pad and bool((output[n:] == 0).all())


def test_sfa_profile_run_zero_fills() -> None:
    s = make_scenario([(0, 4)], 16)
    d = s.dims
    impl = make_sfa_impl(s, torch.zeros(4, 8, dtype=torch.int32))
    output = torch.full((4, d.N * d.V), float("nan"))
    q = torch.zeros(4, d.N, d.P + d.R)
    assert impl.forward(None, q, None, None, torch.tensor([]), None, output=output) is output
    assert bool((output == 0).all())
