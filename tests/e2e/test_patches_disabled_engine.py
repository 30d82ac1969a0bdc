# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Disabling patches reaches the worker: ``VLLM_NPU_PATCHES=-repetition-penalty-torch`` and
``--additional-config '{"npu": {"disabled_patches": ["attention-output-empty"]}}'`` on a real engine.

The engine core runs in its own (spawned) process, so the patches layer's worker hook runs there fresh with these
settings, whatever earlier engines did in this pytest process. One engine for the module.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]  # a dead engine process must not hang the run


@pytest.fixture(scope="module")
def llm(tiny_qwen2, tmp_path_factory):
    env = emulated_env(
        tmp_path_factory.mktemp("patches_off"),
        multiprocessing=True,
        # collective_rpc with a function (patch_report) crosses the process boundary only with pickle serialization
        extra={"VLLM_NPU_PATCHES": "-repetition-penalty-torch", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
    )
    with engine(tiny_qwen2, env, additional_config={"npu": {"disabled_patches": ["attention-output-empty"]}}) as llm:
        yield llm


def test_both_ways_of_disabling_reach_the_worker(llm):
    from vllm_npu.patches import patch_report

    (report,) = llm.collective_rpc(patch_report)  # runs in the engine-core process (a fresh worker)
    penalty, attention = report["repetition-penalty-torch"], report["attention-output-empty"]
    assert (penalty["status"], penalty["reason"]) == (
        "disabled",
        "disabled by VLLM_NPU_PATCHES=-repetition-penalty-torch",
    )
    assert (attention["status"], attention["reason"]) == (
        "disabled",
        "disabled by --additional-config npu.disabled_patches",
    )
    assert not penalty["installed"] and not attention["installed"]


def test_engine_runs_with_patches_disabled(llm, tiny_qwen2):
    from npu_testkit.models import hf_greedy

    prompts = make_prompts([6, 17], seed=3)
    assert greedy(llm, prompts, 8) == hf_greedy(tiny_qwen2, prompts, 8)
