# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``npu.graph_mode='torchair'`` with data-parallel MoE: a tiny Qwen3-MoE at ``data_parallel_size=2`` with
``enable_expert_parallel`` (EP=2 over the DP ranks, 3 of 6 experts each), offline, one process per DP rank
(``dp_support``), cache off, sizes [1, 2, 4]. The MoE layers are in the compiled decode graph (no opaque
``vllm.moe_forward`` node) with their exchange: the all-gather / reduce-scatter of static shapes (``default``) or MC2's
twin (``mc2``: ``npu.moe_mc2='on'``, every compiled size within its capacity), the latter on the model quantized to
W8A8_DYNAMIC (npu-quant's MoE method behind MC2's quantized dispatch: the production DeepSeek layout). Rank 0 gets
three prompts, rank 1 one (it keeps stepping with dummy batches, padded to rank 0's size). Greedy output equals HF's
(float) or the independent simulation's (quantized, :mod:`vllm_npu.quant.tools.simulate`); no compile after start-up.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy
from npu_testkit.quant_e2e import QuantCase, moe_methods, quantize
from npu_testkit.sibling import import_sibling

pytestmark = pytest.mark.engine

dp = import_sibling(__file__, "dp_support")
SIZES = [1, 2, 4]
MAX_TOKENS = 6
PROMPTS = make_prompts([5, 9, 17, 3], seed=3)
SHARES = {0: [0, 1, 2], 1: [3]}
W8A8_DYNAMIC = QuantCase(
    "moe_w8a8_dynamic",
    "W8A8_DYNAMIC",
    "qwen3_moe",
    0.05,
    moe_methods("AscendW8A8DynamicFusedMoEMethod", "W8A8DynamicScheme"),
)
# case -> (npu settings, the MoE layers' dispatcher, the exchange's nodes per MoE layer in a compiled graph, quantized)
CASES = {
    "default": ({}, "GatheredDispatcher", {"all_gather": 3, "reduce_scatter": 1}, False),  # rows, weights, ids; sums
    "mc2_w8a8_dynamic": ({"moe_mc2": "on"}, "StepDispatcher", {"mc2": 1, "all_gather": 0}, True),  # MC2, every size
}


@pytest.mark.parametrize("case", list(CASES))
def test_dp_moe_in_the_graph_equals_hf(case, tmp_path):
    npu, dispatcher, exchanges, quantized = CASES[case]
    if quantized:
        from vllm_npu.quant.tools.simulate import greedy as sim_greedy
        from vllm_npu.quant.tools.simulate import simulated_hf_model

        model = quantize(W8A8_DYNAMIC, tmp_path / "quant")[1]
        reference = sim_greedy(simulated_hf_model(model), PROMPTS, MAX_TOKENS)
    else:
        model = build_tiny_model(tiny_config("qwen3_moe"))
        reference = hf_greedy(model, PROMPTS, MAX_TOKENS)
    llm_kwargs = {
        "enable_expert_parallel": True,
        "max_num_batched_tokens": 64,
        "block_size": 16,
        "compilation_config": {"cudagraph_capture_sizes": SIZES},
        "additional_config": {"npu": {"graph_mode": "torchair", "torchair_cache": False, **npu}},
    }
    shares = {rank: [PROMPTS[i] for i in share] for rank, share in SHARES.items()}
    results = dp.run_dp(model, llm_kwargs, tmp_path, shares, MAX_TOKENS, graph_state=True)
    for rank, share in SHARES.items():
        got = results[rank]
        assert got["tokens"] == [reference[i] for i in share], rank
        assert (got["dp_size"], got["ep_size"], got["local_experts"]) == (2, 2, [3])
        layers = got["moe_layers"]
        assert layers["wrapper"] == "TorchairWrapper" and layers["compile_counts"] == {str(s): 1 for s in SIZES}
        assert layers["in_graph"] and all(layers["in_graph"]) and layers["dispatchers"] == [dispatcher]
        method = "AscendW8A8DynamicFusedMoEMethod" if quantized else "AscendUnquantizedFusedMoEMethod"
        assert layers["quant_methods"] == [method]
        startup, generate = got["startup"], got["generate"]
        assert startup["opaque_moe_nodes"] == 0 and startup["opaque_attention_nodes"] == 0, startup
        # every MoE layer of every compiled size holds its exchange
        graphs = len(layers["in_graph"]) * len(SIZES)
        assert {k: startup["moe_exchange_nodes"].get(k, 0) for k in exchanges} == {
            k: n * graphs for k, n in exchanges.items()
        }, startup
        assert generate["compiles"] == 0 and generate["recompiles"] == 0, generate
        assert generate["compiled_calls"] > 0, generate
