# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Dynamic EPLB (vLLM's ``--enable-eplb``) in a real vLLM engine on the emulated device: tiny Qwen3-MoE (6 experts,
top-2), TP=2 with ``enable_expert_parallel``, float32, two redundant experts (8 physical slots, 4 per rank) and a
rearrangement every 6 steps.

While it generates, vLLM's ``EplbState`` rebalances from the load npu-ops' dispatchers counted and moves expert
weights between the two workers over gloo. Read back from the workers afterwards: the physical -> logical map
differs from vLLM's initial one, every slot's tensors are the checkpoint tensors of the logical expert the map says
it holds, and every real (token, slot) pair was counted once. A request started after the rearrangements runs through
the moved experts too (its prefill eagerly in both engines). EPLB off is covered by the other MoE engine modules.

Two engines:

- ``eager``: the float model; greedy tokens == HF's.
- ``torchair_w8a8_dynamic``: the model's experts quantized to W8A8_DYNAMIC by ``vllm-npu quantize`` (attention
  float: :mod:`npu_testkit.quant_ep`), ``npu.graph_mode='torchair'`` (sizes 2 and 8). Decode steps run the quantized
  MoE layers inside the compiled graph, reading vLLM's replica tables as graph inputs and counting load in it;
  prefills and mixed steps run them eagerly. vLLM's rearrangement moves every per-expert tensor of the quant method
  (the transposed int8 weights and the per-channel scales): every slot holds its new logical expert's processed
  tensors, the rearrangements recompile nothing and the tokens stay the quant simulation's
  (:mod:`vllm_npu.quant.tools.simulate`, no EPLB).

(Float experts in the compiled graph with EPLB: ``packages/npu-ops/tests/test_moe_eplb_graph.py``; quantized experts
moved layer by layer for every scheme: ``packages/npu-quant/tests/test_moe_eplb.py``.)
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
from npu_testkit.engine import ep2_engine, greedy, make_prompts, tiny_config
from npu_testkit.eplb import eplb_engine_args, eplb_readback, initial_map
from npu_testkit.models import build_tiny_model, hf_greedy
from npu_testkit.quant_e2e import QuantCase, moe_methods
from npu_testkit.quant_ep import quantized_experts_only

pytestmark = pytest.mark.engine

cloudpickle.register_pickle_by_value(sys.modules[__name__])

NUM_EXPERTS, REDUNDANT, TOP_K = 6, 2, 2
INITIAL = initial_map(NUM_EXPERTS, REDUNDANT)  # vLLM's initial physical map


QUANT = QuantCase(
    "moe_w8a8_dynamic_eplb",
    "W8A8_DYNAMIC",
    "qwen3_moe",
    0.05,
    moe_methods("AscendW8A8DynamicFusedMoEMethod", "W8A8DynamicScheme"),
)

#: The torchair case's compiled sizes: decode steps of 1-2 requests pad to 2, of 3-5 to 8.
SIZES = [2, 8]


@pytest.fixture(scope="module", params=["eager", "torchair_w8a8_dynamic"])
def mode(request):
    return request.param


@pytest.fixture(scope="module")
def tiny_model(mode, tmp_path_factory):
    """The checkpoint the engine serves: the float model, or its W8A8_DYNAMIC experts (attention float)."""
    if mode == "eager":
        return build_tiny_model(tiny_config("qwen3_moe"))
    return quantized_experts_only(QUANT, tmp_path_factory.mktemp("quant"))[1]


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory, mode):
    graphs = (
        {
            "additional_config": {"npu": {"graph_mode": "torchair", "torchair_cache": False}},
            "compilation_config": {"cudagraph_capture_sizes": SIZES},
        }
        if mode.startswith("torchair")
        else {}
    )
    with ep2_engine(
        tiny_model,
        tmp_path_factory.mktemp("moe_eplb"),
        enable_prefix_caching=False,
        **eplb_engine_args(REDUNDANT, step_interval=6),
        **graphs,
    ) as llm:
        yield llm


def _reference(tiny_model, mode, prompts, max_tokens):
    if mode == "eager":
        return hf_greedy(tiny_model, prompts, max_tokens)
    from vllm_npu.quant.tools.simulate import greedy as sim_greedy
    from vllm_npu.quant.tools.simulate import simulated_hf_model

    return sim_greedy(simulated_hf_model(tiny_model), prompts, max_tokens)


def test_experts_are_rearranged_and_output_matches_the_reference(llm, tiny_model, mode):
    prompts = make_prompts([3, 9, 30, 70, 120], seed=7)
    max_tokens = 14
    before = [info["torchair"] for info in llm.collective_rpc("npu_runtime_info")]
    assert greedy(llm, prompts, max_tokens) == _reference(tiny_model, mode, prompts, max_tokens)
    after = [info["torchair"] for info in llm.collective_rpc("npu_runtime_info")]
    if mode.startswith("torchair"):  # decode steps ran compiled on both ranks, the rearrangements recompiled nothing
        for b, a in zip(before, after, strict=True):
            assert sorted(b["compiles"]) == SIZES and a["compiles"] == b["compiles"], (b, a)
            assert a["recompiles"] == b["recompiles"] == 0 and a["opaque_moe_nodes"] == 0, a
            assert sum(a["compiled_calls"].values()) > sum(b["compiled_calls"].values()), (b, a)

    ranks = llm.collective_rpc(eplb_readback)
    assert len(ranks) == 2
    maps = ranks[0]["physical_to_logical"]
    assert maps == ranks[1]["physical_to_logical"]  # one state, agreed by both ranks
    assert len(maps) == 2 and any(m != INITIAL for m in maps), f"no rearrangement happened: {maps}"
    for m in maps:
        assert sorted(set(m)) == list(range(NUM_EXPERTS))  # every logical expert still has a replica
    method = "AscendW8A8DynamicFusedMoEMethod" if mode != "eager" else "AscendUnquantizedFusedMoEMethod"
    for r in ranks:
        # every slot holds exactly the (processed) checkpoint tensors of the logical expert the map places there
        assert r["method"] == method and r["mismatches"] == [], r["mismatches"]

    # Every forward token of the generation routed TOP_K slots per layer; summed over the ranks, each pair counts once.
    # A compiled step counts its padding rows too (as vLLM's counting inside CUDA graphs does), and vLLM's capture
    # dummies (skip_eplb) leave theirs in the first pass: in the torchair mode at least every real pair is counted.
    forward_tokens = sum(len(p) for p in prompts) + len(prompts) * (max_tokens - 1)
    for layer in range(2):
        total = sum(sum(r["load_window"][layer]) for r in ranks)
        if mode == "eager":
            assert total == forward_tokens * TOP_K
        else:
            assert total >= forward_tokens * TOP_K

    # A request started after the rearrangements: its prompt's prefill chunks run eagerly (in the torchair mode too)
    # through the moved experts, then its decode steps (compiled in the torchair mode); == the reference.
    late = make_prompts([100], seed=9)
    stats = [info["torchair"] for info in llm.collective_rpc("npu_runtime_info")]
    assert greedy(llm, late, 6) == _reference(tiny_model, mode, late, 6)
    if mode.startswith("torchair"):
        for b, a in zip(stats, [info["torchair"] for info in llm.collective_rpc("npu_runtime_info")], strict=True):
            assert a["eager_calls"] > b["eager_calls"] and a["compiles"] == b["compiles"], (b, a)
