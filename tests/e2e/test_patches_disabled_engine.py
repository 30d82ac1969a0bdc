"""Disabling patches reaches the worker: ``VLLM_NPU_PATCHES=-repetition-penalty-torch`` and
``--additional-config '{"npu": {"disabled_patches": ["attention-output-empty"]}}'`` on a real engine.

The engine core runs in its own (spawned) process, so the patches layer's worker hook runs there fresh with these
settings, whatever earlier engines did in this pytest process. One engine for the module.
"""

from __future__ import annotations

from typing import Any

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llm(tiny_qwen2, tmp_path_factory):
    env = emulated_env(
        tmp_path_factory.mktemp("patches_off"),
        multiprocessing=True,
        # collective_rpc with a function crosses the process boundary only with pickle-based serialization
        extra={"VLLM_NPU_PATCHES": "-repetition-penalty-torch", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
    )
    with engine(tiny_qwen2, env, additional_config={"npu": {"disabled_patches": ["attention-output-empty"]}}) as llm:
        yield llm


def _worker_view(worker: Any) -> dict[str, Any]:
    import os

    import vllm._custom_ops as ops
    from vllm.attention.layer import Attention
    from vllm_npu.patches import patch_status

    return {
        "pid": os.getpid(),
        "status": {k: (s.value, r) for k, (s, r) in patch_status().items()},
        "penalty_patched": hasattr(ops.apply_repetition_penalties, "__vllm_npu_patch__"),
        "forward_patched": hasattr(Attention.forward, "__vllm_npu_patch__"),
    }


def test_both_ways_of_disabling_reach_the_worker(llm):
    import os

    (view,) = llm.collective_rpc(_worker_view)
    assert view["pid"] != os.getpid()  # a fresh worker process, not this one
    assert view["status"]["repetition-penalty-torch"] == (
        "disabled", "disabled by VLLM_NPU_PATCHES=-repetition-penalty-torch")
    assert view["status"]["attention-output-empty"] == (
        "disabled", "disabled by --additional-config npu.disabled_patches")
    assert not view["penalty_patched"] and not view["forward_patched"]


def test_engine_runs_with_patches_disabled(llm, tiny_qwen2):
    from npu_testkit.models import hf_greedy

    prompts = make_prompts([6, 17], seed=3)
    assert greedy(llm, prompts, 8) == hf_greedy(tiny_qwen2, prompts, 8)
