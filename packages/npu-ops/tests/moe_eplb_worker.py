# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""One rank of the dynamic-EPLB rearrangement test (run as a script by test_moe_eplb.py; not a test module).

Usage: python moe_eplb_worker.py <rank> <world> <init_method> <out_file>

Both ranks hold the same tokens (vLLM's default expert parallelism: partial sums, then an all-reduce) and start from
vLLM's initial EPLB placement. One forward on routing skewed towards one expert counts the load; the ranks then do
what ``EplbState.rearrange`` does: all-reduce the load, map it to logical experts, run vLLM's ``rebalance_experts``,
move the weights with vLLM's ``rearrange_expert_weights_inplace`` over gloo (its ``torch.cuda.synchronize`` through
npu-platform's ``cuda_synchronize_as``) and update the replica tables in place. The same plan runs again. Saved:
the maps, the outputs before and after, this rank's local weights and the logical weights.
"""

from __future__ import annotations

import sys

import torch

NUM_EXPERTS, REDUNDANT, TOP_K, HIDDEN, INTER, TOKENS, HOT = 6, 2, 2, 16, 8, 40, 5
WIDTH = 1 + REDUNDANT + 1  # replica-table width (vLLM's is 1024; any width past the largest replica count works)


def logical_weights() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    return w13, w2


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [T, H], router logits [T, E]) skewed towards expert HOT; the same on every rank."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    logits = torch.randn(TOKENS, NUM_EXPERTS, generator=gen)
    logits[:, HOT] += 2.5
    return x, logits


def main(rank: int, world: int, init: str, out_file: str) -> None:
    import torch.distributed as dist
    from vllm.distributed.eplb.rebalance_algo import rebalance_experts
    from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace
    from vllm_npu.ops.moe.eplb import eplb_placement, eplb_tables
    from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
    from vllm_npu.ops.moe.gating import RoutingConfig
    from vllm_npu.platform._device import EmulatedDevice, cuda_synchronize_as

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    placement = eplb_placement(NUM_EXPERTS, REDUNDANT, world)
    initial = placement.physical_to_logical.tolist()
    per_rank = len(initial) // world
    w13_log, w2_log = logical_weights()
    mine = initial[rank * per_rank : (rank + 1) * per_rank]
    w13, w2 = w13_log[mine].clone(), w2_log[mine].clone()
    table, counts = eplb_tables(initial, NUM_EXPERTS, WIDTH)
    load = torch.zeros(len(initial), dtype=torch.int32)
    placement.follow(table, counts, load)
    plan = build_moe_plan(
        RoutingConfig(top_k=TOP_K),
        NUM_EXPERTS,
        act_dtype=torch.float32,
        placement=placement,
        ep_rank=rank,
        backend="reference",
    )
    x, logits = tokens()

    def forward() -> torch.Tensor:
        out = moe_forward(x, logits, plan=plan, experts=plan.unquantized_experts(w13, w2))
        dist.all_reduce(out)
        return out

    before = forward()
    total = load.clone()
    dist.all_reduce(total)
    logical_load = torch.zeros(NUM_EXPERTS, dtype=torch.int64).scatter_add_(0, torch.tensor(initial), total.long())
    new_p2l, new_l2p, new_counts = rebalance_experts(logical_load.unsqueeze(0), len(initial), 1, 1, world)
    with cuda_synchronize_as(EmulatedDevice):
        rearrange_expert_weights_inplace(
            torch.tensor([initial]), new_p2l, [[w13.view(per_rank, -1), w2.view(per_rank, -1)]], dist.group.WORLD
        )
    table.fill_(-1)
    table[:, : new_l2p.shape[-1]].copy_(new_l2p[0])
    counts.copy_(new_counts[0])
    load.zero_()
    after = forward()
    torch.save(
        {
            "initial": initial,
            "new": new_p2l[0].tolist(),
            "before": before,
            "after": after,
            "w13": w13,
            "w2": w2,
            "w13_log": w13_log,
            "w2_log": w2_log,
            "load_total": total,
            "load_after": load.clone(),
        },
        out_file,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
