# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``npu.emulated_compile=inductor`` with ``cudagraph_mode=FULL_DECODE_ONLY`` on the emulated device (tiny Llama, GQA).

Each captured decode graph is compiled at start-up: its pieces between the KV-cache writes and the decode-attention
tasks go to inductor, the writes and tasks run on the real buffers. Greedy output must equal HF for every batch
size (padded to a capture size, or eager above the largest), and skipping the per-step task refresh must still give
wrong tokens: compiling keeps what the static graph freezes. Two capture sizes only: every size is one more
inductor compile at engine start.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts
from npu_testkit.graph_e2e import NEW_TOKENS, check_skipped_refresh_gives_wrong_tokens, runtime_info
from npu_testkit.models import hf_greedy
from npu_testkit.structured import ENGINE_KWARGS, check_structured_masked_per_step

pytestmark = pytest.mark.engine

SIZES = [2, 4]
LAYERS = 2


@pytest.fixture(scope="module")
def llm(tiny_llama, tmp_path_factory):
    kwargs = {
        "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": SIZES},
        "additional_config": {"npu": {"emulated_compile": "inductor"}},
        "block_size": 128,
        "max_num_seqs": 8,
        **ENGINE_KWARGS,
    }
    with engine(tiny_llama, emulated_env(tmp_path_factory.mktemp("compiled")), **kwargs) as llm:
        yield llm


def test_every_decode_graph_is_compiled_once_at_start(llm):
    graphs = runtime_info(llm)["graphs"]
    assert graphs["captures"] == {"FULL": len(SIZES)} and graphs["compiled"] == {"FULL": len(SIZES)}
    assert sorted(graphs["compile_seconds"]) == SIZES
    assert graphs["tasks"] == LAYERS * len(SIZES)


def test_every_batch_size_matches_hf(llm, tiny_llama):
    before = runtime_info(llm)["graphs"]["replays"].get("FULL", 0)
    pool = make_prompts([3 + (7 * i) % 13 for i in range(SIZES[-1] + 1)], seed=21)
    ref = hf_greedy(tiny_llama, pool, NEW_TOKENS)
    for n in range(1, len(pool) + 1):
        assert greedy(llm, pool[:n], NEW_TOKENS) == ref[:n], f"batch of {n}"
    assert runtime_info(llm)["graphs"]["replays"]["FULL"] > before
    assert runtime_info(llm)["graphs"]["compiled"] == {"FULL": len(SIZES)}  # nothing compiled while serving


def test_skipping_the_in_graph_metadata_update_gives_wrong_tokens(llm, tiny_llama, monkeypatch):
    check_skipped_refresh_gives_wrong_tokens(llm, tiny_llama, monkeypatch)


def test_structured_output_is_masked_every_step_next_to_the_compiled_replays(llm, tiny_llama):
    # Every constraint kind in one batch with a plain request: valid, and equal to the constrained greedy reference
    # (HF float32 + xgrammar); the mask runs once per step outside the compiled graphs (batches above 4 run eagerly).
    _, seen = check_structured_masked_per_step(llm, tiny_llama, "FULL")
    assert sum(b > a for a, b in zip(seen, seen[1:])) >= 8, seen
