# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``cudagraph_mode=FULL_DECODE_ONLY`` on the emulated device with a tiny Llama (GQA), KV block size 128.

Pure-decode batches replay one captured graph of the whole model per batch size (traced through the attention
backend: its host-side decisions are frozen), with the decode kernel's sequence lengths refreshed before every
replay through the graph-task path (``vllm_npu.interface.graphs``, the same path as ACL graph task updates on an
NPU). Other batches run eagerly. Greedy output must equal HF (scenario: ``npu_testkit.graph_e2e``), and skipping the
refresh must give wrong tokens: the twin freezes what an NPU graph freezes.
"""

from __future__ import annotations

import pytest
from npu_testkit.graph_e2e import (
    CAPTURE_SIZES,
    check_every_batch_size_replayed,
    check_mixed_and_chunked,
    check_prefix_cache,
    check_skipped_refresh_gives_wrong_tokens,
    graph_engine,
    runtime_info,
)
from npu_testkit.structured import ENGINE_KWARGS, check_structured_masked_per_step
from vllm_npu.interface import compilation_level

pytestmark = pytest.mark.engine

BLOCK = 128
LAYERS = 2


@pytest.fixture(scope="module")
def llm(tiny_llama, tmp_path_factory):
    with graph_engine(
        tiny_llama, tmp_path_factory, "full_decode", "FULL_DECODE_ONLY", block_size=BLOCK, **ENGINE_KWARGS
    ) as llm:
        yield llm


def test_one_full_graph_per_decode_size(llm):
    comp = llm.llm_engine.vllm_config.compilation_config
    assert compilation_level(comp) == 0  # mixed batches run eagerly: nothing for Dynamo to do
    info = runtime_info(llm)
    assert info["cudagraph_mode"] == "FULL_DECODE_ONLY" and info["block_size"] == BLOCK
    assert info["graphs"]["captures"] == {"FULL": len(CAPTURE_SIZES)}
    assert info["cudagraph_captured"] == len(CAPTURE_SIZES)
    # one updatable decode-attention task per layer per graph
    assert info["graphs"]["tasks"] == LAYERS * len(CAPTURE_SIZES)


def test_every_batch_size_matches_hf(llm, tiny_llama):
    check_every_batch_size_replayed(llm, tiny_llama, "FULL")


def test_mixed_prefill_decode_and_chunked_prefill_match_hf(llm, tiny_llama):
    check_mixed_and_chunked(llm, tiny_llama)


def test_prefix_cache_hit_matches_hf(llm, tiny_llama):
    check_prefix_cache(llm, tiny_llama, block_size=BLOCK, prefix_blocks=1)


def test_skipping_the_in_graph_metadata_update_gives_wrong_tokens(llm, tiny_llama, monkeypatch):
    check_skipped_refresh_gives_wrong_tokens(llm, tiny_llama, monkeypatch)


@pytest.mark.parametrize("side", ["selected", "npu"])
def test_structured_output_is_masked_every_step_next_to_the_graph_replays(llm, tiny_llama, side):
    # Every constraint kind in one batch with a plain request: valid, and equal to the constrained greedy reference
    # (HF float32 + xgrammar). The bitmask changes every step and is applied to the logits after the captured
    # forward (in _sample, outside the graph): one mask per step, each after that step's replay. "npu": the runner
    # masks with the NPU's side of GRAMMAR_BITMASK (on the device; here the CPU) instead of the reference it selected.
    from vllm_npu.platform.sample import GRAMMAR_BITMASK

    _, seen = check_structured_masked_per_step(llm, tiny_llama, "FULL", GRAMMAR_BITMASK.npu if side == "npu" else None)
    assert sum(b > a for a, b in zip(seen, seen[1:])) >= 15, seen
