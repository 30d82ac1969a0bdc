# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""One rank of the MoE-exchange graph tests (run as a script by test_moe_graph_exchange.py; not a test module).

Usage: python moe_graph_worker.py <rank> <world> <init_method> <out_dir>

For every scenario of ``SCENARIOS`` the rank builds one MoE layer (a module holding the plan and its experts, as the
engine holds it) with an expert-parallel exchange over gloo, and runs three steps of the same shapes eagerly with the
reference twins, then compiled as the torchair mode compiles it: the reference twins (``dynamic=False``, the
emulated device's stand-in) and the NPU twins (``dynamic=True``, every tensor marked static) with ``torch_npu``
replaced by opaque custom ops of the documented arguments. The NPU MC2 kernels' stand-ins run the twin's exchange
over gloo and fill the rows the kernel leaves undefined with NaN. Saves outputs, compile counts, the lowered graphs'
ops and symbolic inputs to ``<out_dir>/rank<r>.pt``.

The dynamic-EPLB scenario (kind ``mc2+eplb``): vLLM's initial EPLB placement (``NUM_LOGICAL`` + ``REDUNDANT``
physical experts, 4 slots a rank) whose replica tables and load counter are the layer's EPLB views
(``ExpertPlacement.follow``); before step ``REARRANGE_AT`` both ranks do what ``EplbState.rearrange`` does to them
(the tables and this rank's moved slots' weights rewritten in place, ``copy_``), and the load is zeroed before every
step (vLLM's per-pass load) and saved after it. Its ``stale`` run moves the weights but keeps the old tables: what a
graph that had baked the tables in would compute.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import torch

HIDDEN, INTER, TOKENS, STEPS = 16, 8, 4, 3
GROUP = "hccl_ep_group_0"

# name -> (num_experts, top_k, tokens differ per rank, dispatcher: "mc2" | "gathered")
SCENARIOS: dict[str, tuple[int, int, bool, str]] = {
    "mc2_replicated": (8, 2, False, "mc2"),
    "mc2_dp": (8, 2, True, "mc2"),
    "gathered_dp": (8, 2, True, "gathered"),
    "mc2_over_gathered_dp": (8, 2, True, "mc2+gathered"),  # steps past MC2's capacity: the gathered dispatcher
    "mc2_eplb_dp": (6, 2, True, "mc2+eplb"),  # 6 logical experts + REDUNDANT, dynamic EPLB tables, a rearrangement
}

# Dynamic EPLB: vLLM's initial map is [0, 1, 2, 3, 4, 5, 0, 1] (rank 0's slots [0, 1, 2, 3], rank 1's [4, 5, 0, 1]).
# The rearranged one gives the hot expert HOT two replicas (slots 3 and 6) and expert 0 one: every slot of rank 0
# but slot 3 keeps its expert, three of rank 1's four change, and the replica counts change with them.
REDUNDANT, HOT, REARRANGE_AT, EPLB_STEPS = 2, 4, 2, 4
REARRANGED = [0, 1, 2, 4, 3, 5, 4, 1]

_COMMS: dict[str, Any] = {}
Out7 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def inputs(name: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, logits) of a step; the same on every rank when the ranks hold the same tokens."""
    num_experts, _, differ, kind = SCENARIOS[name]
    gen = torch.Generator().manual_seed(100 * step + (rank if differ else 0))
    x, logits = torch.randn(TOKENS, HIDDEN, generator=gen), torch.randn(TOKENS, num_experts, generator=gen)
    if "eplb" in kind:
        logits[:, HOT] += 3.0  # every token picks the hot expert: its replicas share the load
    return x, logits


def steps(name: str) -> int:
    return EPLB_STEPS if "eplb" in SCENARIOS[name][3] else STEPS


def weights(num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4321)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    return w13, torch.randn(num_experts, HIDDEN, INTER, generator=gen) / INTER**0.5


@functools.cache
def _register_mc2_ops() -> None:
    """``npu_moe_distribute_dispatch_v2`` / ``combine_v2`` as ``torch.ops.npu`` custom ops (the real names, so the
    graph's nodes are the converter table's) with the arguments our dispatcher passes; their bodies are the twin's
    exchange over the group named ``group_ep``, with the rows the kernel leaves undefined set to NaN."""
    from vllm_npu.ops.moe import mc2

    @torch.library.custom_op("npu::npu_moe_distribute_dispatch_v2", mutates_args=())
    def dispatch(
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        group_ep: str,
        ep_world_size: int,
        ep_rank_id: int,
        moe_expert_num: int,
        group_tp: str,
        tp_world_size: int,
        tp_rank_id: int,
        expert_shard_type: int,
        shared_expert_rank_num: int,
        quant_mode: int,
        global_bs: int,
        expert_token_nums_type: int,
    ) -> Out7:
        comm = _COMMS[group_ep]
        assert (ep_world_size, ep_rank_id) == (comm.world, comm.rank) and expert_ids.dtype == torch.int32
        assert expert_shard_type == 0 and shared_expert_rank_num == 0 and expert_token_nums_type == 1
        d = mc2._dispatch_exchange(x, expert_ids, comm, moe_expert_num, global_bs, quant_mode == 2)
        n = int(d.expert_token_nums.sum())
        expand_x = d.expand_x.clone()
        expand_x[n:] = float("nan")  # undefined past the received rows
        return (expand_x, *(t.clone() for t in d[1:]))  # type: ignore[return-value]

    dispatch.register_fake(
        lambda x, ids, group, world, rank, num, gtp, tpw, tpr, shard, shared, quant, global_bs, counts_type: (
            mc2.dispatch_outputs_like(x, ids, world, num, global_bs, quant == 2)
        )
    )

    @torch.library.custom_op("npu::npu_moe_distribute_combine_v2", mutates_args=())
    def combine(
        expand_x: torch.Tensor,
        expert_ids: torch.Tensor,
        assist_info_for_combine: torch.Tensor,
        ep_send_counts: torch.Tensor,
        expert_scales: torch.Tensor,
        group_ep: str,
        ep_world_size: int,
        ep_rank_id: int,
        moe_expert_num: int,
        group_tp: str,
        tp_world_size: int,
        global_bs: int,
    ) -> torch.Tensor:
        comm = _COMMS[group_ep]
        assert expert_scales.dtype == torch.float32 and expert_ids.dtype == torch.int32
        return mc2._combine_exchange(expand_x, expert_ids, ep_send_counts, expert_scales, comm, moe_expert_num)

    combine.register_fake(lambda x, ids, *rest: x.new_empty(ids.shape[0], x.shape[1]))


@functools.cache
def fake_torch_npu() -> types.ModuleType:
    """The testkit's stand-in ``torch_npu`` (gating, routing, grouped matmul, swiglu, finalize) plus MC2."""
    from npu_testkit.fake_torch_npu import fake_torch_npu as moe_fake

    base = moe_fake(checked=False)
    _register_mc2_ops()
    ops = torch.ops.npu
    m = types.ModuleType("torch_npu")
    m.__dict__.update({k: v for k, v in base.__dict__.items() if k.startswith("npu_")})

    def npu_moe_distribute_dispatch_v2(
        x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, group_tp="", tp_world_size=0,
        tp_rank_id=0, expert_shard_type=0, shared_expert_rank_num=0, quant_mode=0, global_bs=0,
        expert_token_nums_type=1, **kw,
    ):  # fmt: skip
        assert all(v is None for v in kw.values()), kw
        return ops.npu_moe_distribute_dispatch_v2(
            x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, group_tp, tp_world_size,
            tp_rank_id, expert_shard_type, shared_expert_rank_num, quant_mode, global_bs, expert_token_nums_type,
        )  # fmt: skip

    def npu_moe_distribute_combine_v2(
        expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, group_ep, ep_world_size,
        ep_rank_id, moe_expert_num, *, tp_send_counts=None, expand_scales=None, group_tp="", tp_world_size=0,
        tp_rank_id=0, expert_shard_type=0, shared_expert_rank_num=0, global_bs=0,
    ):  # fmt: skip
        assert expert_shard_type == 0 and shared_expert_rank_num == 0
        return ops.npu_moe_distribute_combine_v2(
            expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, group_ep, ep_world_size,
            ep_rank_id, moe_expert_num, group_tp, tp_world_size, global_bs,
        )  # fmt: skip

    m.npu_moe_distribute_dispatch_v2 = npu_moe_distribute_dispatch_v2  # type: ignore[attr-defined]
    m.npu_moe_distribute_combine_v2 = npu_moe_distribute_combine_v2  # type: ignore[attr-defined]
    return m


class Layer(torch.nn.Module):
    def __init__(self, plan: Any, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.moe_plan = plan
        self.w13 = torch.nn.Parameter(w13, requires_grad=False)
        self.w2 = torch.nn.Parameter(w2, requires_grad=False)
        #: The EPLB views (replica table, replica counts, load), when the placement follows them.
        self.eplb: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def rearrange(self, physical_to_logical: list[int], rank: int, *, tables: bool = True) -> None:
        """What ``EplbState.rearrange`` does to this rank: the tables and the moved slots' weights, in place."""
        from vllm_npu.ops.moe.eplb import eplb_tables

        assert self.eplb is not None
        table, counts, _ = self.eplb
        if tables:
            new_table, new_counts = eplb_tables(physical_to_logical, int(table.shape[0]), int(table.shape[1]))
            table.copy_(new_table)
            counts.copy_(new_counts)
        w13, w2 = weights(int(table.shape[0]))
        per = self.w13.shape[0]
        mine = physical_to_logical[rank * per : (rank + 1) * per]
        self.w13.copy_(w13[mine])
        self.w2.copy_(w2[mine])

    def forward(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        from vllm_npu.ops.moe.forward import moe_forward

        return moe_forward(x, logits, plan=self.moe_plan, experts=self.moe_plan.unquantized_experts(self.w13, self.w2))


def build_layer(name: str, rank: int, world: int, backend: str) -> Layer:
    from vllm_npu.ops.moe.comm import torch_all_to_all
    from vllm_npu.ops.moe.eplb import eplb_placement, eplb_tables
    from vllm_npu.ops.moe.forward import build_moe_plan
    from vllm_npu.ops.moe.gating import RoutingConfig
    from vllm_npu.ops.moe.mc2 import MC2Comm
    from vllm_npu.ops.moe.placement import ExpertPlacement

    num_experts, top_k, differ, kind = SCENARIOS[name]
    eplb = None
    if "eplb" in kind:
        placement = eplb_placement(num_experts, REDUNDANT, world)
        table, counts = eplb_tables(placement.physical_to_logical.tolist(), num_experts)
        eplb = (table, counts, torch.zeros(placement.num_physical, dtype=torch.int32))
        placement.follow(*eplb)
        slots = placement.slots
    else:
        per = num_experts // world
        slots = [list(range(r * per, (r + 1) * per)) for r in range(world)]
        placement = ExpertPlacement(num_experts, slots)
    exchange = torch_all_to_all(torch.distributed.group.WORLD)
    kwargs: dict[str, Any] = dict(act_dtype=torch.float32, placement=placement, ep_rank=rank, backend=backend)
    if differ:
        if "gathered" in kind:
            kwargs["gather_group"] = torch.distributed.group.WORLD
        else:
            kwargs["all_to_all"] = exchange
    if kind.startswith("mc2"):
        comm = MC2Comm(rank, world, exchange, GROUP if backend == "npu" else "", "A2")
        _COMMS[GROUP] = comm
        kwargs.update(mc2=comm, mc2_capacity=TOKENS // 2 if kind == "mc2+gathered" else 2 * TOKENS)
    plan = build_moe_plan(RoutingConfig(top_k=top_k), num_experts, **kwargs)
    w13, w2 = weights(num_experts)
    mine = torch.tensor(slots[rank])
    layer = Layer(plan, w13[mine], w2[mine])
    layer.eplb = eplb
    return layer


def run(name: str, rank: int, world: int, backend: str, compiled: bool, *, stale: bool = False) -> dict[str, Any]:
    from npu_testkit.torchair_converters import compile_lowered, fresh_dynamo_imports

    layer = build_layer(name, rank, world, backend)
    fn, graphs = compile_lowered(layer, dynamic=backend == "npu") if compiled else (layer, [])
    outs, loads = [], []
    with torch.no_grad(), fresh_dynamo_imports():
        for step in range(steps(name)):
            if layer.eplb is not None:
                if step == REARRANGE_AT:
                    layer.rearrange(REARRANGED, rank, tables=not stale)
                layer.eplb[2].zero_()  # vLLM's per-pass load
            x, logits = inputs(name, rank, step)
            if compiled and backend == "npu":  # the torchair wrapper's NPU strategy: dynamic, tensors static
                for t in (x, logits, layer.w13, layer.w2):
                    torch._dynamo.mark_static(t)
            outs.append(fn(x, logits))
            if layer.eplb is not None:
                loads.append(layer.eplb[2].clone())
    from npu_testkit.torchair_converters import graph_ops, symbolic_inputs

    return {
        "outs": outs,
        "loads": loads,
        "compiles": len(graphs),
        "ops": sorted(set().union(*(graph_ops(g) for g in graphs))) if graphs else [],
        "symbolic": [s for g in graphs for s in symbolic_inputs(g)],
    }


def main() -> None:
    rank, world, init, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results: dict[str, Any] = {}
    for name in SCENARIOS:
        results[name] = {"eager": run(name, rank, world, "reference", compiled=False)}
        results[name]["reference"] = run(name, rank, world, "reference", compiled=True)
        if "eplb" in SCENARIOS[name][3]:
            results[name]["stale"] = run(name, rank, world, "reference", compiled=False, stale=True)
        sys.modules["torch_npu"] = fake_torch_npu()
        try:
            results[name]["npu_eager"] = run(name, rank, world, "npu", compiled=False)
            results[name]["npu"] = run(name, rank, world, "npu", compiled=True)
        finally:
            del sys.modules["torch_npu"]
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
