# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``cudagraph_mode=PIECEWISE`` on the emulated device with a tiny Qwen2 (GQA), KV block size 16.

Dynamo splits the model at the attention op; every piece is captured per batch size into the static-graph twin
(frozen host values, address-checked inputs) and replayed; attention runs eagerly between the pieces. Greedy output
must equal HF for every batch size, mixed/chunked steps and prefix-cache hits (scenario: ``npu_testkit.graph_e2e``).
"""

from __future__ import annotations

import pytest
from npu_testkit.graph_e2e import (
    CAPTURE_SIZES,
    check_every_batch_size_replayed,
    check_mixed_and_chunked,
    check_prefix_cache,
    graph_engine,
    runtime_info,
)
from npu_testkit.structured import ENGINE_KWARGS, check_structured_masked_per_step
from vllm_npu.interface import compilation_level

pytestmark = pytest.mark.engine

BLOCK = 16


@pytest.fixture(scope="module")
def llm(tiny_qwen2, tmp_path_factory):
    with graph_engine(tiny_qwen2, tmp_path_factory, "piecewise", "PIECEWISE", block_size=BLOCK, **ENGINE_KWARGS) as llm:
        yield llm


def test_pieces_are_captured_per_size(llm):
    comp = llm.llm_engine.vllm_config.compilation_config
    assert (
        compilation_level(comp) == 3
        and not comp.use_inductor
        # vLLM 0.11.0 names the op "vllm.unified_attention_with_output", 0.11.1 "vllm::unified_attention_with_output"
        and any(op.endswith("unified_attention_with_output") for op in comp.splitting_ops)
    )
    info = runtime_info(llm)
    assert info["cudagraph_mode"] == "PIECEWISE" and info["capture_sizes"] == CAPTURE_SIZES
    # 2 decoder layers -> 3 pieces, each captured once per size; vLLM's own counter agrees.
    assert info["graphs"]["captures"] == {"PIECEWISE": 3 * len(CAPTURE_SIZES)}
    assert info["cudagraph_captured"] == 3 * len(CAPTURE_SIZES)
    assert info["attention_backends"] == ["vllm_npu.attention.backends.gqa.AscendAttentionBackend"]


def test_every_batch_size_matches_hf(llm, tiny_qwen2):
    check_every_batch_size_replayed(llm, tiny_qwen2, "PIECEWISE")


def test_mixed_prefill_decode_and_chunked_prefill_match_hf(llm, tiny_qwen2):
    check_mixed_and_chunked(llm, tiny_qwen2)


def test_prefix_cache_hit_matches_hf(llm, tiny_qwen2):
    check_prefix_cache(llm, tiny_qwen2, block_size=BLOCK)


def test_structured_output_is_masked_every_step_next_to_the_piece_replays(llm, tiny_qwen2):
    # Every constraint kind in one batch with a plain request: valid, and equal to the constrained greedy reference
    # (HF float32 + xgrammar); the runner masks the logits once per step, after the step's pieces were replayed.
    _, seen = check_structured_masked_per_step(llm, tiny_qwen2, "PIECEWISE")
    assert sum(b > a for a, b in zip(seen, seen[1:])) >= 15, seen
