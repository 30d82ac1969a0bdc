# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Speculative decoding (ngram proposer, 3 speculative tokens) end to end on the emulated device: the normal
NPUWorker, whose NPUModelRunner builds npu-platform's ``NPURejectionSampler`` in place of vLLM's Triton sampler.
Greedy tokens equal HF transformers' greedy tokens, i.e. the same as decoding without speculation; seeded random
requests (random acceptance, recovered-token sampling) give the same tokens twice.

The verification steps carry 1..4 query tokens per request; the attention metadata builder's decode threshold is
``1 + num_speculative_tokens = 4`` so vLLM reorders such requests to the front and the backend computes them in the
SpecDecoding / ChunkedPrefill states.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, tiny_config, token_prompts
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine

NUM_SPEC = 3
MAX_TOKENS = 100


@pytest.fixture(scope="module")
def tiny_qwen2():
    # Init std 0.1: greedy continuations of this tiny model fall into cycles after a few dozen tokens (about 45
    # distinct tokens in 100), so the ngram proposer finds matches while the text is far from degenerate.
    return build_tiny_model(tiny_config("qwen2"), std=0.1)


@pytest.fixture(scope="module")
def llm(tiny_qwen2, tmp_path_factory):
    # A separate engine-core process: vLLM 0.11 hands the drafted tokens to the scheduler in EngineCore.post_step,
    # which only the engine-core busy loop calls (the in-process client never does, so nothing would be drafted).
    env = emulated_env(tmp_path_factory.mktemp("specdec"), multiprocessing=True)
    spec = {"method": "ngram", "num_speculative_tokens": NUM_SPEC, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    with engine(tiny_qwen2, env, speculative_config=spec, max_num_batched_tokens=64, disable_log_stats=False) as llm:
        yield llm


def _counter(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def test_worker_sampler_and_decode_threshold(llm):
    # A worker method by name: the multiprocess client serialises functions only with insecure pickling.
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["worker"] == "vllm_npu.platform.worker.NPUWorker"
    # NPURejectionSampler, or NPURejectionSamplerWithSampler from vLLM 0.11.1 on
    assert info["rejection_sampler"].startswith("vllm_npu.platform.sample.rejection_sampler.NPURejectionSampler")
    assert info["reorder_batch_threshold"] == 1 + NUM_SPEC


def test_ngram_speculative_greedy_matches_hf(llm, tiny_qwen2):
    prompts = make_prompts([5, 30, 12, 60], seed=1)
    drafted_before = _counter(llm, "vllm:spec_decode_num_draft_tokens")
    accepted_before = _counter(llm, "vllm:spec_decode_num_accepted_tokens")
    got = greedy(llm, prompts, MAX_TOKENS)
    drafted = _counter(llm, "vllm:spec_decode_num_draft_tokens") - drafted_before
    accepted = _counter(llm, "vllm:spec_decode_num_accepted_tokens") - accepted_before
    assert got == hf_greedy(tiny_qwen2, prompts, MAX_TOKENS)
    # Speculation really ran: tokens were drafted, some accepted (multi-token verification steps) and some rejected.
    assert 0 < accepted < drafted, (drafted, accepted)


def test_ngram_speculative_seeded_sampling_is_reproducible(llm):
    """Random requests in a batch mixed with a greedy one: they run through random acceptance and recovered-token
    sampling; seeded requests give the same tokens twice."""
    from vllm import SamplingParams

    prompts = token_prompts(make_prompts([5, 30, 12], seed=2))
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.3, seed=11, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, seed=12, max_tokens=40, ignore_eos=True),
    ]
    drafted_before = _counter(llm, "vllm:spec_decode_num_draft_tokens")
    first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    second = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert _counter(llm, "vllm:spec_decode_num_draft_tokens") > drafted_before
    assert first == second
    assert all(len(t) == 40 and all(0 <= x < 512 for x in t) for t in first)
