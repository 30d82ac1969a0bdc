# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``npu.graph_mode='torchair'`` with MoE and quantized models (cache off), one engine per case:

- ``moe``: a tiny Qwen3-MoE (every decoder layer MoE, 6 experts, top-2). Its MoE layers are traced into the compiled
  decode graph with the attention (npu-ops' ``AscendFusedMoE`` calls its ``forward_impl``, not vLLM's opaque
  ``moe_forward`` op): no opaque MoE node in any compiled graph, and the graph's combine is the finalize twin
  (``npu_moe_finalize_routing``'s). Greedy output equals HF's.
- ``w8a8``: the tiny Qwen2 quantized to static W8A8 by ``vllm-npu quantize``; its quantized linear layers run in the
  compiled graph. Greedy output equals the independent simulation's (:mod:`vllm_npu.quant.tools.simulate`).
- ``moe_w8a8_dynamic`` / ``moe_w8a8``: the tiny Qwen3-MoE quantized to W8A8_DYNAMIC / static W8A8 (experts through
  npu-quant's MoE method): its quantized MoE layers are traced into the graph too (no opaque MoE node). Greedy output
  equals the simulation's.
- ``deepseek_w4a8_dynamic``: the tiny DeepSeek-V3 (MLA, KV block 128, a shared expert) quantized to W4A8_DYNAMIC:
  routed experts int8 rows x int4 weights (as vllm-ascend v0.11.0 runs them on hardware), the other linears
  weight-only; traced into the graph likewise. Greedy output equals the simulation's, compiled and eager.

All for batches of 1..5 (3 pads to 4, 5 is eager, so the eager paths run in the same engine), with no compile after
start-up.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy
from npu_testkit.quant_e2e import QuantCase, dense_methods, layer_methods, moe_methods, quantize

pytestmark = pytest.mark.engine

SIZES = [1, 2, 4]
BATCHES = range(1, SIZES[-1] + 2)
NEW_TOKENS = 6
QUANT = {
    "w8a8": QuantCase("w8a8", "W8A8", "qwen2", 0.1, dense_methods("W8A8Scheme")),
    "moe_w8a8_dynamic": QuantCase(
        "moe_w8a8_dynamic",
        "W8A8_DYNAMIC",
        "qwen3_moe",
        0.05,
        moe_methods("AscendW8A8DynamicFusedMoEMethod", "W8A8DynamicScheme"),
    ),
    "moe_w8a8": QuantCase("moe_w8a8", "W8A8", "qwen3_moe", 0.05, moe_methods("AscendW8A8FusedMoEMethod", "W8A8Scheme")),
    # DeepSeek-V3 (MLA, shared experts, noaux_tc routing): routed experts int8 x int4 as vllm-ascend runs them on
    # hardware; the attention and shared-expert linears W4A8 weight-only (group 16: the tiny model's input sizes)
    "deepseek_w4a8_dynamic": QuantCase(
        "deepseek_w4a8_dynamic",
        "W4A8_DYNAMIC",
        "deepseek_v3",
        0.5,
        [
            ("down_proj", "AscendLinearMethod", "W4A8DynamicScheme"),
            ("experts", "AscendW4A8DynamicFusedMoEMethod", "NoneType"),
            ("fused_qkv_a_proj", "AscendLinearMethod", "W4A8DynamicScheme"),
            ("gate", "float", "NoneType"),
            ("gate_up_proj", "AscendLinearMethod", "W4A8DynamicScheme"),
            ("kv_b_proj", "AscendLinearMethod", "W4A8DynamicScheme"),
            ("o_proj", "AscendLinearMethod", "W4A8DynamicScheme"),
            ("q_b_proj", "AscendLinearMethod", "W4A8DynamicScheme"),
        ],
        quantize_args=("--group-size", "16"),
    ),
}


def _stats():
    from vllm_npu.platform.graphs.torchair import TORCHAIR_STATS

    return TORCHAIR_STATS.snapshot()


@pytest.fixture(scope="module", params=["moe", "w8a8", "moe_w8a8_dynamic", "moe_w8a8", "deepseek_w4a8_dynamic"])
def case(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(case, tmp_path_factory):
    if case == "moe":
        return build_tiny_model(tiny_config("qwen3_moe"))
    return quantize(QUANT[case], tmp_path_factory.mktemp("quant"))[1]


@pytest.fixture(scope="module")
def llm(checkpoint, case, tmp_path_factory):
    npu = {"graph_mode": "torchair", "torchair_cache": False}
    env = emulated_env(tmp_path_factory.mktemp(f"torchair_{case}"))
    mla = case in QUANT and QUANT[case].model == "deepseek_v3"
    kwargs = {"compilation_config": {"cudagraph_capture_sizes": SIZES}, "block_size": 128 if mla else 16}
    with engine(checkpoint, env, additional_config={"npu": npu}, **kwargs) as llm:
        yield llm


def test_layers_run_in_the_compiled_graph(llm, case):
    (info,) = llm.collective_rpc("npu_runtime_info")
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    assert type(model).__name__ == "TorchairWrapper" and sorted(model.compiled) == SIZES
    assert model.compile_counts == dict.fromkeys(SIZES, 1)
    assert info["torchair"]["opaque_moe_nodes"] == 0 and info["torchair"]["opaque_attention_nodes"] == 0, info
    if case in QUANT:
        (methods,) = llm.collective_rpc(layer_methods)
        assert methods == QUANT[case].methods
    if case == "w8a8":
        return
    from vllm_npu.ops.moe import AscendFusedMoE
    from vllm_npu.ops.moe.routing import finalize_routing_reference

    layers = [m for m in model.unwrap().modules() if isinstance(m, AscendFusedMoE)]
    assert layers and all(m._moe_in_graph and m.moe_graph_refusal is None for m in layers)
    assert all(m.moe_plan.dispatcher.graph_unpermute is finalize_routing_reference for m in layers)


def test_greedy_matches_the_reference_with_zero_recompiles(llm, case, checkpoint):
    prompts = make_prompts([3 + (7 * i) % 13 for i in BATCHES], seed=12)
    before = _stats()
    outputs = {n: greedy(llm, prompts[:n], NEW_TOKENS) for n in BATCHES}
    after = _stats()
    if case == "moe":
        reference = hf_greedy(checkpoint, prompts, NEW_TOKENS)
    else:
        from vllm_npu.quant.tools.simulate import greedy as sim_greedy
        from vllm_npu.quant.tools.simulate import simulated_hf_model

        reference = sim_greedy(simulated_hf_model(checkpoint), prompts, NEW_TOKENS)
    for n in BATCHES:
        assert outputs[n] == reference[:n], f"batch of {n}"
    assert after["compiles"] == before["compiles"] and after["recompiles"] == before["recompiles"]
    assert all(after["compiled_calls"][n] > before["compiled_calls"].get(n, 0) for n in SIZES), after
    assert after["eager_calls"] > before["eager_calls"]  # prefills and the batch of 5
