# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The KV pool with our MLA latent cache (tiny DeepSeek-V3, float32, block size 16), on the emulated device with a
real ``mooncake_master`` and memory-lending ``mooncake_client`` on 127.0.0.1: instance A serves long prompts and
stops; a fresh instance B gets most of each prompt from the pool (both cache planes, the latent and the rope keys,
stored once under the shared ``mla`` key part) and answers == HF greedy. The faults are covered by the GQA module
(``test_kv_pool_engine.py``); they do not depend on the cache layout."""

from __future__ import annotations

import pytest
from npu_testkit.engine import make_prompts, tiny_config
from npu_testkit.kv_pool import fresh_instance_runs
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine

MAX_TOKENS = 6
BLOCK = 16
LENGTHS = [130, 211]


@pytest.fixture(scope="module")
def tiny_mla():
    return build_tiny_model(tiny_config("deepseek_v3"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(LENGTHS, seed=61)


@pytest.fixture(scope="module")
def references(tiny_mla, prompts) -> list[list[int]]:
    return hf_greedy(tiny_mla, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def runs(tiny_mla, prompts, tmp_path_factory) -> dict[str, object]:
    return fresh_instance_runs(tiny_mla, prompts, MAX_TOKENS, tmp_path_factory.mktemp("kvpool-mla"), block_size=BLOCK)


def test_mla_fresh_instance_loads_from_the_pool(runs, references, prompts) -> None:
    assert runs["a"] == references and runs["a_cached"] == [0, 0]
    assert runs["b"] == references
    for prompt, cached in zip(prompts, runs["b_cached"]):
        assert cached == len(prompt) // BLOCK * BLOCK, (len(prompt), cached)
