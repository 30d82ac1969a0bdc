# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The Ascend 310P GQA path on the emulated 310P: NZ tiles, the NZ KV cache and masks, against a plain ND reference.

The twins read every cache and mask element through its NZ position (``ops/nz.py``); these tests run the real
metadata builder and impl with ``VLLM_NPU_EMULATED_SOC=310P`` over batches of every state, odd head sizes and two
block sizes, compare with the dense float64 reference of ``attn_harness``, and check that a layout error (an ND cache
or a mask read with the wrong tiling) changes the answer.
"""

from __future__ import annotations

import pytest
import torch
from attn_harness import TOLERANCES, dense_reference, make_batch, run_impl
from vllm_npu.attention.backends.gqa import AscendAttentionBackend, AscendAttentionImpl
from vllm_npu.attention.masks import AttentionMaskBuilder
from vllm_npu.attention.metadata import AscendAttentionState as S
from vllm_npu.attention.ops.attention_310p import PAGED_SPLITFUSE_310P, RESHAPE_AND_CACHE_NZ
from vllm_npu.attention.ops.kv_cache import reshape_and_cache_reference
from vllm_npu.attention.ops.nz import aligned_16, nd_to_nz, nz_to_nd
from vllm_npu.interface import ConfigError, KernelContractError, reset_chip


@pytest.fixture(autouse=True)
def soc_310p(monkeypatch):
    monkeypatch.setenv("VLLM_NPU_EMULATED_SOC", "310P")
    reset_chip()
    yield
    monkeypatch.delenv("VLLM_NPU_EMULATED_SOC")
    reset_chip()


def to_nz_cache(kv: torch.Tensor) -> torch.Tensor:
    """``[2, nb, bs, Nkv, D]`` -> ``[2, nb, Nkv * D / 16, bs, 16]``: each block's ``[bs, H]`` page in NZ tiles."""
    two, nb, bs, nkv, d = kv.shape
    return kv.reshape(two, nb, bs, nkv * d // 16, 16).permute(0, 1, 3, 2, 4).contiguous()


def test_nd_to_nz_tiles_columns_by_16_and_pads_with_zeros():
    nd = torch.arange(13 * 30, dtype=torch.float32).reshape(13, 30) + 1
    nz = nd_to_nz(nd)
    assert nz.shape == (1, 2, 16, 16) and nz.is_contiguous()
    for m, n in [(0, 0), (3, 17), (12, 29), (7, 15)]:
        assert nz[0, n // 16, m, n % 16] == nd[m, n]
    assert nz[0, 1, :, 14:].abs().sum() == 0 and nz[0, :, 13:].abs().sum() == 0  # padding
    assert torch.equal(nz_to_nd(nz)[0, :13, :30], nd)
    assert aligned_16(torch.ones(17, 2)).shape == (32, 2) and aligned_16(torch.ones(32, 2)).shape == (32, 2)


def test_kv_cache_shape_is_nz_on_310p():
    assert AscendAttentionBackend.get_kv_cache_shape(9, 128, 2, 24) == (2, 9, 3, 128, 16)
    with pytest.raises(ValueError, match="num_kv_heads \\* head_size = 40 is not a multiple of 16"):
        AscendAttentionBackend.get_kv_cache_shape(9, 128, 1, 40)
    reset_chip()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_NPU_EMULATED_SOC", "none")
        reset_chip()
        assert AscendAttentionBackend.get_kv_cache_shape(9, 128, 2, 24) == (2, 9, 128, 2, 24)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("nkv", "d"), [(2, 24), (1, 80), (3, 16)])
def test_nz_write_matches_the_nd_write(block_size, nkv, d):
    g = torch.Generator().manual_seed(1)
    nb, t = 5, 23
    nd = torch.randn(2, nb, block_size, nkv, d, generator=g)
    nz = to_nz_cache(nd)
    key, value = torch.randn(t, nkv, d, generator=g), torch.randn(t, nkv, d, generator=g)
    slots = torch.randperm(nb * block_size, generator=g)[:t]
    reshape_and_cache_reference(key, value, nd[0], nd[1], slots)
    RESHAPE_AND_CACHE_NZ.reference(key, value, nz[0], nz[1], slots)
    assert torch.equal(nz, to_nz_cache(nd))
    with pytest.raises(KernelContractError, match="slots must lie in"):
        RESHAPE_AND_CACHE_NZ.reference(key[:1], value[:1], nz[0], nz[1], torch.tensor([-1]))


CASES = {
    "prefill_no_cache": ([5, 17, 1], [0, 0, 0], S.PrefillNoCache),
    "decode_only": ([1, 1, 1], [4, 30, 16], S.DecodeOnly),
    "chunked_mixed": ([1, 7, 20], [9, 0, 13], S.ChunkedPrefill),
    "prefix_hit": ([6, 3], [16, 5], S.PrefillCacheHit),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("n", "nkv", "d"), [(6, 2, 24), (4, 1, 80)])
def test_310p_impl_over_the_nz_cache_matches_the_dense_reference(case, block_size, n, nkv, d):
    q_lens, ctx_lens, state = CASES[case]
    dims = {"num_heads": n, "num_kv_heads": nkv, "head_size": d}
    batch = make_batch(q_lens, ctx_lens, block_size=block_size, dtype=torch.float16, num_pad=3, **dims)
    nd_cache = batch.kv_cache.clone()
    reshape_and_cache_reference(
        batch.key[: batch.num_tokens],
        batch.value[: batch.num_tokens],
        nd_cache[0],
        nd_cache[1],
        batch.common.slot_mapping[: batch.num_tokens],
    )
    batch.kv_cache = to_nz_cache(batch.kv_cache)
    out, md = run_impl(batch, block_size=block_size, **dims)
    assert md.attn_state is state and (md.nz_mask is None) == (state is S.DecodeOnly)
    want = dense_reference(batch, **dims)
    torch.testing.assert_close(out[: batch.num_tokens].double(), want, **TOLERANCES[torch.float16])
    assert out[batch.num_tokens :].abs().sum() == 0  # padded rows written (zeros)
    assert torch.equal(batch.kv_cache, to_nz_cache(nd_cache))  # the step's K/V landed in their NZ slots


def test_an_nd_cache_given_the_nz_shape_gives_another_answer():
    dims = {"num_heads": 4, "num_kv_heads": 2, "head_size": 32}
    batch = make_batch([1, 1], [20, 37], block_size=16, dtype=torch.float16, **dims)
    want = dense_reference(batch, **dims)
    two, nb, bs, nkv, d = batch.kv_cache.shape
    batch.kv_cache = batch.kv_cache.reshape(two, nb, nkv * d // 16, bs, 16)  # ND bytes, NZ shape: a layout bug
    out, _ = run_impl(batch, block_size=bs, **dims)
    assert not torch.allclose(out[: batch.num_tokens].double(), want, atol=0.05)


def test_a_mask_in_the_wrong_tiling_gives_another_answer():
    dims = {"num_heads": 2, "num_kv_heads": 2, "head_size": 16}
    q_lens, ctx_lens = [1, 20], [9, 5]
    batch = make_batch(q_lens, ctx_lens, block_size=16, dtype=torch.float16, **dims)
    batch.kv_cache = to_nz_cache(batch.kv_cache)
    out, md = run_impl(batch, block_size=16, **dims)
    key_cache, value_cache = batch.kv_cache.unbind(0)
    kw = {"num_heads": 2, "num_kv_heads": 2, "scale": 16**-0.5}
    good, bad = torch.zeros_like(out[:21]), torch.zeros_like(out[:21])
    args = (batch.query[:21], key_cache, value_cache, md.block_table, torch.tensor(q_lens), md.seq_lens)
    PAGED_SPLITFUSE_310P.reference(*args, mask_nz=md.nz_mask, out=good, **kw)
    rows = torch.cat([torch.arange(9, 10), torch.arange(5, 25)])
    causal = AttentionMaskBuilder("cpu").causal_mask(25, torch.float16)[rows]  # the ND rows the NZ mask holds
    assert torch.equal(nz_to_nd(md.nz_mask)[0, :21, :25], causal)
    # The same rows tiled as [T16 / 16, S16, 16] (rows and columns swapped): the twin reads another mask.
    wrong = torch.nn.functional.pad(causal.T, (0, 11, 0, 7)).reshape(1, 32, 2, 16).transpose(1, 2)
    PAGED_SPLITFUSE_310P.reference(*args, mask_nz=wrong.reshape(1, 2, 32, 16), out=bad, **kw)
    assert torch.equal(good, out[:21]) and not torch.allclose(good, bad, atol=0.05)


def test_310p_builder_masks_are_nz_of_the_longest_sequence():
    from attn_harness import make_builder

    batch = make_batch([5, 17], [0, 0], num_heads=2, num_kv_heads=2, head_size=16, block_size=16)
    md = make_builder(16, 2, 16, torch.float16).build(0, batch.common)
    assert md.nz_mask.shape == (1, 2, 32, 16) and md.nz_mask.dtype == torch.float16
    nd = nz_to_nd(md.nz_mask)[0]
    assert nd[16, 16] == 0 and nd[15, 16] == float("-inf") and nd[16, 17:].abs().sum() == 0  # zero padding past S


def test_sliding_window_layers_are_refused_on_310p():
    with pytest.raises(ConfigError, match=r"sliding-window attention \(window 64\) is not supported on the Atlas 300I"):
        AscendAttentionImpl(4, 64, 0.125, 2, None, 64)


def test_selftest_elsewhere_keeps_the_310p_rows_and_skips_them_on_an_a2_npu(monkeypatch):
    from vllm_npu.attention.selftest import selftest_cases
    from vllm_npu.interface import MissingComponentError

    monkeypatch.setenv("VLLM_NPU_EMULATED_SOC", "none")
    reset_chip()
    cases = [c for c in selftest_cases() if c.kernel.name.endswith(("_310p", "_nz"))]
    assert {c.kernel.name for c in cases} == {
        "reshape_and_cache_nz",
        "prefill_310p",
        "paged_decode_310p",
        "paged_splitfuse_310p",
    }
    for case in cases:
        case.build("cpu")  # the emulated device runs them
        with pytest.raises(MissingComponentError, match="run vllm-npu selftest on an Atlas 300I"):
            case.build("meta")  # any device but the CPU stands for an NPU here


def test_selftest_on_a_310p_runs_the_310p_pairs_and_their_cases_agree_with_the_nd_kernels():
    import inspect

    from vllm_npu.attention.ops.paged_attention import PAGED_DECODE
    from vllm_npu.attention.selftest import selftest_cases

    cases = selftest_cases()
    names = {c.kernel.name for c in cases}
    assert names == {"reshape_and_cache_nz", "prefill_310p", "paged_decode_310p", "paged_splitfuse_310p"}
    assert {c.dtype for c in cases} == {"float16"}
    for case in cases:
        npu, ref = inspect.signature(case.kernel.npu), inspect.signature(case.kernel.reference)
        assert list(npu.parameters) == list(ref.parameters)
        call = case.build("cpu")
        outs = call.outputs(case.kernel.reference(*call.args, **call.kwargs), call.args, call.kwargs)
        assert all(torch.isfinite(t.float()).all() for t in outs.values()), case.shape
        if case.kernel.name == "paged_decode_310p":  # the same tokens in ND through the A2/A3 twin
            q, kc, vc, table, lens = call.args
            nkv = call.kwargs["num_kv_heads"]
            nd = [c.permute(0, 2, 1, 3).reshape(c.shape[0], c.shape[2], nkv, -1) for c in (kc, vc)]
            want = torch.zeros_like(q)
            kw = {k: v for k, v in call.kwargs.items() if k != "out"}
            PAGED_DECODE.reference(q, *nd, table, lens.tolist(), out=want, **kw)
            torch.testing.assert_close(outs["out"], want, **TOLERANCES[torch.float16])
