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
    graph_engine,
    runtime_info,
)
from npu_testkit.models import build_tiny_model, hf_greedy

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
    assert comp.level == 0  # no Dynamo: mixed batches run eagerly
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
    from vllm_npu.platform.graphs.wrapper import NPUGraphWrapper

    prompts = make_prompts([5, 8, 40], seed=14)
    ref = hf_greedy(tiny_model, prompts, NEW_TOKENS)
    assert greedy(llm, prompts, NEW_TOKENS) == ref
    # Replays keep the capture-time sequence lengths (all 1): each decode step attends to one cached latent.
    monkeypatch.setattr(NPUGraphWrapper, "refresh", staticmethod(lambda graph: None))
    stale = greedy(llm, prompts, NEW_TOKENS)
    assert stale != ref
    assert all(s[0] == r[0] for s, r in zip(stale, ref, strict=True))  # the first token comes from the prefill
    monkeypatch.undo()
    assert greedy(llm, prompts, NEW_TOKENS) == ref
