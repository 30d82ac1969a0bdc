# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real vLLM on the emulated device, tiny Qwen2 (GQA 4/2 heads), float32: one engine for the whole module.

The engine uses block size 16 and ``max_num_batched_tokens=64``, so the 150-token prompt is prefilled in chunks
while shorter requests already decode (mixed batches). Reference: HF transformers, float32, greedy.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, greedy_outputs, make_prompts, token_prompts
from npu_testkit.models import hf_greedy, hf_logprobs
from vllm_npu.interface import compilation_level

pytestmark = pytest.mark.engine

MAX_TOKENS = 24
MAX_BATCHED_TOKENS = 64


@pytest.fixture(scope="module")
def llm(tiny_qwen2, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("qwen2"))
    with engine(tiny_qwen2, env, max_num_batched_tokens=MAX_BATCHED_TOKENS, enable_prefix_caching=True) as llm:
        yield llm


def test_our_classes_ran(llm):
    from vllm.platforms import current_platform

    assert type(current_platform).__name__ == "EmulatedNPUPlatform"
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["platform"] == "vllm_npu.platform.platform.EmulatedNPUPlatform"
    assert info["worker"] == "vllm_npu.platform.worker.NPUWorker"
    assert info["model_runner"] == "vllm_npu.platform.model_runner.NPUModelRunner"
    assert info["attention_backends"] == ["vllm_npu.attention.backends.gqa.AscendAttentionBackend"]
    assert info["device_mode"] == "emulated" and info["kernel_backend"] == "reference"
    assert {"platform", "attention"} <= set(info["components"])
    assert info["block_size"] == 16 and info["kv_cache_shape"][2] == 16


def test_config_hook_applied(llm):
    config = llm.llm_engine.vllm_config
    assert config.parallel_config.worker_cls == "vllm_npu.platform.worker.NPUWorker"
    assert config.compilation_config.custom_ops == ["all"]
    assert compilation_level(config.compilation_config) == 0  # graph_mode auto -> eager on the emulated device
    assert config.model_config.enforce_eager and config.model_config.disable_cascade_attn
    assert config.cache_config.block_size == 16  # vLLM's default kept on the emulated device
    assert config.scheduler_config.chunked_prefill_enabled
    assert config.scheduler_config.max_num_batched_tokens == MAX_BATCHED_TOKENS


def test_batched_prompts_of_very_different_lengths_match_hf(llm, tiny_qwen2, prompts):
    # 1..150 tokens in one batch; the 150-token prompt needs 3 chunks of <=64 tokens (chunked prefill).
    assert greedy(llm, prompts, MAX_TOKENS) == hf_greedy(tiny_qwen2, prompts, MAX_TOKENS)


def test_long_prompt_alone_chunked_prefill_matches_hf(llm, tiny_qwen2):
    (prompt,) = make_prompts([300], seed=7)  # 5 chunks of 64 tokens
    assert greedy(llm, [prompt], 8) == hf_greedy(tiny_qwen2, [prompt], 8)


def test_prefix_caching_hits_and_matches_hf(llm, tiny_qwen2):
    (prefix,) = make_prompts([96], seed=11)  # 6 full blocks of 16
    suffixes = make_prompts([3, 9], seed=12)
    batch = [prefix + s for s in suffixes]
    expected = hf_greedy(tiny_qwen2, batch, 12)

    assert greedy(llm, batch[:1], 12) == expected[:1]
    second = greedy_outputs(llm, batch, 12)
    assert [list(o.outputs[0].token_ids) for o in second] == expected
    # The second round reuses the cached 96-token prefix (whole blocks only).
    assert all(o.num_cached_tokens >= 96 for o in second), [o.num_cached_tokens for o in second]


def test_logprobs_match_hf_log_softmax(llm, tiny_qwen2):
    from vllm import SamplingParams

    prompt = make_prompts([20], seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    (out,) = llm.generate(token_prompts([prompt]), params, use_tqdm=False)
    generated = list(out.outputs[0].token_ids)
    ref = hf_logprobs(tiny_qwen2, prompt + generated)  # [len, vocab]; row i predicts token i+1

    worst = 0.0
    for step, (token, top) in enumerate(zip(generated, out.outputs[0].logprobs, strict=True)):
        row = ref[len(prompt) - 1 + step]
        assert token == int(row.argmax())
        for tok_id, lp in top.items():
            worst = max(worst, abs(lp.logprob - float(row[tok_id])))
        # The returned top-5 are HF's top-5.
        assert set(top) >= set(row.topk(5).indices.tolist())
    for pos, top in enumerate(out.prompt_logprobs):
        if top is None:  # the first prompt token has no logprob
            assert pos == 0
            continue
        row = ref[pos - 1]
        for tok_id, lp in top.items():
            worst = max(worst, abs(lp.logprob - float(row[tok_id])))
    assert worst < 1e-4, worst


def test_seeded_sampling_is_reproducible(llm):
    from vllm import SamplingParams

    batch = make_prompts([6, 30], seed=5)

    def run(seed):
        params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=seed, max_tokens=16, ignore_eos=True, n=2)
        return [
            [list(c.token_ids) for c in o.outputs] for o in llm.generate(token_prompts(batch), params, use_tqdm=False)
        ]

    a, b, c = run(1234), run(1234), run(99)
    assert a == b
    assert a != c
    # n=2 samples of one request differ from each other (the generator advances per sample).
    assert all(pair[0] != pair[1] for pair in a)


def _use_sampler(worker, kind):
    """Swap the runner's top-k/top-p sampler: "npu" ours (spying on its kernel choice), "native" vLLM's own."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm_npu.platform.sample import NPUTopKTopPSampler

    sampler = worker.model_runner.sampler
    if kind == "native":
        sampler.topk_topp_sampler = TopKTopPSampler(sampler.logprobs_mode)
        return None
    ours = NPUTopKTopPSampler(sampler.logprobs_mode)
    seen = []
    choose = ours.uses_npu_kernel

    def spy(logits, k):
        seen.append((ours._host_k_max, None if k is None else int(k.max()), tuple(logits.shape)))
        return choose(logits, k)

    ours.uses_npu_kernel = spy
    ours.seen = seen
    sampler.topk_topp_sampler = ours
    return type(ours).__name__


def _seen(worker):
    return worker.model_runner.sampler.topk_topp_sampler.seen


def test_top_k_top_p_sampler_host_k_and_native_equality(llm):
    """Our top-k/top-p sampler runs in the engine; the runner gives it each step's largest top-k from the host (equal
    to the device k's max), a request without top-k makes it the vocabulary size; seeded results equal vLLM's native
    sampler's."""
    from vllm import SamplingParams

    batch = token_prompts(make_prompts([6, 30, 12], seed=21))
    params = [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, seed=8, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.8, seed=9, max_tokens=10, ignore_eos=True),
    ]

    def run(prompts, sampling):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sampling, use_tqdm=False)]

    assert llm.collective_rpc(_use_sampler, args=("npu",)) == ["NPUTopKTopPSampler"]
    try:
        ours = run(batch, params)
        (seen,) = llm.collective_rpc(_seen)
        vocab = seen[0][2][1]  # logits [num_reqs, vocab]
        # every sampler step knew its k range on the host, and it was the device k's
        assert seen and all(host == dev for host, dev, _ in seen), seen
        assert {host for host, _, _ in seen} <= {40, 5, vocab} and vocab in {host for host, _, _ in seen}
        top_k_only = run(batch[:2], params[:2])
        (seen,) = llm.collective_rpc(_seen)
        assert {host for host, _, _ in seen[-5:]} == {40}
        llm.collective_rpc(_use_sampler, args=("native",))
        assert run(batch, params) == ours
        assert run(batch[:2], params[:2]) == top_k_only
    finally:
        llm.collective_rpc(_use_sampler, args=("npu",))


def test_pooling_requests_to_a_generative_model_are_clear_errors(llm, tiny_qwen2):
    # vLLM's own errors name the cause and the fix; the engine serves the next request as before.
    with pytest.raises(ValueError, match="Embedding API is not supported by this model.*--convert embed"):
        llm.embed(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match=r"LLM.score\(\) is only supported for pooling models.*--runner pooling"):
        llm.score("hello", ["world"], use_tqdm=False)
    (prompt,) = make_prompts([9], seed=3)
    assert greedy(llm, [prompt], 8) == hf_greedy(tiny_qwen2, [prompt], 8)
