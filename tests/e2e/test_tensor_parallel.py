# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""tensor_parallel_size=2 on the emulated device: vLLM's multiprocess executor, two spawned workers, gloo
collectives through NPUCommunicator. Greedy output must equal TP=1, which the other modules prove equal to HF;
here it is compared with HF directly (float32)."""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy
from npu_testkit.models import hf_greedy

pytestmark = pytest.mark.engine

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def llm(tiny_qwen2, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("tp2"), extra={"VLLM_WORKER_MULTIPROC_METHOD": "spawn"})
    with engine(
        tiny_qwen2, env, tensor_parallel_size=2, distributed_executor_backend="mp", max_num_batched_tokens=64
    ) as llm:
        yield llm


def test_two_ranks_ran_our_stack(llm):
    infos = llm.collective_rpc("npu_runtime_info")
    assert sorted(i["rank"] for i in infos) == [0, 1]
    for info in infos:
        assert info["worker"] == "vllm_npu.platform.worker.NPUWorker"
        assert info["tp_communicator"] == "NPUCommunicator"
        assert info["tp_backend"] == "gloo"
        assert info["kv_cache_shape"][3] == 1  # 2 KV heads split over 2 ranks


def test_tp2_greedy_matches_hf(llm, tiny_qwen2, prompts):
    assert greedy(llm, prompts, MAX_TOKENS) == hf_greedy(tiny_qwen2, prompts, MAX_TOKENS)
