# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Qwen3-Next (npu-models' ``NPUQwen3NextForCausalLM``: gated delta-net layers on our GDN kernel pairs, gated full
attention with partial rotary, MoE with a shared expert) in a real vLLM engine on the emulated device, with vLLM's
hybrid KV-cache manager (attention pages and recurrent-state pages in one pool), TP=1, float32.

One engine: ``cudagraph_mode=FULL_DECODE_ONLY`` (capture sizes 1/2/4/8; the decode steps replay captured graphs whose
GDN state slots are graph inputs, prefill and mixed steps run eagerly), a 64-token step budget (the 150-token prompt
is prefilled in three chunks whose conv and recurrent state cross the chunk boundaries, while the short prompts
already decode) and only 48 KV blocks, so a wave of long prompts preempts and resumes. Reference: HF transformers'
``Qwen3NextForCausalLM`` (its torch GDN functions, eager attention), greedy.
"""

from __future__ import annotations

import sys
from typing import Any

import cloudpickle
import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts
from npu_testkit.graph_e2e import CAPTURE_SIZES, MAX_BATCH, MIXED_LENGTHS, NEW_TOKENS, replays
from npu_testkit.models import build_tiny_model, hf_greedy
from npu_testkit.models_hybrid import tiny_qwen3_next_config

pytestmark = pytest.mark.engine

cloudpickle.register_pickle_by_value(sys.modules[__name__])

BLOCKS = 48


@pytest.fixture(scope="module")
def model_dir():
    return build_tiny_model(tiny_qwen3_next_config())


@pytest.fixture(scope="module")
def llm(model_dir, tmp_path_factory):
    kwargs = {
        "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": CAPTURE_SIZES},
        "block_size": 16,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
        "num_gpu_blocks_override": BLOCKS,
    }
    with engine(model_dir, emulated_env(tmp_path_factory.mktemp("qwen3next")), **kwargs) as llm:
        yield llm


def _reference(model_dir: Any, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(model_dir, prompts, NEW_TOKENS, attn_implementation="eager")


def _built(worker: Any) -> dict[str, Any]:
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    runner = worker.model_runner
    model = runner.get_model()
    gdn = [m for m in model.modules() if type(m).__name__ == "NPUQwen3NextGatedDeltaNet"]
    attn = [m for m in model.modules() if type(m).__name__ == "Attention"]
    caches = runner.compilation_config.static_forward_context
    return {
        "model": type(model).__qualname__,
        "gdn": len(gdn),
        "kernels": sorted({f.__name__ for m in gdn for f in (m._conv_update, m._recurrent, m._chunk, m._norm)}),
        "attn_impl": sorted({type(m.impl).__name__ for m in attn}),
        "moe": sorted({type(m).__name__ for m in model.modules() if isinstance(m, FusedMoE)}),
        "attn_cache_contiguous": [caches[m.layer_name].kv_cache[0].is_contiguous() for m in attn],
        "state_shapes": [tuple(t.shape[1:]) for t in caches[gdn[0].prefix].kv_cache[0]],
        "groups": len(runner.kv_cache_config.kv_cache_groups),
    }


def test_the_model_runs_on_our_stack_with_the_hybrid_kv_cache(llm):
    (info,) = llm.collective_rpc(_built)
    assert info["model"] == "NPUQwen3NextForCausalLM" and info["gdn"] == 3
    assert info["kernels"] == [
        "causal_conv1d_update_ref",
        "chunk_gated_delta_rule_ref",
        "fused_recurrent_gated_delta_rule_ref",
        "rms_norm_gated_ref",
    ]
    assert info["attn_impl"] == ["AscendAttentionImpl"] and info["moe"] == ["AscendFusedMoE"]
    # one attention group + three state groups; the attention layer owns a contiguous cache (NPU cache kernels)
    assert info["groups"] == 4 and info["attn_cache_contiguous"] == [True]
    # conv state [W - 1, 2 * key_dim + value_dim], recurrent state [HV, K, V]
    assert info["state_shapes"] == [(3, 2 * 32 + 64), (4, 16, 16)]


def test_prompts_of_every_length_chunked_and_mixed_match_hf(llm, model_dir):
    prompts = make_prompts(MIXED_LENGTHS, seed=12)
    assert greedy(llm, prompts, NEW_TOKENS) == _reference(model_dir, prompts)


def test_every_batch_size_replays_the_decode_graph_and_matches_hf(llm, model_dir):
    """Batches of 1..9: padded to a capture size (padded rows address the null state slot) and, past 8, eager."""
    pool = make_prompts([3 + (7 * i) % 13 for i in range(MAX_BATCH)], seed=21)
    ref = _reference(model_dir, pool)
    before = replays(llm, "FULL")
    for n in range(1, MAX_BATCH + 1):
        assert greedy(llm, pool[:n], NEW_TOKENS) == ref[:n], f"batch of {n}"
    assert replays(llm, "FULL") > before


def test_preempted_requests_resume_and_finished_requests_free_their_slots(llm, model_dir, monkeypatch):
    """Six 100-token prompts need 6 x (7 attention + 3 state) blocks, more than the 47 usable: the scheduler
    preempts (frees a running request's pages and state slots, recomputes it later from a fresh state)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    manager = scheduler.kv_cache_manager
    frees: list[str] = []
    original = manager.free

    def counting_free(request: Any) -> None:
        frees.append(request.request_id)
        original(request)

    monkeypatch.setattr(manager, "free", counting_free)
    prompts = make_prompts([100] * 6, seed=5)
    assert greedy(llm, prompts, NEW_TOKENS) == _reference(model_dir, prompts)
    assert len(frees) > len(prompts), "no request was preempted"
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block are back
