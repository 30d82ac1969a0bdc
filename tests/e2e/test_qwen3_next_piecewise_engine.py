# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Qwen3-Next (npu-models) in ``cudagraph_mode=PIECEWISE`` on the emulated device: the gated delta-net layers run
between the captured pieces through vLLM's ``vllm.gdn_attention`` splitting op (as the attention layers do through
theirs), for mixed prefill/decode steps too. Same tiny model and HF reference as ``test_qwen3_next_engine.py`` (the
FULL_DECODE_ONLY module, which also covers preemption); 64-token step budget, capture sizes 1/2/4/8.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts
from npu_testkit.graph_e2e import CAPTURE_SIZES, MAX_BATCH, MIXED_LENGTHS, NEW_TOKENS, replays
from npu_testkit.models import build_tiny_model, hf_greedy
from npu_testkit.models_hybrid import tiny_qwen3_next_config

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model_dir():
    return build_tiny_model(tiny_qwen3_next_config())


@pytest.fixture(scope="module")
def llm(model_dir, tmp_path_factory):
    kwargs = {
        "compilation_config": {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": CAPTURE_SIZES},
        "block_size": 16,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
    }
    with engine(model_dir, emulated_env(tmp_path_factory.mktemp("qwen3next-pw")), **kwargs) as llm:
        yield llm


def test_vllm_splits_the_graph_at_the_gdn_op(llm):
    splitting = llm.llm_engine.vllm_config.compilation_config.splitting_ops
    assert "vllm.gdn_attention" in splitting and "vllm.unified_attention_with_output" in splitting


def test_mixed_chunked_and_every_batch_size_replay_and_match_hf(llm, model_dir):
    prompts = make_prompts(MIXED_LENGTHS, seed=12)
    pool = make_prompts([3 + (7 * i) % 13 for i in range(MAX_BATCH)], seed=21)
    ref = hf_greedy(model_dir, prompts + pool, NEW_TOKENS, attn_implementation="eager")
    before = replays(llm, "PIECEWISE")
    assert greedy(llm, prompts, NEW_TOKENS) == ref[: len(prompts)]
    for n in range(1, MAX_BATCH + 1):
        assert greedy(llm, pool[:n], NEW_TOKENS) == ref[len(prompts) : len(prompts) + n], f"batch of {n}"
    assert replays(llm, "PIECEWISE") > before
