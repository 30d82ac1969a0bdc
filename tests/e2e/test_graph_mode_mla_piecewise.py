# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``cudagraph_mode=PIECEWISE`` with a tiny DeepSeek-V3 (MLA attention through AscendMLABackend, a dense and an MoE
layer), KV block size 128. The MLA layer writes its latent cache inside the attention op here (the fused
k-norm/rope/write outside it is eager-only: graphs would freeze it). Greedy output must equal HF (scenario:
``npu_testkit.graph_e2e``)."""

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


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(tiny_config("deepseek_v3"))


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    with graph_engine(tiny_model, tmp_path_factory, "mla_piecewise", "PIECEWISE", block_size=BLOCK) as llm:
        yield llm


def test_mla_pieces_captured(llm):
    info = runtime_info(llm)
    assert info["attention_backends"] == ["vllm_npu.attention.backends.mla.AscendMLABackend"]
    assert info["cudagraph_mode"] == "PIECEWISE" and info["block_size"] == BLOCK
    assert info["graphs"]["captures"] == {"PIECEWISE": 3 * len(CAPTURE_SIZES)}  # 2 layers -> 3 pieces per size


def test_every_batch_size_matches_hf(llm, tiny_model):
    check_every_batch_size_replayed(llm, tiny_model, "PIECEWISE")


def test_mixed_prefill_decode_and_chunked_prefill_match_hf(llm, tiny_model):
    check_mixed_and_chunked(llm, tiny_model)


def test_prefix_cache_hit_matches_hf(llm, tiny_model):
    check_prefix_cache(llm, tiny_model, block_size=BLOCK, prefix_blocks=1)
