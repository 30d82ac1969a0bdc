# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""AscendMLABackend against dense, obviously correct attention (the scenarios and the reference: :mod:`mla_harness`).

The backend runs the real metadata builder and impl (reference kernels) on a paged cache whose blocks are scattered
at random; the reference materialises every request's K and V from its latents and runs plain causal attention.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from mla_harness import (  # noqa: E402
    assert_close,
    builder_config,
    dense_reference,
    make_builder,
    make_impl,
    make_scenario,
    run_backend,
    step_inputs,
)
from vllm_npu.attention.backends.mla import AscendMLABackend, AscendMLAImpl, AscendMLAMetadataBuilder  # noqa: E402
from vllm_npu.attention.ops.mla_cache import latent_cache_planes  # noqa: E402
from vllm_npu.interface import ConfigError, configure_kernels  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _reference_kernels():
    configure_kernels("reference")


# --- tests ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 128])
def test_pure_prefill_no_cache(block_size: int) -> None:
    s = make_scenario([(0, 37), (0, 5), (0, 20)], block_size, seed=1)
    out, meta = run_backend(s)
    assert meta.num_decodes == 0 and meta.num_prefills == 3 and not meta.prefill.context_chunks
    assert_close(s, out, dense_reference(s))


@pytest.mark.parametrize("block_size", [16, 128])
def test_pure_decode(block_size: int) -> None:
    s = make_scenario([(40, 1), (3, 1), (129, 1), (0, 1)], block_size, seed=2)
    out, meta = run_backend(s)
    assert meta.num_decodes == 4 and meta.prefill is None
    assert_close(s, out, dense_reference(s))


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("seed", [3, 4])
def test_mixed_batch_with_chunked_context_and_padding(block_size: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    decodes = [(int(torch.randint(1, 300, (1,), generator=g)), 1) for _ in range(3)]
    prefills = [
        (int(torch.randint(0, 300, (1,), generator=g)), int(torch.randint(2, 40, (1,), generator=g))) for _ in range(3)
    ]
    prefills.append((0, 9))  # a prefill without context next to ones with context
    s = make_scenario(decodes + prefills, block_size, seed=seed, pad=5)
    out, meta = run_backend(s, chunk_tokens=2 * block_size)  # forces several context chunks
    n = meta.num_actual_tokens
    assert meta.num_decodes == 3 and meta.num_prefills == 4
    assert len(meta.prefill.context_chunks) > 1
    assert_close(s, out[:n], dense_reference(s))
    assert torch.all(out[n:] == 0), "padding rows of the output must be zeroed (the impl fills its whole buffer)"


def test_cache_holds_every_new_token_and_padding_is_skipped() -> None:
    s = make_scenario([(10, 1), (4, 12)], 16, seed=5, pad=3)
    before = s.kv_cache.clone()
    _, kv_c, k_pe, slot_mapping, _ = step_inputs(s)
    run_backend(s)
    nope, rope = latent_cache_planes(s.kv_cache, s.dims.L, s.dims.R)
    valid = slot_mapping >= 0
    torch.testing.assert_close(nope.view(-1, s.dims.L)[slot_mapping[valid]], kv_c[valid])
    torch.testing.assert_close(rope.view(-1, s.dims.R)[slot_mapping[valid]], k_pe[valid, 0])
    changed = (s.kv_cache != before).any(-1).view(-1)
    # nothing but the new tokens' slots changed (padding slots -1 wrote nothing; block 0 untouched)
    assert int(changed.sum()) <= 2 * int(valid.sum())
    assert not (nope[0] != 0).any() and not (rope[0] != 0).any()


def test_impl_leaves_the_cache_to_a_layer_that_writes_it() -> None:
    """With ``layer_writes_cache`` (the fused MLA layer wrote kv_c/k_pe already) the impl must not write again."""
    s = make_scenario([(10, 1), (4, 12)], 16, seed=8)
    q, kv_c, k_pe, _, common = step_inputs(s)
    meta = make_builder(s).build(0, common)
    impl = make_impl(s)
    impl.layer_writes_cache = True
    before = s.kv_cache.clone()
    impl.forward(None, q, kv_c, k_pe, s.kv_cache, meta, output=torch.zeros(q.shape[0], s.dims.N * s.dims.V))
    assert torch.equal(s.kv_cache, before)


def test_chunking_does_not_change_the_result() -> None:
    s = make_scenario([(200, 30), (77, 3)], 16, seed=6)
    one, m1 = run_backend(s, chunk_tokens=10_000)
    s2 = make_scenario([(200, 30), (77, 3)], 16, seed=6)
    many, m2 = run_backend(s2, chunk_tokens=32)
    assert len(m1.prefill.context_chunks) == 1 and len(m2.prefill.context_chunks) == 13
    torch.testing.assert_close(one, many, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype: torch.dtype) -> None:
    s = make_scenario([(50, 1), (20, 17)], 16, seed=7, dtype=dtype)
    out, _ = run_backend(s, chunk_tokens=32)
    assert out.dtype == dtype
    assert_close(s, out, dense_reference(s))


def test_profile_run_zero_fills() -> None:
    s = make_scenario([(0, 4)], 16)
    impl = make_impl(s)
    out = torch.ones(4, s.dims.N * s.dims.V)
    impl.forward(None, torch.zeros(4, s.dims.N, s.dims.P + s.dims.R), None, None, torch.tensor([]), None, output=out)
    assert torch.all(out == 0)


def test_backend_declarations() -> None:
    assert AscendMLABackend.get_kv_cache_shape(10, 16, 1, 48) == (10, 16, 48)
    assert AscendMLABackend.get_builder_cls() is AscendMLAMetadataBuilder
    assert AscendMLABackend.get_impl_cls() is AscendMLAImpl
    with pytest.raises(ValueError, match="num_kv_heads=1"):
        AscendMLABackend.get_kv_cache_shape(10, 16, 2, 48)
    with pytest.raises(ValueError, match="fp8"):
        AscendMLABackend.get_kv_cache_shape(10, 16, 1, 48, cache_dtype_str="fp8")


def test_builder_never_touches_the_model() -> None:
    """The builder's inputs are the KV spec, the config and CommonAttentionMetadata only (vllm-ascend#5385)."""
    import inspect

    from vllm_npu.attention.backends import mla

    src = inspect.getsource(mla.AscendMLAMetadataBuilder)
    assert "model_runner" not in src and "rotary_emb" not in src and "get_model" not in src


def test_builder_rejects_decode_context_parallel() -> None:
    s = make_scenario([(0, 4)], 16)
    cfg = builder_config(s, parallel_config=SimpleNamespace(decode_context_parallel_size=2))
    with pytest.raises(ConfigError, match="decode_context_parallel_size=1"):
        AscendMLAMetadataBuilder(SimpleNamespace(block_size=s.block_size), ["layer"], cfg, torch.device("cpu"))
