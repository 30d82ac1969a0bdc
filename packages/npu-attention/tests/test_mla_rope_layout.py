# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The latent cache's rope-channel order is the same in every graph mode.

An eager instance of a model whose MLA layer fits the fused norm + rope + write kernel stores ``k_pe`` in that
kernel's NeoX (de-interleaved) channel order; a traced instance (torchair, PIECEWISE) runs vLLM's GPT-J rotation and
the impl writes the cache. With ``AscendMLAImpl.rope_deinterleaved`` (the MLA layer sets it when it would fuse but the
model is traced) the impl de-interleaves q_pe and k_pe, so a torchair PD decode node reads what an eager prefill node
wrote: here a context cached in the fused order plus GPT-J-ordered new tokens give the dense attention's output, and
the new tokens land in the cache in the fused order.
"""

from __future__ import annotations

import pytest
import torch
from mla_harness import assert_close, dense_reference, make_builder, make_impl, make_scenario, step_inputs
from vllm_npu.attention.ops.mla_cache import deinterleave, latent_cache_planes, mla_cache_write_reference
from vllm_npu.interface import configure_kernels


@pytest.fixture(autouse=True, scope="module")
def _reference_kernels():
    configure_kernels("reference")


@pytest.mark.parametrize("reqs", [[(9, 1), (30, 1)], [(9, 2), (5, 1), (0, 7), (12, 5)]], ids=["decode", "mixed"])
def test_a_traced_instance_reads_and_writes_the_fused_channel_order(reqs):
    s = make_scenario(reqs, 16, seed=3)
    d = s.dims
    nope, rope = latent_cache_planes(s.kv_cache, d.L, d.R)
    for b, (c, _) in enumerate(s.reqs):  # the context as an eager (fused) instance cached it
        mla_cache_write_reference(s.kv_c[b][:c], deinterleave(s.k_pe[b][:c]), nope, rope, s.slots[b][:c])
    q, kv_c, k_pe, slots, common = step_inputs(s)
    impl = make_impl(s)
    impl.rope_deinterleaved = True
    output = torch.full((q.shape[0], d.N * d.V), 7.0, dtype=q.dtype)
    impl.forward(None, q, kv_c, k_pe, s.kv_cache, make_builder(s).build(0, common), output=output)
    assert_close(s, output, dense_reference(s))  # every q.k product unchanged by the common permutation
    flat = rope.reshape(-1, d.R)
    assert torch.equal(flat[slots], deinterleave(k_pe.squeeze(1)))  # new tokens stored in the fused order
