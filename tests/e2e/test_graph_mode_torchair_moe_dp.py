# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``npu.graph_mode='torchair'`` with data-parallel MoE: a tiny Qwen3-MoE at ``data_parallel_size=2`` with
``enable_expert_parallel`` (EP=2 over the DP ranks, 3 of 6 experts each), offline, one process per DP rank
(``dp_support``), cache off, sizes [1, 2, 4]. The MoE layers are in the compiled decode graph (no opaque
``vllm.moe_forward`` node) with their exchange: the all-gather / reduce-scatter of static shapes (``default``).

``deepseek_mc2_w8a8_dynamic_mtp`` is the production DeepSeek stack of issue #31 as one engine: a tiny DeepSeek-V3
(MLA, a shared expert, noaux_tc routing, 2 of 4 experts per rank) with an MTP layer, quantized to W8A8_DYNAMIC (its
MTP block too), MC2's twin (``npu.moe_mc2='on'``, every compiled size within its capacity; npu-quant's MoE method
behind MC2's int8 dispatch), and MTP speculative decoding (k=1): the verification steps (2 tokens per request) run
at the compiled sizes [2, 4, 8] and the draft's decode passes compiled too, its MoE layer through MC2 as well. The
MTP layer drafts from a bigram table read off the first half of the reference continuations
(:mod:`npu_testkit.mtp_bigram`), so drafts are accepted and rejected. Each rank has vLLM's engine-core process here (drafts reach the scheduler only from its busy loop).

Rank 0 gets three prompts, rank 1 one (it keeps stepping with dummy batches, padded to rank 0's size). Greedy output
equals HF's (float) or the independent simulation's (quantized, :mod:`vllm_npu.quant.tools.simulate`: the target
alone, so speculation is lossless); no compile after start-up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from npu_testkit.engine import make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy
from npu_testkit.sibling import import_sibling

pytestmark = pytest.mark.engine

dp = import_sibling(__file__, "dp_support")
SIZES = [1, 2, 4]
MAX_TOKENS = 6
PROMPTS = make_prompts([5, 9, 17, 3], seed=3)
SHARES = {0: [0, 1, 2], 1: [3]}
MTP_K = 1
# case -> (npu settings, the MoE layers' dispatcher, the exchange's nodes per MoE layer in a compiled graph, MTP)
CASES = {
    "default": ({}, "GatheredDispatcher", {"all_gather": 3, "reduce_scatter": 1}, False),  # rows, weights, ids; sums
    "deepseek_mc2_w8a8_dynamic_mtp": ({"moe_mc2": "on"}, "StepDispatcher", {"mc2": 1, "all_gather": 0}, True),
}


def _deepseek_mtp_w8a8_dynamic(tmp: Path) -> tuple[Path, list[list[int]]]:
    """The tiny DeepSeek-V3 with an MTP layer quantized to W8A8_DYNAMIC (MTP block included), its simulated greedy
    reference, and the MTP layer taught the reference's bigrams."""
    from npu_testkit.drafts import build_mtp_model
    from npu_testkit.mtp_bigram import bigrams, teach_bigrams
    from vllm_npu.quant.tools.cli import main as quantize_main
    from vllm_npu.quant.tools.simulate import greedy as sim_greedy
    from vllm_npu.quant.tools.simulate import simulated_hf_model

    float_dir = build_mtp_model(tiny_config("deepseek_v3"), std=0.2)
    model = tmp / "deepseek_mtp_w8a8_dynamic"
    assert quantize_main([str(float_dir), str(model), "--scheme", "W8A8_DYNAMIC"]) == 0
    reference = sim_greedy(simulated_hf_model(model), PROMPTS, MAX_TOKENS)
    # the bigrams of each continuation's first half only: later drafts are mostly rejected
    teach_bigrams(model, bigrams(PROMPTS, [out[: MAX_TOKENS // 2] for out in reference]))
    return model, reference


@pytest.mark.parametrize("case", list(CASES))
def test_dp_moe_in_the_graph_equals_hf(case, tmp_path):
    npu, dispatcher, exchanges, mtp = CASES[case]
    sizes, experts = SIZES, [3]
    llm_kwargs = {
        "enable_expert_parallel": True,
        "max_num_batched_tokens": 64,
        "block_size": 16,
        "additional_config": {"npu": {"graph_mode": "torchair", "torchair_cache": False, **npu}},
    }
    if mtp:
        model, reference = _deepseek_mtp_w8a8_dynamic(tmp_path / "quant")
        sizes, experts = [(1 + MTP_K) * n for n in SIZES], [2]  # 1, 2 and 4 requests' verification steps
        llm_kwargs["speculative_config"] = {"method": "deepseek_mtp", "num_speculative_tokens": MTP_K}
    else:
        model = build_tiny_model(tiny_config("qwen3_moe"))
        reference = hf_greedy(model, PROMPTS, MAX_TOKENS)
    llm_kwargs["compilation_config"] = {"cudagraph_capture_sizes": sizes}
    shares = {rank: [PROMPTS[i] for i in share] for rank, share in SHARES.items()}
    results = dp.run_dp(model, llm_kwargs, tmp_path, shares, MAX_TOKENS, multiprocessing=mtp, graph_state=True)
    for rank, share in SHARES.items():
        got = results[rank]
        assert got["tokens"] == [reference[i] for i in share], rank
        assert (got["dp_size"], got["ep_size"], got["local_experts"]) == (2, 2, experts)
        layers = got["moe_layers"]
        assert layers["wrapper"] == "TorchairWrapper" and layers["compile_counts"] == {str(s): 1 for s in sizes}
        assert layers["in_graph"] and all(layers["in_graph"]) and layers["dispatchers"] == [dispatcher]
        method = "AscendW8A8DynamicFusedMoEMethod" if mtp else "AscendUnquantizedFusedMoEMethod"
        assert layers["quant_methods"] == [method]
        startup, generate = got["startup"], got["generate"]
        assert startup["opaque_moe_nodes"] == 0 and startup["opaque_attention_nodes"] == 0, startup
        # every MoE layer of every compiled size holds its exchange
        graphs = len(layers["in_graph"]) * len(sizes)
        assert {k: startup["moe_exchange_nodes"].get(k, 0) for k in exchanges} == {
            k: n * graphs for k, n in exchanges.items()
        }, startup
        assert generate["compiles"] == 0 and generate["recompiles"] == 0, generate
        assert generate["compiled_calls"] > 0, generate
        if mtp:  # drafts accepted and rejected; the draft's passes compiled, its MoE layer behind MC2 too
            assert 0 < got["spec"]["accepted"] < got["spec"]["drafted"], got["spec"]
            assert generate["draft_compiled_calls"] > 0 and set(generate["draft_compiles"]) <= set(map(str, sizes))
            assert all(n == 1 for n in generate["draft_compiles"].values()), generate
            draft = got["draft_moe_layers"]
            assert (draft["wrapper"], draft["layers"], draft["dispatchers"]) == (
                "DraftTorchairWrapper",
                1,
                [dispatcher],
            )
            assert draft["quant_methods"] == [method] and draft["calls"]["mc2"] > 0, draft
