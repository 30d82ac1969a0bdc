# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The KV pool with tensor parallelism 2 (two spawned workers per instance, tiny Qwen2 GQA: one KV head per rank),
on the emulated device with a real ``mooncake_master`` and memory-lending ``mooncake_client`` on 127.0.0.1. Instance
A stores each block once per rank (key parts ``tp0``, ``tp1``); a fresh instance B finds a block only when both ranks'
parts are there, each rank loads its own, and B answers == HF greedy with most of each prompt from the pool."""

from __future__ import annotations

import pytest
from npu_testkit.engine import make_prompts
from npu_testkit.kv_pool import fresh_instance_runs
from npu_testkit.models import hf_greedy

pytestmark = pytest.mark.engine

MAX_TOKENS = 6
BLOCK = 16
LENGTHS = [150, 222]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(LENGTHS, seed=62)


@pytest.fixture(scope="module")
def references(tiny_qwen2, prompts) -> list[list[int]]:
    return hf_greedy(tiny_qwen2, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def runs(tiny_qwen2, prompts, tmp_path_factory) -> dict[str, object]:
    return fresh_instance_runs(
        tiny_qwen2,
        prompts,
        MAX_TOKENS,
        tmp_path_factory.mktemp("kvpool-tp2"),
        env_extra={"VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
        block_size=BLOCK,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )


def test_tp2_fresh_instance_loads_both_ranks_parts_from_the_pool(runs, references, prompts) -> None:
    assert runs["a"] == references and runs["a_cached"] == [0, 0]
    assert runs["b"] == references
    for prompt, cached in zip(prompts, runs["b_cached"]):
        assert cached == len(prompt) // BLOCK * BLOCK, (len(prompt), cached)
