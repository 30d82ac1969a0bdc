# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The GQA impl's compiled-decode-graph path (the torchair mode) under ``torch.compile(fullgraph=True,
dynamic=False)``, without an engine.

The compiled function is built like the torchair wrapper's: it takes the step's graph inputs as an argument and stores
them in ``vllm_npu.interface.graphs.COMPILED_STEP`` (where the impl reads its layer's entry), and reads the
metadata itself from a module global, the way vLLM's attention layer reads the forward context. Over decode
steps whose request counts, sequence lengths, block tables and slots all change, the compiled graph must equal a
plain float64 softmax attention over the updated cache, compile exactly once, and write the cache exactly like the
eager write. Then the two failure modes the design exists to exclude are shown to be real: a step run on stale graph
inputs gives wrong results (nothing guards on tensor contents), and the eager path, which reads the step's host
lists, recompiles when they change.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from attn_harness import make_builder
from graph_harness import assert_one_npu_graph, compiled_step, decode_step, fake_torch_npu
from vllm_npu.attention.backends.gqa import AscendAttentionImpl
from vllm_npu.attention.metadata import GRAPH_PAD_SEQ_LEN, AscendMetadata, GraphDecodeInputs
from vllm_npu.interface import configure_kernels, graph_inputs_of

NH, NKV, D, BS, NB, W, B = 4, 2, 16, 16, 24, 4, 4  # heads, KV heads, head size, block size, blocks, table width, batch
LAYER = "model.layers.0.self_attn.attn"  # the attention layer's name
STEP = types.SimpleNamespace(md=None)  # what the compiled function reads, like vLLM's forward context


@pytest.fixture(autouse=True, scope="module")
def _reference_kernels():
    configure_kernels("reference")


def _impl() -> AscendAttentionImpl:
    return AscendAttentionImpl(NH, D, D**-0.5, NKV, None, None, "auto", None, "decoder")


def _step(seq_lens: list[int], seed: int) -> tuple[AscendMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A DecodeOnly step of ``len(seq_lens)`` requests with random distinct blocks (never block 0), built by the real
    metadata builder; query/key/value ``[B, ...]`` (rows past the requests are padding)."""
    g = torch.Generator().manual_seed(seed)
    common = decode_step(seq_lens, g, num_blocks=NB, width=W, block_size=BS, batch=B)
    md = make_builder(BS, NKV, D, torch.float32).build(0, common)
    q = torch.randn(B, NH, D, generator=g)
    k = torch.randn(B, NKV, D, generator=g)
    v = torch.randn(B, NKV, D, generator=g)
    return md, q, k, v


def _dense(md: AscendMetadata, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """float64 softmax attention of each real request over its first ``seq_len`` cache positions."""
    out = torch.empty(md.num_reqs, NH, D, dtype=torch.float64)
    for b, length in enumerate(md.seq_lens_list):
        pos = torch.arange(length)
        blocks = md.block_table[b][pos // BS].long()
        k = kv_cache[0, blocks, pos % BS].double()
        v = kv_cache[1, blocks, pos % BS].double()
        for h in range(NH):
            p = torch.softmax(q[b, h].double() @ k[:, h // (NH // NKV)].T * D**-0.5, -1)
            out[b, h] = p @ v[:, h // (NH // NKV)]
    return out


def _eager_write(md: AscendMetadata, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> None:
    for b, slot in enumerate(md.slot_mapping[: md.num_reqs].tolist()):
        kv_cache[0, slot // BS, slot % BS] = k[b]
        kv_cache[1, slot // BS, slot % BS] = v[b]


def _call(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    return layer.impl.forward(layer, q, k, v, kv_cache, STEP.md, output=torch.empty_like(q))


def _compiled(impl: AscendAttentionImpl, *, dynamic: bool):
    return compiled_step(impl, LAYER, _call, dynamic=dynamic)


def _inputs(gi: object) -> dict:
    return {LAYER: gi}


STEPS = [[9, 30, 2, 64], [10, 31, 3], [5], [33, 17], [2, 48, 12, 7], [11, 32, 4, 8]]


def test_graph_inputs_pad_the_step_to_the_graph_batch():
    md, *_ = _step([9, 30, 2], seed=1)
    g = graph_inputs_of(md, B)  # through the interface's reader, as the torchair wrapper calls it
    assert (
        isinstance(g, GraphDecodeInputs) and g.block_table.shape == (B, W) and g.seq_lens.shape == g.slots.shape == (B,)
    )
    assert torch.equal(g.block_table[:3], md.block_table[:3]) and bool((g.block_table[3:] == 0).all())
    assert g.seq_lens.tolist() == [9, 30, 2, GRAPH_PAD_SEQ_LEN] == g.seq_lens_list
    assert g.slots[:3].tolist() == md.slot_mapping[:3].tolist() and g.slots[3:].tolist() == [0]
    with pytest.raises(ValueError, match="at most 2 tokens"):
        md.graph_inputs(2)


def test_compiled_decode_equals_dense_attention_over_changing_steps_with_one_compile():
    compiled, recorded = _compiled(_impl(), dynamic=False)
    kv_cache = torch.randn(2, NB, BS, NKV, D)
    expected_cache = kv_cache.clone()
    for i, lens in enumerate(STEPS):
        md, q, k, v = _step(lens, seed=10 + i)
        STEP.md = md
        out = compiled(_inputs(md.graph_inputs(B)), q, k, v, kv_cache)
        _eager_write(md, k, v, expected_cache)
        torch.testing.assert_close(out[: md.num_reqs].double(), _dense(md, q, expected_cache), atol=2e-5, rtol=1e-5)
        assert bool(torch.isfinite(out).all())  # padding rows attend to the null block: finite, discarded
        # Every slot a request reads is written as the eager write would; padding wrote only into null block 0.
        assert torch.equal(kv_cache[:, 1:], expected_cache[:, 1:]), f"step {i}"
    assert len(recorded.graphs) == 1, f"{len(recorded.graphs)} compiles for {len(STEPS)} steps"
    # Attention is in the graph (no opaque op), and no per-step value became a constant of it.
    targets = recorded.targets()
    assert not any("unified_attention" in t for t in targets) and any("graph_kv_write" in t for t in targets)
    placeholders = [n for n in recorded.graphs[0].graph.nodes if n.op == "placeholder"]
    assert any("inputs" in n.name and "seq_lens" in n.name for n in placeholders), placeholders


def test_stale_graph_inputs_give_wrong_results():
    """Nothing in the graph guards on tensor contents: a step run on the previous step's inputs is silently wrong,
    which is why the torchair wrapper prepares them before every compiled call."""
    compiled, recorded = _compiled(_impl(), dynamic=False)
    kv_cache = torch.randn(2, NB, BS, NKV, D)
    first, *qkv = _step(STEPS[0], seed=10)
    STEP.md = first
    stale = _inputs(first.graph_inputs(B))
    compiled(stale, *qkv, kv_cache)
    md, q, k, v = _step(STEPS[1], seed=11)
    STEP.md = md
    out = compiled(stale, q, k, v, kv_cache.clone())  # not this step's inputs
    expected_cache = kv_cache.clone()
    _eager_write(md, k, v, expected_cache)
    assert len(recorded.graphs) == 1  # no guard caught it ...
    assert not torch.allclose(out[: md.num_reqs].double(), _dense(md, q, expected_cache), atol=1e-3)  # ... wrong


def test_the_eager_path_reads_host_values_and_recompiles():
    """Without graph inputs the impl takes its eager path, whose host-side lengths Dynamo bakes in and guards on:
    a compiled graph of it recompiles as soon as a step's lengths change (what the graph path avoids)."""
    compiled, recorded = _compiled(_impl(), dynamic=False)
    kv_cache = torch.randn(2, NB, BS, NKV, D)
    for i, lens in enumerate(STEPS[:3]):
        md, q, k, v = _step(lens, seed=20 + i)
        STEP.md = md
        compiled({}, q, k, v, kv_cache)
    assert len(recorded.graphs) == 3, "the eager path should recompile for every new set of host-side lengths"


# --- the NPU strategy: dynamic ints, static tensors ---------------------------------------------------------------


def test_npu_graph_takes_the_lengths_as_symbolic_inputs_and_has_ge_converters(monkeypatch):
    """How the torchair wrapper compiles on an NPU (``dynamic=True``, every tensor marked static): the lengths the
    NPU kernel takes as ``SymInt[]`` reach it as symbolic graph inputs through ``COMPILED_STEP`` (not constants), so
    steps with new lengths run the one compiled graph, the results are the dense attention's, and every op of the
    graph has a GE converter in torch_npu 2.8.0's torchair (``npu_testkit.torchair_converters``)."""
    from vllm_npu.attention.ops.graph_decode import GRAPH_DECODE, GRAPH_KV_WRITE

    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu())
    impl = _impl()
    impl.graph_decode, impl.graph_kv_write = GRAPH_DECODE.npu, GRAPH_KV_WRITE.npu  # the NPU twins, as on an NPU
    compiled, recorded = _compiled(impl, dynamic=True)
    kv_cache = torch.randn(2, NB, BS, NKV, D)
    expected_cache = kv_cache.clone()
    first_compiles = 0
    for i, lens in enumerate(STEPS):
        md, q, k, v = _step(lens, seed=30 + i)
        STEP.md, gi = md, md.graph_inputs(B)
        for t in (q, k, v, kv_cache, gi.block_table, gi.seq_lens, gi.slots):
            torch._dynamo.mark_static(t)
        out = compiled(_inputs(gi), q, k, v, kv_cache)
        first_compiles = first_compiles or len(recorded.graphs)
        _eager_write(md, k, v, expected_cache)
        torch.testing.assert_close(out[: md.num_reqs].double(), _dense(md, q, expected_cache), atol=1e-5, rtol=1e-5)
        assert torch.equal(kv_cache[:, 1:], expected_cache[:, 1:]), f"step {i}"
    assert_one_npu_graph(recorded, first_compiles, B)
