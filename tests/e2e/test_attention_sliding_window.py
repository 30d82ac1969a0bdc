# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Sliding-window attention end to end: tiny Qwen2 with ``use_sliding_window`` (window 16 on every layer), real vLLM
on the emulated device, greedy tokens equal HF transformers (float32).

Prompts and generations run far past the window, so every attention state (first prefill, chunked prefill with
``max_num_batched_tokens=48``, mixed batches, prefix-cache hits, decode) reads windowed keys; vLLM's sliding-window
KV manager also swaps out-of-window blocks for its null block, which the backend must never attend to.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, greedy_outputs, make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine

WINDOW = 16
MAX_TOKENS = 40
LENGTHS = [3, 20, 57, 130]


@pytest.fixture(scope="module")
def sliding_qwen2():
    cfg = tiny_config("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)
    assert cfg.layer_types == ["sliding_attention"] * cfg.num_hidden_layers
    return build_tiny_model(cfg)


@pytest.fixture(scope="module")
def llm(sliding_qwen2, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("sliding"))
    with engine(sliding_qwen2, env, max_num_batched_tokens=48, enable_prefix_caching=True) as llm:
        yield llm


def test_engine_runs_sliding_window_layers(llm):
    config = llm.llm_engine.vllm_config
    assert config.model_config.get_sliding_window() == WINDOW
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["attention_backends"] == ["vllm_npu.attention.backends.gqa.AscendAttentionBackend"]


def test_sliding_window_greedy_matches_hf(llm, sliding_qwen2):
    prompts = make_prompts(LENGTHS, seed=21)
    expected = hf_greedy(sliding_qwen2, prompts, MAX_TOKENS)
    assert greedy(llm, prompts, MAX_TOKENS) == expected


def test_sliding_window_prefix_cache_hit_matches_hf(llm, sliding_qwen2):
    (prefix,) = make_prompts([80], seed=41)  # 5 full blocks of 16, longer than the window
    batch = [prefix + s for s in make_prompts([5, 11], seed=42)]
    expected = hf_greedy(sliding_qwen2, batch, 20)
    assert greedy(llm, batch[:1], 20) == expected[:1]
    second = greedy_outputs(llm, batch, 20)
    assert [list(o.outputs[0].token_ids) for o in second] == expected
    assert all(o.num_cached_tokens > 0 for o in second), [o.num_cached_tokens for o in second]


def test_window_changes_the_output(sliding_qwen2):
    # Guard against a vacuous pass: without the window the same weights continue differently.
    full = build_tiny_model(tiny_config("qwen2"))
    prompts = make_prompts(LENGTHS[2:], seed=21)
    assert hf_greedy(full, prompts, MAX_TOKENS) != hf_greedy(sliding_qwen2, prompts, MAX_TOKENS)
