# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""EAGLE-3 speculative decoding (2 draft tokens) end to end on the emulated device, GQA target (tiny Llama).

The head (``npu_testkit.drafts.build_eagle_head(method="eagle3")``) has vLLM's EAGLE-3 layout: ``fc`` over three of
the target's hidden states (the target returns them as auxiliary outputs: layers 2, 4 and 5 of 8), a ``midlayer``
whose attention reads ``2H``, its own LM head over a draft vocabulary of half the target's with ``d2t`` offsets to
the target ids. A random head: its drafts are almost never accepted, so every verification step rejects and the
target's own tokens come out; greedy tokens equal HF transformers' float32 greedy tokens.
"""

from __future__ import annotations

import pytest
from npu_testkit.drafts import build_eagle_head
from npu_testkit.engine import tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy
from npu_testkit.spec_e2e import MAX_TOKENS, greedy_counted, mixed_prompts, seeded_sampling_twice, spec_engine

pytestmark = pytest.mark.engine

K = 2


@pytest.fixture(scope="module")
def target():
    return build_tiny_model(tiny_config("llama", num_hidden_layers=8), std=0.1)


@pytest.fixture(scope="module")
def llm(target, tmp_path_factory):
    head = build_eagle_head(target, method="eagle3")
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    with spec_engine(target, tmp_path_factory.mktemp("eagle3"), spec) as llm:
        yield llm


def test_eagle3_proposer_and_aux_hidden_states(llm):
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["drafter"] == "vllm.v1.spec_decode.eagle.EagleProposer"
    assert info["draft_model"] == "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM"
    # NPURejectionSampler, or NPURejectionSamplerWithSampler from vLLM 0.11.1 on
    assert info["rejection_sampler"].startswith("vllm_npu.platform.sample.rejection_sampler.NPURejectionSampler")
    assert info["reorder_batch_threshold"] == 1 + K


def test_eagle3_greedy_matches_hf(llm, target):
    prompts = mixed_prompts()
    got = greedy_counted(llm, prompts)
    assert got.tokens == hf_greedy(target, prompts, MAX_TOKENS)
    assert got.drafted > 0 and got.accepted < got.drafted, (got.drafted, got.accepted)


def test_eagle3_seeded_sampling_is_reproducible(llm):
    first, second, drafted = seeded_sampling_twice(llm)
    assert drafted > 0
    assert first == second
