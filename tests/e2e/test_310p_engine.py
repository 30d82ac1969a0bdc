# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""End to end on the emulated Ascend 310P (``VLLM_NPU_EMULATED_SOC=310P``): a tiny Qwen2 in float16 through the whole
stack with the 310P paths (NZ KV cache, NZ masks, 16-aligned first prefills, eager only), greedy tokens equal to HF
transformers in float16, with chunked prefill (a 32-token step budget), prefix-cache hits and batches of mixed
lengths; a tiny Llama the same way (a second, short-lived engine); and the 310P refusals as a user meets them
(``LLM(...)`` raising at config time).
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import (
    emulated_env,
    engine,
    greedy,
    greedy_outputs,
    make_llm,
    make_prompts,
    patched_environ,
    tiny_config,
)
from npu_testkit.models import build_tiny_model, hf_greedy
from vllm_npu.interface import reset_chip

pytestmark = pytest.mark.engine

SOC = {"VLLM_NPU_EMULATED_SOC": "310P"}


@pytest.fixture(scope="module")
def model_dir():
    return build_tiny_model(tiny_config("qwen2"), dtype="float16")


@pytest.fixture(scope="module")
def llm(model_dir, tmp_path_factory):
    # The chip is read once per process (reset_chip): this module's engine core runs in this process.
    with patched_environ(SOC):
        reset_chip()
        env = emulated_env(tmp_path_factory.mktemp("p310"), extra=SOC)
        try:
            with engine(model_dir, env, dtype="float16", max_num_batched_tokens=32, enable_prefix_caching=True) as llm:
                yield llm
        finally:
            reset_chip()
    reset_chip()


def test_the_engine_takes_the_310p_paths(llm):
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["chip"] == "310P" and info["kernel_backend"] == "reference"
    cfg = tiny_config("qwen2")
    hidden = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    shape = info["kv_cache_shape"]
    assert shape[0] == 2 and tuple(shape[2:]) == (hidden // 16, info["block_size"], 16)  # NZ tiles of 16
    assert info["cudagraph_mode"] == "NONE"  # eager only on 310P

    def kernels(model):
        impl = model.model.layers[0].self_attn.attn.impl
        k = impl.kernels_310p
        return [f.__name__ for f in (k.reshape_and_cache, k.prefill, k.paged_decode, k.paged_splitfuse)]

    (names,) = llm.apply_model(kernels)
    assert names == [
        "reshape_and_cache_nz_reference",
        "prefill_310p_reference",
        "paged_decode_310p_reference",
        "paged_splitfuse_310p_reference",
    ]


def test_float16_greedy_matches_hf_with_chunks_prefix_hits_and_mixed_lengths(llm, model_dir):
    prompts = make_prompts([1, 7, 40, 75], seed=5)  # 40 and 75 tokens: chunked by the 32-token step budget
    first = greedy(llm, prompts, 12)
    assert first == hf_greedy(model_dir, prompts, 12, dtype="float16")
    # The same long prompts again plus a new suffix: their first blocks come from the prefix cache.
    again = [prompts[3] + [5, 9, 11], prompts[2][:33], prompts[0]]
    assert greedy(llm, again, 8) == hf_greedy(model_dir, again, 8, dtype="float16")
    # The prefix cache served the repeated prompts (vLLM counts each request's cached prompt tokens).
    outs = greedy_outputs(llm, again, 1)
    assert [o.num_cached_tokens >= 16 for o in outs] == [True, True, False], [o.num_cached_tokens for o in outs]


def test_llama_float16_greedy_matches_hf_with_chunks_and_prefix_hits(tmp_path_factory):
    # Llama's layers on the 310P paths (no q/k/v bias, its own model class): a second engine, its core in a spawned
    # process so that it does not share this process's distributed state with the module's Qwen2 engine.
    llama = build_tiny_model(tiny_config("llama"), dtype="float16")
    prompts = make_prompts([3, 21, 50], seed=7)  # 50 tokens: chunked by the 32-token step budget
    with patched_environ(SOC):
        reset_chip()
        env = emulated_env(tmp_path_factory.mktemp("p310_llama"), multiprocessing=True, extra=SOC)
        try:
            with engine(llama, env, dtype="float16", max_num_batched_tokens=32, enable_prefix_caching=True) as llm:
                (info,) = llm.collective_rpc("npu_runtime_info")
                assert info["chip"] == "310P" and tuple(info["kv_cache_shape"][2:]) == (2, info["block_size"], 16)
                assert greedy(llm, prompts, 10) == hf_greedy(llama, prompts, 10, dtype="float16")
                again = [prompts[2] + [7, 8], prompts[1]]  # a cached 48-token prefix, and a repeat
                outs = greedy_outputs(llm, again, 6)
                assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(llama, again, 6, dtype="float16")
                assert outs[0].num_cached_tokens >= 32
        finally:
            reset_chip()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "bfloat16"}, r"serves models in float16 only, not torch.bfloat16 .*pass --dtype float16"),
        (
            {"dtype": "float16", "additional_config": {"npu": {"graph_mode": "piecewise"}}},
            r"npu.graph_mode='piecewise' is not supported on the Atlas 300I \(Ascend 310P\)",
        ),
        (
            {"dtype": "float16", "additional_config": {"npu": {"moe_mc2": "on"}}},
            r"npu.moe_mc2='on' is not supported on the Atlas 300I",
        ),
        ({"dtype": "float16", "kv_cache_dtype": "fp8"}, r"kv_cache_dtype='fp8' is not supported on the Atlas 300I"),
    ],
    ids=["bf16", "piecewise", "mc2", "kv_fp8"],
)
def test_310p_refusals_at_config_time(llm, model_dir, kwargs, message):
    # The module's engine is up: a second LLM in this process fails in the platform's config hook, before any
    # worker exists (vLLM's EngineArgs build the VllmConfig, whose __post_init__ calls it).
    # vLLM's pydantic VllmConfig wraps the ConfigError; the message is ours.
    with patched_environ(SOC), pytest.raises(Exception, match=message):
        make_llm(model_dir, **kwargs)
