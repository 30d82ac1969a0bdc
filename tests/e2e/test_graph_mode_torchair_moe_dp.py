# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``npu.graph_mode='torchair'`` with data-parallel MoE: a tiny Qwen3-MoE at ``data_parallel_size=2`` with
``enable_expert_parallel`` (EP=2 over the DP ranks, 3 of 6 experts each), offline, one process per DP rank
(``dp_support``), cache off, sizes [1, 2, 4]. The MoE layers are in the compiled decode graph (no opaque
``vllm.moe_forward`` node) with their exchange: the all-gather / reduce-scatter of static shapes.

``gathered_eplb_dynamic`` runs it with vLLM's dynamic EPLB (``--enable-eplb``, two redundant experts: 4 of 8 slots
per rank, a rearrangement every 3 steps over the EP group of both DP ranks), as production DeepSeek runs DP + EP.
Decode steps count the expert load inside the compiled graph and read vLLM's replica tables as graph inputs; rank
1's dummy batches (eager, at the padded size) count none but take their part in every rearrangement. After the
first generate (rearranged twice mid-run) and again after a late request on rank 0 alone (rank 1 idles through two
more rearrangements): both ranks agree on a physical -> logical map other than vLLM's initial one, each rank's own
slots changed experts, every slot holds the checkpoint tensors of its new expert (``npu_testkit.eplb``), greedy ==
HF before, across and after the rearrangements, nothing recompiled.

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
from npu_testkit.eplb import eplb_engine_args, initial_map
from npu_testkit.models import build_tiny_model, hf_greedy
from npu_testkit.sibling import import_sibling

pytestmark = pytest.mark.engine

dp = import_sibling(__file__, "dp_support")
SIZES = [1, 2, 4]
MAX_TOKENS = 6
PROMPTS = make_prompts([5, 9, 17, 3], seed=3)
SHARES = {0: [0, 1, 2], 1: [3]}
LATE = {0: make_prompts([20], seed=5), 1: []}  # the EPLB case's second generate: rank 1 idles
MTP_K = 1
NUM_EXPERTS, REDUNDANT, TOP_K = 6, 2, 2  # the tiny Qwen3-MoE's experts; the EPLB case's redundant slots
# case -> (npu settings, the MoE layers' dispatcher, the exchange's nodes per MoE layer in a compiled graph, MTP,
# dynamic EPLB)
CASES = {
    "gathered_eplb_dynamic": (  # all-gather of rows, weights, ids; reduce-scatter of sums
        {},
        "GatheredDispatcher",
        {"all_gather": 3, "reduce_scatter": 1},
        False,
        True,
    ),
    "deepseek_mc2_w8a8_dynamic_mtp": ({"moe_mc2": "on"}, "StepDispatcher", {"mc2": 1, "all_gather": 0}, True, False),
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
    npu, dispatcher, exchanges, mtp, eplb = CASES[case]
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
        reference = hf_greedy(model, PROMPTS + LATE[0], MAX_TOKENS)
    if eplb:
        llm_kwargs.update(eplb_engine_args(REDUNDANT, step_interval=3), enable_prefix_caching=False)
        experts = [(NUM_EXPERTS + REDUNDANT) // 2]
    llm_kwargs["compilation_config"] = {"cudagraph_capture_sizes": sizes}
    shares = {rank: [PROMPTS[i] for i in share] for rank, share in SHARES.items()}
    late = LATE if eplb else None
    results = dp.run_dp(
        model, llm_kwargs, tmp_path, shares, MAX_TOKENS, multiprocessing=mtp, late_shares=late, graph_state=True
    )
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
    if eplb:
        _check_eplb(results, reference[len(PROMPTS) :], experts[0])


def _check_eplb(results: dict[int, dict], late_reference: list[list[int]], per_rank: int) -> None:
    """Both DP ranks' EPLB state after the first generate and after the late request (rank 0's alone)."""
    initial = initial_map(NUM_EXPERTS, REDUNDANT)
    first, late = ({r: results[r][key] for r in results} for key in ("eplb", "eplb_late"))
    for phase in (first, late):
        maps = phase[0]["physical_to_logical"]
        assert all(p["physical_to_logical"] == maps for p in phase.values())  # one state, agreed by both ranks
        assert len(maps) == 2 and all(sorted(set(m)) == list(range(NUM_EXPERTS)) for m in maps), maps
        for rank, p in phase.items():
            assert p["ep_rank"] == rank and p["method"] == "AscendUnquantizedFusedMoEMethod", p
            assert p["mismatches"] == [], (rank, p["mismatches"])  # every slot holds its expert's tensors
            # this rank's own slots changed experts in some layer: the rearrangement moved weights to both ranks
            own = slice(rank * per_rank, (rank + 1) * per_rank)
            assert any(m[own] != initial[own] for m in maps), (rank, maps)
    # both ranks rearranged together mid-generate, and the idle rank 1 (dummy batches) took part in more
    assert first[0]["rearrangements"] == first[1]["rearrangements"] >= 1, first
    assert late[0]["rearrangements"] == late[1]["rearrangements"] > first[0]["rearrangements"], late
    # each real (token, expert) pair of the first generate counted once on its rank (compiled steps count padding)
    forward_tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (MAX_TOKENS - 1)
    for layer in range(2):
        assert sum(sum(first[r]["load_window"][layer]) for r in first) >= forward_tokens * TOP_K
    # rank 1's dummy batches took part without counting load (vLLM drops a dummy pass's)
    assert late[1]["load_window"] == first[1]["load_window"], (first[1], late[1])
    # the late request ran through the moved experts (decode compiled), rank 1 stepped eager dummies, no compile
    assert results[0]["late_tokens"] == late_reference and results[1]["late_tokens"] == []
    rank0, rank1 = results[0]["late"], results[1]["late"]
    assert rank0["compiled_calls"] > 0 and rank1["eager_calls"] > 0, (rank0, rank1)
    for stats in (rank0, rank1):
        assert stats["compiles"] == 0 and stats["recompiles"] == 0 and stats["opaque_moe_nodes"] == 0, stats
