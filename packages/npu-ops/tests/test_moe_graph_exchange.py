# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""MoE layers whose experts exchange rows across ranks, compiled as the torchair mode compiles them (2 ranks, gloo).

Each rank of ``moe_graph_worker`` runs three steps of one layer eagerly with the reference twins, then compiled with
the reference twins (``dynamic=False``, the emulated device's stand-in) and with the NPU twins (``dynamic=True``,
every tensor static; ``torch_npu`` as opaque custom ops of the documented arguments, MC2's stand-ins running the
twin's exchange with NaN in the rows the kernel leaves undefined). Each compiled run equals the eager one, compiles
once, takes no symbolic input, reads nothing on the host, and holds the exchange as the op the NPU kernel is (or the
twin's registered op); every op of the NPU graph has an implemented GE converter in torch_npu 2.8.0's torchair.

``mc2_eplb_dp`` adds dynamic EPLB to MC2 over DP tokens (four steps, a rearrangement before the third): the replica
tables and load counter are graph inputs, so the compiled layers read the new placement without recompiling and
count the same load as the eager one (the docstring of its test).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from npu_testkit.distributed import load_worker, run_rank_workers
from npu_testkit.torchair_converters import converter_parameters, missing_converters

WORKER = Path(__file__).with_name("moe_graph_worker.py")
HOST_READS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default"}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run both ranks once; returns (worker module, [rank0 results, rank1 results])."""
    out = tmp_path_factory.mktemp("ranks")
    return load_worker(WORKER), run_rank_workers(WORKER, 2, out)


def _single_process(worker, name: str, rank: int, step: int) -> torch.Tensor:
    """The whole MoE of this rank's tokens on one process (every expert local)."""
    from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
    from vllm_npu.ops.moe.gating import RoutingConfig

    num_experts, top_k, _, _ = worker.SCENARIOS[name]
    w13, w2 = worker.weights(num_experts)
    x, logits = worker.inputs(name, rank, step)
    plan = build_moe_plan(RoutingConfig(top_k=top_k), num_experts, act_dtype=torch.float32, backend="reference")
    return moe_forward(x, logits, plan=plan, experts=plan.unquantized_experts(w13, w2))


MC2_OPS = (
    {"vllm_npu.mc2_dispatch.default", "vllm_npu.mc2_combine.default"},
    {"npu.npu_moe_distribute_dispatch_v2.default", "npu.npu_moe_distribute_combine_v2.default"},
)
GATHER_OPS = {
    "_c10d_functional.all_gather_into_tensor.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.wait_tensor.default",
}
# the kind of a scenario -> (the exchange's ops in the reference graph, in the NPU graph)
EXCHANGE_OPS = {
    "mc2": MC2_OPS,
    "mc2+eplb": MC2_OPS,
    "gathered": (GATHER_OPS, GATHER_OPS),
    "mc2+gathered": (GATHER_OPS, GATHER_OPS),
}


@pytest.mark.parametrize("name", ["mc2_replicated", "mc2_dp", "gathered_dp", "mc2_over_gathered_dp", "mc2_eplb_dp"])
def test_exchange_compiles_once_without_host_reads_and_equals_eager(ranks, name):
    worker, results = ranks
    _, _, differ, kind = worker.SCENARIOS[name]
    twin_ops, npu_ops = EXCHANGE_OPS[kind]
    others = MC2_OPS[0] | MC2_OPS[1] if "gathered" in kind else set()  # past MC2's capacity the graph holds no MC2
    for rank in range(2):
        got = results[rank][name]
        for run in ("reference", "npu_eager", "npu"):
            for out, exp in zip(got[run]["outs"], got["eager"]["outs"], strict=True):
                assert not torch.isnan(out).any()  # the rows the kernels leave undefined never reach the output
                torch.testing.assert_close(out, exp, atol=1e-5, rtol=1e-5)
        for run, exchange in (("reference", twin_ops), ("npu", npu_ops)):
            ops = set(got[run]["ops"])
            assert got[run]["compiles"] == 1, f"{run}: {got[run]['compiles']} compiles over {worker.steps(name)} steps"
            assert got[run]["symbolic"] == []
            assert not ops & HOST_READS, ops
            assert exchange <= ops and not ops & others, ops
        assert missing_converters(got["npu"]["ops"]) == []
    # The eager reference itself: each rank's complete output, or (same tokens) the ranks' partial outputs summed.
    for step in range(worker.steps(name)):
        eager = [results[r][name]["eager"]["outs"][step] for r in range(2)]
        if differ:
            for rank in range(2):
                torch.testing.assert_close(eager[rank], _single_process(worker, name, rank, step), atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(
                eager[0] + eager[1], _single_process(worker, name, 0, step), atol=1e-5, rtol=1e-5
            )


@pytest.mark.parametrize("soc", ["A2", "A3"])
@pytest.mark.parametrize("traced", [False, True])
def test_mc2_npu_arguments_are_what_the_converters_take(monkeypatch, soc, traced):
    """Every argument our MC2 kernels pass, eagerly and in a graph (the TP-domain ones there on every chip), is a
    parameter of the op's GE converter in torch_npu 2.8.0's torchair (read from the wheel)."""
    import types

    from vllm_npu.ops.moe.mc2 import MC2Comm, mc2_combine_npu, mc2_dispatch_npu

    calls: dict[str, tuple[int, dict]] = {}

    def record(name, result):
        def fn(*args, **kwargs):
            calls[name] = (len(args), kwargs)
            return result

        return fn

    x, ids = torch.randn(2, 8), torch.tensor([[0, 1], [2, 3]])
    out7 = tuple(torch.zeros(1) for _ in range(7))
    fake = types.ModuleType("torch_npu")
    fake.npu_moe_distribute_dispatch_v2 = record("npu.npu_moe_distribute_dispatch_v2.default", out7)
    fake.npu_moe_distribute_combine_v2 = record("npu.npu_moe_distribute_combine_v2.default", torch.zeros(2, 8))
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: traced)
    comm = MC2Comm(0, 2, None, "hccl_ep", soc)
    d = mc2_dispatch_npu(x, ids, comm, 4, 4, False)
    mc2_combine_npu(torch.zeros(4, 8), ids, d, torch.ones(2, 2), comm, 4, 4)
    for op, (positional, kwargs) in calls.items():
        params = converter_parameters(op)
        assert not set(kwargs) - set(params[positional:]), (op, set(kwargs) - set(params))
        assert ("group_tp" in kwargs) == (soc == "A3" or traced)


def test_eager_step_with_unequal_dp_ranks_is_an_error(monkeypatch):
    """The static DP exchange needs every DP rank padded to one size (vLLM's DP padding): an eager step that breaks
    that (counts differ, or this rank's input exceeds its count) is an error naming the counts, not a hung or wrong
    collective. An input smaller than the count (vLLM's DP dummy batch: one row, the counts padded) is padded."""
    import types

    import vllm.forward_context as fc
    from vllm_npu.ops.moe.gathered import dp_padded_rows, pad_rows

    def context(counts):
        meta = types.SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor(counts))
        return types.SimpleNamespace(dp_metadata=meta)

    monkeypatch.setattr(fc, "get_forward_context", lambda: context([4, 4]))
    assert dp_padded_rows(torch.zeros(4, 8), 0) == 4
    assert dp_padded_rows(torch.zeros(1, 8), 1) == 4  # the dummy batch: padded to the count
    with pytest.raises(RuntimeError, match=r"the DP ranks hold \[4, 4\] tokens this step, this rank's MoE input 5"):
        dp_padded_rows(torch.zeros(5, 8), 1)
    monkeypatch.setattr(fc, "get_forward_context", lambda: context([4, 3]))
    with pytest.raises(RuntimeError, match=r"the DP ranks hold \[4, 3\] tokens this step, this rank's MoE input 3"):
        dp_padded_rows(torch.zeros(3, 8), 1)
    x = torch.arange(6.0).view(3, 2)
    padded = pad_rows(x, 5)
    assert padded.shape == (5, 2) and torch.equal(padded[:3], x) and not padded[3:].any()
    assert pad_rows(x, 3) is x


def _eplb_expected_load(worker, step: int) -> list[int]:
    """Rows per physical expert of a step over both ranks, by the placement's documented replica rule (slot j of
    token t on rank r goes to replica ``(t + r) % n_e`` of its expert, replicas in physical order) under the map in
    force: vLLM's initial one, then ``REARRANGED``."""
    from vllm_npu.ops.moe.eplb import eplb_placement

    num_experts, top_k, _, _ = worker.SCENARIOS["mc2_eplb_dp"]
    initial = eplb_placement(num_experts, worker.REDUNDANT, 2).physical_to_logical.tolist()
    mapping = worker.REARRANGED if step >= worker.REARRANGE_AT else initial
    load = [0] * len(mapping)
    for rank in range(2):
        _, logits = worker.inputs("mc2_eplb_dp", rank, step)
        for t, row in enumerate(torch.topk(logits, top_k, dim=-1).indices.tolist()):
            for e in row:
                replicas = [p for p, held in enumerate(mapping) if held == e]
                load[replicas[(t + rank) % len(replicas)]] += 1
    return load


def test_mc2_with_dynamic_eplb_counts_the_load_and_reads_the_rearranged_tables_in_the_graph(ranks):
    """MC2 over DP tokens with dynamic EPLB (redundant experts, vLLM-shaped replica tables as graph inputs, a
    rearrangement rewriting tables and weights in place between steps): the load MC2 counts in the compiled graphs
    (reference twins and NPU strategy) equals the eager count on each rank, step by step; over both ranks it is the
    documented replica rule's count under the map in force, which the rearrangement changes (the hot expert's rows
    split over its two new replicas). The outputs (== eager == one process, the test above, one compile) need the new
    tables: with the weights moved and the old tables kept, they are wrong from the rearrangement on."""
    worker, results = ranks
    name, at = "mc2_eplb_dp", worker.REARRANGE_AT
    for rank in range(2):
        got = results[rank][name]
        eager_loads = got["eager"]["loads"]
        assert len(eager_loads) == worker.EPLB_STEPS
        for run in ("reference", "npu_eager", "npu"):
            assert [t.tolist() for t in got[run]["loads"]] == [t.tolist() for t in eager_loads], run
        assert all(t.dtype == torch.int32 for t in got["npu"]["loads"])
    before, after = _eplb_expected_load(worker, at - 1), _eplb_expected_load(worker, at)
    for step in range(worker.EPLB_STEPS):
        total = sum(results[r][name]["npu"]["loads"][step] for r in range(2)).tolist()
        assert total == _eplb_expected_load(worker, step), step
    # Every token picks the hot expert: before, its one replica (slot 4) takes all 2 x TOKENS rows; after, its two
    # replicas (slot 3 on rank 0, slot 6 on rank 1) take half each, and slot 4 counts only expert 3's rows.
    replicas = [p for p, held in enumerate(worker.REARRANGED) if held == worker.HOT]
    assert replicas == [3, 6] and before[4] == 2 * worker.TOKENS, before
    assert [after[p] for p in replicas] == [worker.TOKENS] * 2, after
    for rank in range(2):
        eager, stale = results[rank][name]["eager"]["outs"], results[rank][name]["stale"]["outs"]
        for step in range(worker.EPLB_STEPS):
            if step < at:
                torch.testing.assert_close(stale[step], eager[step])
            else:
                assert not torch.allclose(stale[step], eager[step], atol=1e-3), (rank, step)
