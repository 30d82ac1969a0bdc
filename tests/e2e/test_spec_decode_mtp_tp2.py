# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""DeepSeek MTP (2 draft tokens) with tensor_parallel_size=2 on the tiny MoE DeepSeek-V3 (MLA, 2 of its 4 heads per
rank), emulated device: vLLM's multiprocess executor, two spawned workers, each drafting with its shard of the MTP
layer; gloo collectives through NPUCommunicator. Greedy tokens equal HF transformers' float32 greedy tokens."""

from __future__ import annotations

import pytest
from npu_testkit.drafts import build_mtp_model
from npu_testkit.engine import make_prompts, tiny_config
from npu_testkit.models import hf_greedy
from npu_testkit.spec_e2e import greedy_counted, spec_engine

pytestmark = pytest.mark.engine

K = 2
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def target():
    return build_mtp_model(tiny_config("deepseek_v3"))


@pytest.fixture(scope="module")
def llm(target, tmp_path_factory):
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": K}
    with spec_engine(
        target, tmp_path_factory.mktemp("mtp_tp2"), spec, tensor_parallel_size=2, distributed_executor_backend="mp"
    ) as llm:
        yield llm


def test_two_ranks_draft_with_mtp(llm):
    infos = llm.collective_rpc("npu_runtime_info")
    assert sorted(i["rank"] for i in infos) == [0, 1]
    for info in infos:
        assert info["tp_communicator"] == "NPUCommunicator"
        assert info["draft_model"] == "vllm.model_executor.models.deepseek_mtp.DeepSeekMTP"
        assert info["reorder_batch_threshold"] == 1 + K


def test_tp2_mtp_greedy_matches_hf(llm, target):
    prompts = make_prompts([5, 30, 12, 60], seed=1)
    got = greedy_counted(llm, prompts, MAX_TOKENS)
    assert got.tokens == hf_greedy(target, prompts, MAX_TOKENS)
    assert got.drafted > 0 and got.accepted < got.drafted
    infos = llm.collective_rpc("npu_runtime_info")
    assert all(
        i["multi_token_decode_builds"].get("vllm_npu.attention.backends.mla.AscendMLAMetadataBuilder") for i in infos
    )
