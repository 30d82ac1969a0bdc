# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``cudagraph_mode=FULL_DECODE_ONLY`` with a tiny Qwen3-MoE (6 experts top-2 through npu-ops' FusedMoE, GQA
attention), KV block size 16: the MoE routing, dispatch and grouped matmuls are inside the decode graphs.
Greedy output must equal HF (scenario: ``npu_testkit.graph_e2e``)."""

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

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(tiny_config("qwen3_moe"))


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    with graph_engine(tiny_model, tmp_path_factory, "moe_full_decode", "FULL_DECODE_ONLY", block_size=BLOCK) as llm:
        yield llm


def test_moe_decode_graphs_captured(llm):
    info = runtime_info(llm)
    assert info["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert info["graphs"]["captures"] == {"FULL": len(CAPTURE_SIZES)} == {"FULL": info["cudagraph_captured"]}
    assert "AscendFusedMoE" in info["plugin_modules"], info["plugin_modules"]


def test_every_batch_size_matches_hf(llm, tiny_model):
    check_every_batch_size_replayed(llm, tiny_model, "FULL")


def test_mixed_prefill_decode_and_chunked_prefill_match_hf(llm, tiny_model):
    check_mixed_and_chunked(llm, tiny_model)


def test_prefix_cache_hit_matches_hf(llm, tiny_model):
    check_prefix_cache(llm, tiny_model, block_size=BLOCK)
