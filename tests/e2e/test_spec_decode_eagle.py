# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""EAGLE speculative decoding (3 draft tokens) end to end on the emulated device, GQA target (tiny Llama).

vLLM's own ``EagleProposer`` drafts with an EAGLE-1 head (``npu_testkit.drafts``) trained for a few hundred steps on
the target's greedy outputs (of the checked prompts among others), so drafts are often, but not always, accepted. The draft layer's
attention runs through the Ascend GQA backend (its metadata from ``build_for_drafting``), the verification steps
(up to 4 query tokens per request) through its SpecDecoding state, the verification through our
``NPURejectionSampler``. Greedy tokens equal HF transformers' float32 greedy tokens (which the engine without
speculation reproduces, tests/e2e/test_llama_block128_async.py); vLLM's spec-decode counters report the drafts.
"""

from __future__ import annotations

import pytest
from npu_testkit.drafts import train_eagle_head
from npu_testkit.engine import make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy
from npu_testkit.spec_e2e import MAX_TOKENS, greedy_counted, mixed_prompts, seeded_sampling_twice, spec_engine

pytestmark = pytest.mark.engine

K = 3


@pytest.fixture(scope="module")
def target():
    # Init std 0.1: greedy continuations fall into long cycles, which a small head can learn from other prompts.
    return build_tiny_model(tiny_config("llama", num_hidden_layers=8), std=0.1)


@pytest.fixture(scope="module")
def head(target):
    # Trained on the target's greedy continuations of the checked prompts and of others.
    prompts = mixed_prompts() + make_prompts([4, 9, 17, 25, 33, 48, 70, 90], seed=40)
    return train_eagle_head(target, prompts, 64, steps=300)


@pytest.fixture(scope="module")
def llm(target, head, tmp_path_factory):
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": K}
    with spec_engine(target, tmp_path_factory.mktemp("eagle"), spec) as llm:
        yield llm


def test_eagle_proposer_and_decode_threshold(llm):
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["drafter"] == "vllm.v1.spec_decode.eagle.EagleProposer"
    assert info["draft_model"] == "vllm.model_executor.models.llama_eagle.EagleLlamaForCausalLM"
    # NPURejectionSampler, or NPURejectionSamplerWithSampler from vLLM 0.11.1 on
    assert info["rejection_sampler"].startswith("vllm_npu.platform.sample.rejection_sampler.NPURejectionSampler")
    assert info["attention_backends"] == ["vllm_npu.attention.backends.gqa.AscendAttentionBackend"]
    assert info["reorder_batch_threshold"] == 1 + K


def test_eagle_greedy_matches_hf_and_drafts_are_accepted(llm, target):
    prompts = mixed_prompts()
    got = greedy_counted(llm, prompts)
    assert got.tokens == hf_greedy(target, prompts, MAX_TOKENS)
    # The trained head: a clear share of its drafts accepted, not all (a random head gets ~0).
    assert 0.2 * got.drafted < got.accepted < got.drafted, (got.drafted, got.accepted)


def test_eagle_seeded_sampling_is_reproducible(llm):
    first, second, drafted = seeded_sampling_twice(llm)
    assert drafted > 0
    assert first == second
    assert all(len(t) == 40 and all(0 <= x < 512 for x in t) for t in first)
