# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""MC2 dispatch/combine: the reference twin over gloo on 2 ranks against the all-to-all / local dispatchers, a
brute-force exchange, and the single-process MoE; plus the per-step choice rule (float32, 1e-5).

Scenarios (``moe_mc2_worker.SCENARIOS``): uneven tokens per rank, a rank with no tokens, a static placement with
swapped and redundant experts, and ranks holding the same tokens (MC2 splits them; the partial outputs sum up).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from npu_testkit.distributed import load_worker, run_rank_workers

WORKER = Path(__file__).with_name("moe_mc2_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run both ranks once; returns (worker module, [rank0 results, rank1 results])."""
    out = tmp_path_factory.mktemp("ranks")
    return load_worker(WORKER), run_rank_workers(WORKER, 2, out)


def _single_process(worker, name: str, rank: int) -> torch.Tensor:
    from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
    from vllm_npu.ops.moe.gating import RoutingConfig

    num_experts, _, top_k, _, _ = worker.SCENARIOS[name]
    w13, w2, x, logits = worker.inputs(name, rank)
    plan = build_moe_plan(RoutingConfig(top_k=top_k), num_experts, act_dtype=torch.float32, backend="reference")
    return moe_forward(x, logits, plan=plan, experts=plan.unquantized_experts(w13, w2))


@pytest.mark.parametrize("name", ["uneven_tokens", "rank1_no_tokens", "swapped_redundant"])
def test_mc2_twin_equals_all_to_all_dispatcher(ranks, name):
    worker, results = ranks
    for rank in range(2):
        got = results[rank][name]
        assert got["calls"] == {"mc2": 1, "other": 0}
        torch.testing.assert_close(got["mc2"], got["other"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["mc2"], _single_process(worker, name, rank), atol=1e-5, rtol=1e-5)
    assert results[1]["rank1_no_tokens"]["mc2"].shape == (0, worker.HIDDEN)


@pytest.mark.parametrize("name", ["replicated_tokens", "replicated_one_token"])
def test_mc2_over_replicated_tokens_sums_to_the_whole(ranks, name):
    worker, results = ranks
    expect = _single_process(worker, name, 0)
    for key in ("mc2", "other"):
        total = results[0][name][key] + results[1][name][key]
        torch.testing.assert_close(total, expect, atol=1e-5, rtol=1e-5)
    # each rank computed only its share of the tokens: the other rows are exact zeros
    tokens = expect.shape[0]
    share = -(-tokens // 2)
    assert bool((results[0][name]["mc2"][share:] == 0).all()) and bool((results[1][name]["mc2"][:share] == 0).all())


def test_dispatch_outputs_match_a_brute_force_exchange(ranks):
    worker, results = ranks
    num_experts, tokens, top_k, _, _ = worker.SCENARIOS["uneven_tokens"]
    local = num_experts // 2
    xs = [worker.inputs("uneven_tokens", r)[2] for r in range(2)]
    ids = [results[r]["dispatch"]["topk_ids"] for r in range(2)]
    for rank in range(2):
        d = results[rank]["dispatch"]["plain"]
        rows, origins, per = [], [], []
        for e in range(rank * local, (rank + 1) * local):
            for src in range(2):
                slots = (ids[src].reshape(-1) == e).nonzero().flatten().tolist()
                per.append(len(slots))
                for flat in slots:
                    rows.append(xs[src][flat // top_k])
                    origins += [src, flat // top_k, flat % top_k]
        n = len(rows)
        capacity = 16 * 2 * min(local, top_k)
        assert d["expand_x"].shape == (capacity, worker.HIDDEN)
        torch.testing.assert_close(d["expand_x"][:n], torch.stack(rows))
        assert bool((d["expand_x"][n:] == 0).all())
        assert d["assist_info"][: 3 * n].tolist() == origins and bool((d["assist_info"][3 * n :] == -1).all())
        assert d["expert_token_nums"].tolist() == [sum(per[2 * i : 2 * i + 2]) for i in range(local)]
        assert d["ep_recv_counts"].tolist() == torch.tensor(per).cumsum(0).tolist()
        # dynamic-quant mode: the same rows, int8 per token, with their scales
        q = results[rank]["dispatch"]["quant"]
        expect_rows = torch.stack(rows)
        scale = expect_rows.abs().amax(-1) / 127
        assert q["expand_x"].dtype == torch.int8
        torch.testing.assert_close(q["dynamic_scales"][:n], scale)
        assert torch.equal(q["expand_x"][:n], torch.round(expect_rows / scale.unsqueeze(1)).to(torch.int8))
        assert q["assist_info"].tolist() == d["assist_info"].tolist()


def test_mc2_candidate_rule():
    from vllm_npu.ops.moe.mc2 import mc2_candidate, mc2_tokens_capacity

    assert not mc2_candidate("off", npu=True, soc="A3", ep_world=16)
    assert mc2_candidate("on", npu=False, soc="", ep_world=2)
    assert not mc2_candidate("auto", npu=False, soc="A3", ep_world=16)  # the emulated device keeps its dispatchers
    assert mc2_candidate("auto", npu=True, soc="A3", ep_world=2)
    assert not mc2_candidate("auto", npu=True, soc="A2", ep_world=8)
    assert mc2_candidate("auto", npu=True, soc="A2", ep_world=16)
    assert not mc2_candidate("auto", npu=True, soc="", ep_world=16)
    assert (mc2_tokens_capacity(256), mc2_tokens_capacity(64, 1), mc2_tokens_capacity(1024)) == (256, 128, 512)


def test_step_dispatcher_switches_at_the_capacity():
    from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
    from vllm_npu.ops.moe.gating import RoutingConfig
    from vllm_npu.ops.moe.mc2 import MC2Comm

    gen = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(4, 8, 6, generator=gen), torch.randn(4, 6, 4, generator=gen)
    routing = RoutingConfig(top_k=2)
    ident = lambda x, out_splits, in_splits: x.clone()  # noqa: E731  the one-rank all-to-all
    plan = build_moe_plan(
        routing, 4, act_dtype=torch.float32, mc2=MC2Comm(0, 1, ident), mc2_capacity=5, backend="reference"
    )
    full = build_moe_plan(routing, 4, act_dtype=torch.float32, backend="reference")
    for tokens in (1, 5, 6, 9):
        x, logits = torch.randn(tokens, 6, generator=gen), torch.randn(tokens, 4, generator=gen)
        out = moe_forward(x, logits, plan=plan, experts=plan.unquantized_experts(w13, w2))
        torch.testing.assert_close(out, moe_forward(x, logits, plan=full, experts=full.unquantized_experts(w13, w2)))
    assert plan.dispatcher.calls == {"mc2": 2, "other": 2}


def test_uneven_placement_is_refused_for_mc2():
    from vllm_npu.interface import ConfigError
    from vllm_npu.ops.moe.mc2 import MC2Comm, build_mc2
    from vllm_npu.ops.moe.placement import ExpertPlacement

    with pytest.raises(ConfigError, match="evenly"):
        build_mc2(ExpertPlacement(5, [[0, 1, 2], [3, 4]]), MC2Comm(0, 2), capacity=8, replicated_tokens=False)
