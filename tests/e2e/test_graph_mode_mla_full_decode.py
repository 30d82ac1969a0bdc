# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``cudagraph_mode=FULL_DECODE_ONLY`` with a tiny DeepSeek-V3 (MLA through AscendMLABackend; layer 0 dense, layer
1 MoE), KV block size 16.

Pure-decode batches replay one captured graph of the whole model per batch size: the MLA layer's fused k-norm /
rope / latent-cache write (outside the attention op, reading the slot mapping by address), the absorbed decode
kernel as an updatable task whose sequence lengths are refreshed before every replay, and the MoE layer. Greedy
output must equal HF (scenario: ``npu_testkit.graph_e2e``), and skipping the refresh must give wrong tokens.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import greedy, make_prompts, tiny_config
from npu_testkit.graph_e2e import (
    CAPTURE_SIZES,
    NEW_TOKENS,
    check_every_batch_size_replayed,
    check_mixed_and_chunked,
    check_prefix_cache,
    check_skipped_refresh_gives_wrong_tokens,
    graph_engine,
    runtime_info,
)
from npu_testkit.models import build_tiny_model, hf_greedy
from vllm_npu.interface import compilation_level

pytestmark = pytest.mark.engine

BLOCK = 16
LAYERS = 2


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(tiny_config("deepseek_v3"))


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    with graph_engine(tiny_model, tmp_path_factory, "mla_full_decode", "FULL_DECODE_ONLY", block_size=BLOCK) as llm:
        yield llm


def _mla_layers(worker) -> list[dict]:
    model = worker.model_runner.get_model()
    return [
        {"fused_cache_write": layer.self_attn.mla_attn.fused_cache_write, "moe": hasattr(layer.mlp, "experts")}
        for layer in model.model.layers
    ]


def test_mla_decode_graphs_captured_with_the_fused_cache_write(llm):
    comp = llm.llm_engine.vllm_config.compilation_config
    assert compilation_level(comp) == 0  # no Dynamo: mixed batches run eagerly
    info = runtime_info(llm)
    assert info["attention_backends"] == ["vllm_npu.attention.backends.mla.AscendMLABackend"]
    assert info["cudagraph_mode"] == "FULL_DECODE_ONLY" and info["block_size"] == BLOCK
    assert info["graphs"]["captures"] == {"FULL": len(CAPTURE_SIZES)} == {"FULL": info["cudagraph_captured"]}
    # one updatable decode-attention task per layer per graph
    assert info["graphs"]["tasks"] == LAYERS * len(CAPTURE_SIZES)
    (layers,) = llm.collective_rpc(_mla_layers)
    assert [layer["fused_cache_write"] for layer in layers] == [True] * LAYERS
    assert [layer["moe"] for layer in layers] == [False, True]


def test_every_batch_size_matches_hf(llm, tiny_model):
    check_every_batch_size_replayed(llm, tiny_model, "FULL")


def test_mixed_prefill_decode_and_chunked_prefill_match_hf(llm, tiny_model):
    check_mixed_and_chunked(llm, tiny_model)


def test_prefix_cache_hit_matches_hf(llm, tiny_model):
    check_prefix_cache(llm, tiny_model, block_size=BLOCK)


def test_skipping_the_in_graph_metadata_update_gives_wrong_tokens(llm, tiny_model, monkeypatch):
    check_skipped_refresh_gives_wrong_tokens(llm, tiny_model, monkeypatch)


def _estimate_graph_pool(worker) -> dict:
    """The runner's real graph-pool estimate, with the device backend's memory counters scripted (the emulated
    device's RSS says nothing about a graph pool): what it runs and what it returns."""
    runner = worker.model_runner
    real_backend, real_dummy_run = runner.device_backend, runner._dummy_run
    calls: list = []

    class Counters:
        def __getattr__(self, name):
            return getattr(real_backend, name)

        def synchronize(self, device=None):
            calls.append("synchronize")

        def reset_peak_memory_stats(self, device=None):
            calls.append("reset_peak")

        def memory_allocated(self, device=None):
            return 1000

        def peak_memory_allocated(self, device=None):
            return 1000 + 64 * max((c[1] for c in calls if isinstance(c, tuple)), default=0)

    def dummy_run(num_tokens, **kwargs):
        calls.append(("dummy_run", num_tokens, kwargs.get("cudagraph_runtime_mode").name))
        return real_dummy_run(num_tokens, **kwargs)

    runner.device_backend, runner._dummy_run = Counters(), dummy_run
    try:
        estimate = runner.estimate_graph_memory()
    finally:
        runner.device_backend, runner._dummy_run = real_backend, real_dummy_run
    return {"estimate": estimate, "calls": calls}


def test_graph_pool_estimate_runs_one_eager_forward_at_the_largest_size(llm, tiny_model):
    (report,) = llm.collective_rpc(_estimate_graph_pool)
    largest = max(CAPTURE_SIZES)
    assert report["calls"] == ["synchronize", "reset_peak", ("dummy_run", largest, "NONE"), "synchronize"]
    assert report["estimate"] == 64 * largest  # the allocator peak over the dummy forward, above its start
    # the eager dummy forward after capture leaves the graphs and the cache intact
    prompts = make_prompts([5, 9], seed=15)
    assert greedy(llm, prompts, NEW_TOKENS) == hf_greedy(tiny_model, prompts, NEW_TOKENS)
