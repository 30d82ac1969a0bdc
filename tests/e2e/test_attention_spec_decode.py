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

import re
import sys

import cloudpickle
import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, tiny_config, token_prompts
from npu_testkit.models import build_tiny_model, hf_greedy
from npu_testkit.structured import ENGINE_KWARGS, Case, check_structured, structured_prompts

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
    # Insecure serialization: the structured-output test sends the engine core a function (the mask swap).
    extra = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    env = emulated_env(tmp_path_factory.mktemp("specdec"), multiprocessing=True, extra=extra)
    spec = {"method": "ngram", "num_speculative_tokens": NUM_SPEC, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    kwargs = {"max_num_batched_tokens": 64, "disable_log_stats": False, **ENGINE_KWARGS}
    with engine(tiny_qwen2, env, speculative_config=spec, **kwargs) as llm:
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


# collective_rpc pickles _use_mask for the engine core process, which cannot import this test module by name
# (a clean checkout's engine core has no `tests` package on its path: the first call killed its input thread).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


#: A constraint whose output repeats itself: the ngram proposer drafts the repeats, so verification steps carry
#: 1 + 3 bitmask rows per request and the rejection sampler sees grammar-masked target logits.
REPEATS = Case("regex_repeats", {"regex": "(abc-){6}[0-9]{2}"}, lambda text: re.fullmatch("(abc-){6}[0-9]{2}", text))


def _use_mask(worker, side: str) -> None:
    from vllm_npu.platform.sample import GRAMMAR_BITMASK

    worker.model_runner.grammar_mask = GRAMMAR_BITMASK.npu if side == "npu" else GRAMMAR_BITMASK.select()


def test_structured_output_with_drafts_equals_the_constrained_greedy_reference(llm, tiny_qwen2):
    """Every constraint kind with ngram drafts: valid, and the tokens of greedy decoding without speculation (HF
    float32 + xgrammar); the repeating regex gets drafts accepted under its grammar. Then the same with the runner
    masking through the NPU's side of GRAMMAR_BITMASK (on the device; here the CPU): the same tokens."""
    drafted_before = _counter(llm, "vllm:spec_decode_num_draft_tokens")
    accepted_before = _counter(llm, "vllm:spec_decode_num_accepted_tokens")
    first = check_structured(llm, tiny_qwen2, structured_prompts())
    first += check_structured(llm, tiny_qwen2, make_prompts([6, 4], seed=32), [REPEATS])
    accepted = _counter(llm, "vllm:spec_decode_num_accepted_tokens") - accepted_before
    assert 0 < accepted < _counter(llm, "vllm:spec_decode_num_draft_tokens") - drafted_before
    llm.collective_rpc(_use_mask, args=("npu",))
    try:
        second = check_structured(llm, tiny_qwen2, structured_prompts())
        second += check_structured(llm, tiny_qwen2, make_prompts([6, 4], seed=32), [REPEATS])
    finally:
        llm.collective_rpc(_use_mask, args=("selected",))
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]
