# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Engine-level data parallel, offline, on the emulated device: ``data_parallel_size=2`` run as vLLM runs it offline,
one process per DP rank (``dp_rank.py``, ``VLLM_DP_*`` variables), each an ``LLM`` whose engine core runs in that
process (vLLM's ``LLMEngine`` joins the DP group and steps dummy batches itself).

Three configurations, one DP=2 run each: tiny Qwen2 (dense: the ranks are independent engines joined by vLLM's DP
group), tiny Qwen3-MoE without expert parallelism (vLLM splits every expert's intermediate size over the two ranks:
each MoE layer gathers both ranks' tokens and reduce-scatters the partial sums) and with ``enable_expert_parallel``
(EP=2 over the two DP ranks, 3 of the 6 experts per rank), the latter also with PIECEWISE graphs (the MoE layers
inside the captured pieces, exchanging static shapes; then late prompts on rank 0 alone, a prefill and decode steps
beside rank 1's dummy batches). In the MoE cases every MoE layer exchanges tokens between
the ranks, and the rank with fewer requests keeps stepping with dummy batches until the other is done. Rank 0 gets three prompts, rank 1 one. Reference: HF transformers greedy, per
prompt.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy
from npu_testkit.sibling import import_sibling

pytestmark = pytest.mark.engine

MAX_TOKENS = 8
PROMPTS = make_prompts([5, 9, 17, 3], seed=3)
SHARES = {0: [0, 1, 2], 1: [3]}  # prompt indices per DP rank: uneven, so rank 1 runs dummy batches in the MoE case
CASES = {
    "dense": ("qwen2", {}),
    "moe": ("qwen3_moe", {}),  # no EP: vLLM splits every expert over the two ranks (intermediate size halved)
    "moe-ep": ("qwen3_moe", {"enable_expert_parallel": True}),
    # PIECEWISE graphs: the MoE layers run inside the captured pieces; vLLM pads both ranks' steps to one size, so
    # the EP exchange takes static shapes (all-gather / reduce-scatter) instead of the host-sized all-to-all
    "moe-ep-piecewise": (
        "qwen3_moe",
        {
            "enable_expert_parallel": True,
            "compilation_config": {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4]},
        },
    ),
}
# The PIECEWISE case's second generate on rank 0 alone while rank 1 idles and steps vLLM's DP dummy batch: beside the
# 31-token prefill (above the largest capture size: mode NONE, eager) and beside the 3-request decode steps (padded to
# capture size 4: the dummy batch replays the graph captured at 4). vLLM hands the model one row there.
LATE = {0: make_prompts([20, 4, 7], seed=5), 1: []}
LATE_CASES = {"moe-ep-piecewise"}
dp = import_sibling(__file__, "dp_support")


@pytest.mark.parametrize("case", list(CASES))
def test_dp2_greedy_equals_hf(case, tmp_path):
    arch, llm_kwargs = CASES[case]
    model = build_tiny_model(tiny_config(arch))
    late = LATE if case in LATE_CASES else None
    reference = hf_greedy(model, PROMPTS + (LATE[0] if late else []), MAX_TOKENS)
    shares = {rank: [PROMPTS[i] for i in share] for rank, share in SHARES.items()}
    kwargs = {"max_num_batched_tokens": 64, **llm_kwargs}
    results = dp.run_dp(model, kwargs, tmp_path, shares, MAX_TOKENS, late_shares=late)
    for rank, share in SHARES.items():
        got = results[rank]
        assert (got["dp_rank"], got["dp_size"]) == (rank, 2)
        assert got["tokens"] == [reference[i] for i in share], rank
        if llm_kwargs.get("enable_expert_parallel"):
            assert (got["ep_size"], got["local_experts"]) == (2, [3])  # 6 experts split over the two DP ranks
        elif arch == "qwen3_moe":
            assert got["local_experts"] == [6]  # every expert on every rank, each a slice
        else:
            assert got["ep_size"] == 1 or got["local_experts"] == []
    if late:  # rank 0's late prefill beside rank 1's dummy batches
        assert results[0]["late_tokens"] == reference[len(PROMPTS) :]
        assert results[1]["late_tokens"] == []
