# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The MLA impl's compiled-decode-graph path (the torchair mode), without an engine: the GQA tests'
(test_graph_decode.py) counterpart for the latent cache.

The impl's forward is compiled as the torchair wrapper compiles the model's (``graph_harness.compiled_step``: the
step's graph inputs through ``COMPILED_STEP``, the metadata read from a module global the way vLLM's attention layer
reads the forward context). Over decode steps whose request counts, sequence lengths, block tables and slots all
change, the compiled graph must equal a float64 attention over K/V materialised from the latents with ``kv_b_proj``,
compile exactly once and write the latent cache exactly like the eager write; a step run on stale graph inputs gives
wrong results. The NPU strategy (``dynamic=True``, tensors static, the NPU twins with ``torch_npu`` faked) must take
the lengths as symbolic inputs, compile once, and hold only ops that torch_npu 2.8.0's torchair can convert to GE.
Dimensions are the NPU kernel's (kv_lora_rank 512, rope 64, 32 heads, block 16): its twin checks them.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from graph_harness import assert_one_npu_graph, compiled_step, decode_step, fake_torch_npu
from mla_harness import Dims, KvBProj, builder_config
from vllm_npu.attention.backends.mla import AscendMLAImpl, AscendMLAMetadata, AscendMLAMetadataBuilder
from vllm_npu.attention.metadata import GRAPH_PAD_SEQ_LEN, GraphDecodeInputs
from vllm_npu.attention.ops.mla_cache import latent_cache_planes
from vllm_npu.interface import configure_kernels, graph_inputs_of

DIMS = Dims(N=32, L=512, R=64, P=16, V=16)
BS, NB, W, B = 16, 24, 4, 4  # block size, blocks, table width, graph batch
SCALE = (DIMS.P + DIMS.R) ** -0.5
LAYER = "model.layers.0.self_attn.attn"  # the attention layer's name
STEP = types.SimpleNamespace(md=None)  # what the compiled function reads, like vLLM's forward context
STEPS = [[9, 30, 2, 64], [10, 31, 3], [5], [33, 17], [2, 48, 12, 7], [11, 32, 4, 8]]


@pytest.fixture(autouse=True, scope="module")
def _reference_kernels():
    configure_kernels("reference")


@pytest.fixture(scope="module")
def w_kv_b() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(DIMS.N * (DIMS.P + DIMS.V), DIMS.L, generator=g) / DIMS.L**0.5


def _impl(w_kv_b: torch.Tensor) -> AscendMLAImpl:
    d = DIMS
    impl = AscendMLAImpl(
        d.N, d.L + d.R, SCALE, 1, None, None, "auto", None, "decoder", None,
        q_lora_rank=None, kv_lora_rank=d.L, qk_nope_head_dim=d.P, qk_rope_head_dim=d.R,
        qk_head_dim=d.P + d.R, v_head_dim=d.V, kv_b_proj=KvBProj(w_kv_b),
    )  # fmt: skip
    impl.process_weights_after_loading(torch.float32)
    return impl


def _step(seq_lens: list[int], seed: int) -> tuple[AscendMLAMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pure-decode step of ``len(seq_lens)`` requests with random distinct blocks (never block 0), built by the real
    MLA metadata builder; q ``[B, N, P + R]``, kv_c ``[B, L]``, k_pe ``[B, 1, R]`` (rows past the requests: padding)."""
    g = torch.Generator().manual_seed(seed)
    common = decode_step(seq_lens, g, num_blocks=NB, width=W, block_size=BS, batch=B)
    config = builder_config(types.SimpleNamespace(block_size=BS))
    md = AscendMLAMetadataBuilder(types.SimpleNamespace(block_size=BS), ["layer"], config, torch.device("cpu"))
    q = torch.randn(B, DIMS.N, DIMS.P + DIMS.R, generator=g)
    return md.build(0, common), q, torch.randn(B, DIMS.L, generator=g), torch.randn(B, 1, DIMS.R, generator=g)


def _eager_write(md: AscendMLAMetadata, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor) -> None:
    nope, rope = latent_cache_planes(kv_cache, DIMS.L, DIMS.R)
    for b, slot in enumerate(md.slot_mapping[: md.num_reqs].tolist()):
        nope.view(-1, DIMS.L)[slot] = kv_c[b]
        rope.view(-1, DIMS.R)[slot] = k_pe[b, 0]


def _dense(md: AscendMLAMetadata, q: torch.Tensor, kv_cache: torch.Tensor, w_kv_b: torch.Tensor) -> torch.Tensor:
    """``[num_reqs, N * V]``: each request's K/V materialised from its cached latents, softmax attention in float64."""
    d = DIMS
    nope, rope = latent_cache_planes(kv_cache, d.L, d.R)
    assert md.decode is not None
    out = []
    for b, length in enumerate(md.decode.seq_lens_list):
        pos = torch.arange(length)
        blocks = md.decode.block_table[b][pos // BS].long()
        kv = (nope[blocks, pos % BS, 0].double() @ w_kv_b.double().T).view(length, d.N, d.P + d.V)
        k_nope, v = kv.split([d.P, d.V], dim=-1)
        k = torch.cat([k_nope, rope[blocks, pos % BS].double().expand(-1, d.N, -1)], dim=-1)  # [S, N, P + R]
        p = torch.softmax(torch.einsum("nd,snd->ns", q[b].double(), k) * SCALE, -1)
        out.append(torch.einsum("ns,snv->nv", p, v).reshape(-1))
    return torch.stack(out)


def _call(layer, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape[0], DIMS.N * DIMS.V, dtype=q.dtype)  # vLLM's layer allocates it in the graph
    return layer.impl.forward(layer, q, kv_c, k_pe, kv_cache, STEP.md, output=out)


def _compiled(impl: AscendMLAImpl, *, dynamic: bool):
    return compiled_step(impl, LAYER, _call, dynamic=dynamic)


def _inputs(gi: object) -> dict:
    return {LAYER: gi}


def _past_null_block(kv_cache: torch.Tensor) -> list[bytes]:
    """Both latent planes without their block 0 (vLLM's null block, where padding rows write), comparable by ==."""
    return [plane[1:].numpy().tobytes() for plane in latent_cache_planes(kv_cache, DIMS.L, DIMS.R)]


def _cache() -> torch.Tensor:
    return torch.randn(NB, BS, DIMS.L + DIMS.R, generator=torch.Generator().manual_seed(7))


def test_mla_graph_inputs_pad_the_step_to_the_graph_batch():
    md, *_ = _step([9, 30, 2], seed=1)
    g = graph_inputs_of(md, B)  # through the interface's reader, as the torchair wrapper calls it
    assert isinstance(g, GraphDecodeInputs) and md.decode is not None
    assert g.block_table.shape == (B, W) and g.seq_lens.shape == g.slots.shape == (B,)
    assert torch.equal(g.block_table[:3], md.decode.block_table) and bool((g.block_table[3:] == 0).all())
    assert g.seq_lens.tolist() == [9, 30, 2, GRAPH_PAD_SEQ_LEN] == g.seq_lens_list
    assert g.slots[:3].tolist() == md.slot_mapping[:3].tolist() and g.slots[3:].tolist() == [0]
    with pytest.raises(ValueError, match="at most 2 tokens"):
        md.graph_inputs(2)


def test_compiled_mla_decode_equals_dense_attention_over_changing_steps_with_one_compile(w_kv_b):
    impl = _impl(w_kv_b)
    compiled, recorded = _compiled(impl, dynamic=False)
    kv_cache = _cache()
    expected_cache = kv_cache.clone()
    for i, lens in enumerate(STEPS):
        md, q, kv_c, k_pe = _step(lens, seed=10 + i)
        STEP.md = md
        out = compiled(_inputs(md.graph_inputs(B)), q, kv_c, k_pe, kv_cache)
        _eager_write(md, kv_c, k_pe, expected_cache)
        torch.testing.assert_close(
            out[: md.num_reqs].double(), _dense(md, q, expected_cache, w_kv_b), atol=2e-5, rtol=1e-4
        )
        assert bool(torch.isfinite(out).all())  # padding rows attend to the null block: finite, discarded
        # Every slot a request reads is written as the eager write would; padding wrote only into null block 0.
        assert _past_null_block(kv_cache) == _past_null_block(expected_cache), f"step {i}"
    assert len(recorded.graphs) == 1, f"{len(recorded.graphs)} compiles for {len(STEPS)} steps"
    # Attention is in the graph (no opaque op), and no per-step value became a constant of it.
    targets = recorded.targets()
    assert not any("unified_attention" in t for t in targets) and any("graph_kv_write" in t for t in targets)
    placeholders = [n.name for n in recorded.graphs[0].graph.nodes if n.op == "placeholder"]
    assert any("inputs" in n and "seq_lens" in n for n in placeholders), placeholders


def test_stale_graph_inputs_give_wrong_results(w_kv_b):
    """Nothing in the graph guards on tensor contents: a step run on the previous step's inputs is silently wrong,
    which is why the torchair wrapper prepares them before every compiled call."""
    compiled, recorded = _compiled(_impl(w_kv_b), dynamic=False)
    kv_cache = _cache()
    first, *args = _step(STEPS[0], seed=10)
    STEP.md = first
    stale = _inputs(first.graph_inputs(B))
    compiled(stale, *args, kv_cache)
    md, q, kv_c, k_pe = _step(STEPS[1], seed=11)
    STEP.md = md
    out = compiled(stale, q, kv_c, k_pe, kv_cache.clone())  # not this step's inputs
    expected_cache = kv_cache.clone()
    _eager_write(md, kv_c, k_pe, expected_cache)
    assert len(recorded.graphs) == 1  # no guard caught it ...
    assert not torch.allclose(out[: md.num_reqs].double(), _dense(md, q, expected_cache, w_kv_b), atol=1e-3)


def test_npu_graph_takes_symbolic_lengths_compiles_once_and_has_ge_converters(monkeypatch, w_kv_b):
    """How the torchair wrapper compiles on an NPU (``dynamic=True``, every tensor marked static), with the NPU twins
    (``npu_scatter_nd_update_`` per latent plane, the functional ``npu_fused_infer_attention_score`` in BNSD with
    query_rope/key_rope): the lengths reach the kernel as ``SymInt`` graph inputs, steps with new lengths run the one
    compiled graph with the dense results, and every op of the graph has a GE converter in torch_npu 2.8.0."""
    from vllm_npu.attention.ops.graph_decode import GRAPH_KV_WRITE, MLA_GRAPH_DECODE

    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu())
    impl = _impl(w_kv_b)
    impl._graph_write, impl._graph_decode = GRAPH_KV_WRITE.npu, MLA_GRAPH_DECODE.npu  # the NPU twins, as on an NPU
    compiled, recorded = _compiled(impl, dynamic=True)
    kv_cache = _cache()
    expected_cache = kv_cache.clone()
    first_compiles = 0
    for i, lens in enumerate(STEPS):
        md, q, kv_c, k_pe = _step(lens, seed=30 + i)
        STEP.md, gi = md, md.graph_inputs(B)
        for t in (q, kv_c, k_pe, kv_cache, gi.block_table, gi.seq_lens, gi.slots):
            torch._dynamo.mark_static(t)
        out = compiled(_inputs(gi), q, kv_c, k_pe, kv_cache)
        first_compiles = first_compiles or len(recorded.graphs)
        _eager_write(md, kv_c, k_pe, expected_cache)
        torch.testing.assert_close(
            out[: md.num_reqs].double(), _dense(md, q, expected_cache, w_kv_b), atol=2e-5, rtol=1e-4
        )
        assert _past_null_block(kv_cache) == _past_null_block(expected_cache), f"step {i}"
    assert_one_npu_graph(recorded, first_compiles, B)
