# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real vLLM on the emulated device with a tiny DeepSeek-V3 (MLA) model, float32: one engine for the module.

The MLA layers run through ``AscendMLABackend`` (reference kernels): the latent cache, absorbed decode, and prefill
with prior context loaded in chunks (chunked prefill with ``max_num_batched_tokens=64`` and prefix-cache hits both
give prefills with context). Reference: HF transformers ``DeepseekV3ForCausalLM``, float32, greedy.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, greedy_outputs, make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine

MAX_BATCHED_TOKENS = 64


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(tiny_config("deepseek_v3"))


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("deepseek_v3"))
    with engine(tiny_model, env, max_num_batched_tokens=MAX_BATCHED_TOKENS, enable_prefix_caching=True) as llm:
        yield llm


def test_mla_backend_ran(llm):
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["attention_backends"] == ["vllm_npu.attention.backends.mla.AscendMLABackend"]
    assert info["attention_impls"] == ["vllm_npu.attention.backends.mla.AscendMLAImpl"]
    assert info["kernel_backend"] == "reference"
    assert info["kv_cache_shape"][1:] == (info["block_size"], 32 + 8)  # [blocks, block_size, kv_lora_rank + rope]


def _mla_layers(worker) -> list[tuple[str, bool]]:
    from vllm_npu.attention.ops.mla_base import VllmMLALayer as MultiHeadLatentAttention  # 0.11.1: ...Wrapper

    model = worker.model_runner.get_model()
    return [(type(m).__name__, m.fused_cache_write) for m in model.modules() if isinstance(m, MultiHeadLatentAttention)]


def test_mla_layers_fuse_norm_rope_and_cache_write(llm):
    (layers,) = llm.collective_rpc(_mla_layers)
    assert layers == [("AscendMultiHeadLatentAttention", True)] * 2


def test_batched_prompts_match_hf(llm, tiny_model):
    # 1..150 tokens in one batch: the 150-token prompt is prefilled in chunks of <= 64 tokens, each chunk after the
    # first attends to its cached context while the short requests decode.
    prompts = make_prompts([1, 5, 8, 40, 150], seed=1)
    assert greedy(llm, prompts, 16) == hf_greedy(tiny_model, prompts, 16)


def test_long_prompt_chunked_context_matches_hf(llm, tiny_model):
    (prompt,) = make_prompts([300], seed=7)  # 5 prefill chunks, the last one with 256 cached context tokens
    assert greedy(llm, [prompt], 8) == hf_greedy(tiny_model, [prompt], 8)


def test_prefix_cache_hit_matches_hf(llm, tiny_model):
    (prefix,) = make_prompts([96], seed=11)
    batch = [prefix + s for s in make_prompts([3, 9], seed=12)]
    expected = hf_greedy(tiny_model, batch, 10)

    assert greedy(llm, batch[:1], 10) == expected[:1]
    second = greedy_outputs(llm, batch, 10)
    assert [list(o.outputs[0].token_ids) for o in second] == expected
    assert all(o.num_cached_tokens >= 96 for o in second), [o.num_cached_tokens for o in second]
