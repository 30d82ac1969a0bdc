# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``cudagraph_mode=FULL_DECODE_ONLY`` with a tiny DeepSeek-V2-style MLA model (no q-LoRA: ``q_proj`` and
``kv_a_proj_with_mqa``, the other projection branch of the fused cache write), KV block size 128.

The block-size-16 module (``test_graph_mode_mla_full_decode.py``) has the skip-refresh check; this one covers the
other block size and projection layout. vLLM 0.11's DeepSeek model refuses a checkpoint without an MoE layer ("No
DeepseekV2MoE layer found"), so each graph holds a dense and an MoE layer here too. Greedy output must equal HF
(scenario: ``npu_testkit.graph_e2e``).
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import tiny_config
from npu_testkit.graph_e2e import (
    CAPTURE_SIZES,
    check_every_batch_size_replayed,
    check_mixed_and_chunked,
    check_prefix_cache,
    graph_engine,
    runtime_info,
)
from npu_testkit.models import build_tiny_model

pytestmark = pytest.mark.engine

BLOCK = 128
LAYERS = 2


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(tiny_config("deepseek_v3", q_lora_rank=None))


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    with graph_engine(tiny_model, tmp_path_factory, "mla_full_128", "FULL_DECODE_ONLY", block_size=BLOCK) as llm:
        yield llm


def _fused_writes(worker) -> list[tuple[bool, bool]]:
    model = worker.model_runner.get_model()
    return [
        (layer.self_attn.mla_attn.fused_cache_write, layer.self_attn.mla_attn.q_proj is not None)
        for layer in model.model.layers
    ]


def test_mla_decode_graphs_captured(llm):
    info = runtime_info(llm)
    assert info["attention_backends"] == ["vllm_npu.attention.backends.mla.AscendMLABackend"]
    assert info["cudagraph_mode"] == "FULL_DECODE_ONLY" and info["block_size"] == BLOCK
    assert info["graphs"]["captures"] == {"FULL": len(CAPTURE_SIZES)} == {"FULL": info["cudagraph_captured"]}
    assert info["graphs"]["tasks"] == LAYERS * len(CAPTURE_SIZES)
    (layers,) = llm.collective_rpc(_fused_writes)
    assert layers == [(True, True)] * LAYERS  # fused write, q_proj branch (no q-LoRA)


def test_every_batch_size_matches_hf(llm, tiny_model):
    check_every_batch_size_replayed(llm, tiny_model, "FULL")


def test_mixed_prefill_decode_and_chunked_prefill_match_hf(llm, tiny_model):
    check_mixed_and_chunked(llm, tiny_model)


def test_prefix_cache_hit_matches_hf(llm, tiny_model):
    # seed 14: with this model the default prefix's continuation reaches EOS (token 0), which HF's reference forbids
    check_prefix_cache(llm, tiny_model, block_size=BLOCK, prefix_blocks=1, seed=14)
