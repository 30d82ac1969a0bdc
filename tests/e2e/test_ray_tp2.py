# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``distributed_executor_backend="ray"`` with TP=2 on the emulated device (one engine): tiny Qwen2, float32.

A local Ray cluster for the module declares Ray's ``NPU`` resource (2 of them) on this CPU host, as an Ascend host
reports it: the emulated platform uses the same Ray device key as the NPU (``NPU``), so vLLM's Ray executor places
one worker actor per ``NPU`` bundle, reads each actor's device id from Ray and sets the platform's device variable
(``NPU_EMULATED_VISIBLE_DEVICES``) per actor. The cluster is started with the emulated environment
(``VLLM_NPU_DEVICE=emulated``): an actor resolves its platform before vLLM copies the driver's variables to it.
Reference: HF transformers greedy.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, patched_environ, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine

# collective_rpc pickles _worker_facts for the Ray actors, which cannot import this test module by name.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

MAX_TOKENS = 8
PROMPTS = make_prompts([5, 9, 17], seed=3)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(tiny_config("qwen2"))


@pytest.fixture(scope="module")
def reference(model):
    return hf_greedy(model, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def llm(model, reference, tmp_path_factory):
    ray = pytest.importorskip("ray", reason="ray is a vLLM dependency")
    env = emulated_env(tmp_path_factory.mktemp("ray"))
    with patched_environ(env):
        ray.init(num_cpus=2, resources={"NPU": 2}, include_dashboard=False, log_to_driver=False)
    try:
        with engine(model, env, tensor_parallel_size=2, distributed_executor_backend="ray") as llm:
            yield llm
    finally:
        ray.shutdown()


def _worker_facts(worker) -> dict:
    import os

    from vllm.distributed.parallel_state import get_tp_group

    return {
        "tp": (get_tp_group().rank_in_group, get_tp_group().world_size),
        "visible": os.environ.get("NPU_EMULATED_VISIBLE_DEVICES"),
        "device": os.environ.get("VLLM_NPU_DEVICE"),
    }


def test_two_ray_workers_form_the_tp_group(llm):
    import ray

    facts = llm.collective_rpc(_worker_facts)
    assert sorted(f["tp"] for f in facts) == [(0, 2), (1, 2)]
    assert all(f["device"] == "emulated" and f["visible"] == "0,1" for f in facts), facts
    assert ray.available_resources().get("NPU", 0) == 0  # both NPU bundles are held by the engine's workers


def test_greedy_equals_hf(llm, reference):
    assert greedy(llm, PROMPTS, MAX_TOKENS) == reference
