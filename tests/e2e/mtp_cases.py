# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The shared cases of the DeepSeek MTP engine tests (one module per MTP configuration binds them to its engine).

A module loads this file with ``npu_testkit.sibling.import_sibling`` and calls :func:`install` with its number of
speculative tokens ``k`` and the MTP layer's MLP (``"moe"``: the tiny DeepSeek-V3 of ``tiny_config``, whose MTP layer
2 is an MoE layer like its layer 1; ``"dense"``: three target layers, layer 2 the only MoE one, so vLLM's rule
``layer >= first_k_dense_replace and layer % moe_layer_freq == 0`` with ``moe_layer_freq=2`` makes the MTP layer 3
dense while HF builds the same target). vLLM 0.11's DeepSeek model needs at least one MoE layer, so a target
without any cannot load. The checkpoint carries the MTP layer (``npu_testkit.drafts.build_mtp_model``, random
weights): its drafts are almost never accepted, so the verification steps reject and the target's tokens come out.

Each engine: ``method="deepseek_mtp"`` (vLLM maps it to ``mtp``), the MLA backend with
``reorder_batch_threshold = 1 + k``: verification steps run through the multi-token decode kernel
(``mla_spec_decode``), counted by the MLA metadata builder. Reference: HF transformers float32 greedy.
"""

from __future__ import annotations

from typing import Any

import pytest
from npu_testkit.drafts import build_mtp_model
from npu_testkit.engine import greedy, make_prompts, tiny_config
from npu_testkit.models import hf_greedy
from npu_testkit.spec_e2e import (
    MAX_BATCHED_TOKENS,
    MAX_TOKENS,
    greedy_counted,
    mixed_prompts,
    seeded_sampling_twice,
    spec_engine,
)

#: config overrides and init std per MTP-layer kind; the three-layer target at std 0.2 has near-tied logits where the
#: engine (with or without speculation) and HF pick different tokens, at std 0.1 they agree
MLP = {
    "moe": ({}, 0.2),
    "dense": ({"num_hidden_layers": 3, "first_k_dense_replace": 2, "moe_layer_freq": 2}, 0.1),
}
MLA_BUILDER = "vllm_npu.attention.backends.mla.AscendMLAMetadataBuilder"


def install(namespace: dict[str, Any], *, k: int, mlp: str) -> None:
    """Define the fixtures (``target``, ``llm``) and tests in a test module's ``namespace`` for ``k`` speculative
    tokens and an MTP layer with an ``mlp`` ("moe" or "dense") MLP."""
    overrides, std = MLP[mlp]

    @pytest.fixture(scope="module", name="target")
    def target():
        return build_mtp_model(tiny_config("deepseek_v3", **overrides), std=std)

    @pytest.fixture(scope="module", name="llm")
    def llm(target, tmp_path_factory):
        spec = {"method": "deepseek_mtp", "num_speculative_tokens": k}
        with spec_engine(target, tmp_path_factory.mktemp(f"mtp{k}"), spec) as llm:
            yield llm

    def test_mtp_proposer_and_mla_decode_threshold(llm):
        (info,) = llm.collective_rpc("npu_runtime_info")
        assert info["drafter"] == "vllm.v1.spec_decode.eagle.EagleProposer"
        assert info["draft_model"] == "vllm.model_executor.models.deepseek_mtp.DeepSeekMTP"
        assert info["attention_backends"] == ["vllm_npu.attention.backends.mla.AscendMLABackend"]
        # NPURejectionSampler, or NPURejectionSamplerWithSampler from vLLM 0.11.1 on
        assert info["rejection_sampler"].startswith("vllm_npu.platform.sample.rejection_sampler.NPURejectionSampler")
        assert info["reorder_batch_threshold"] == 1 + k

    def test_mtp_greedy_matches_hf(llm, target):
        prompts = mixed_prompts()
        got = greedy_counted(llm, prompts)
        assert got.tokens == hf_greedy(target, prompts, MAX_TOKENS)
        assert got.drafted > 0 and got.accepted < got.drafted, (got.drafted, got.accepted)
        (info,) = llm.collective_rpc("npu_runtime_info")
        builds = info["multi_token_decode_builds"].get(MLA_BUILDER, 0)
        # verification steps (1 + k tokens per request) ran as decodes; with k = 1 too (2 tokens)
        assert builds > 0, info["multi_token_decode_builds"]

    def test_mtp_lone_chunked_prompt_matches_hf(llm, target):
        # One prompt longer than a step's token budget: the first steps are partial prefills with no draft tokens
        # anywhere in the batch, the case vLLM 0.11.0 hands the drafter token -1 for (npu-patches'
        # eagle-discarded-next-token); every arrival order of the engine core gives this schedule.
        prompts = make_prompts([2 * MAX_BATCHED_TOKENS + 12], seed=3)
        assert greedy(llm, prompts, 16) == hf_greedy(target, prompts, 16)

    def test_mtp_seeded_sampling_is_reproducible(llm):
        first, second, drafted = seeded_sampling_twice(llm)
        assert drafted > 0
        assert first == second

    namespace.update(
        target=target,
        llm=llm,
        test_mtp_proposer_and_mla_decode_threshold=test_mtp_proposer_and_mla_decode_threshold,
        test_mtp_greedy_matches_hf=test_mtp_greedy_matches_hf,
        test_mtp_lone_chunked_prompt_matches_hf=test_mtp_lone_chunked_prompt_matches_hf,
        test_mtp_seeded_sampling_is_reproducible=test_mtp_seeded_sampling_is_reproducible,
    )
