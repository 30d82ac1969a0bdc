# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""One rank of the MC2 tests (run as a script by test_moe_mc2.py; not a test module).

Usage: python moe_mc2_worker.py <rank> <world> <init_method> <out_dir>

For every scenario of ``SCENARIOS`` the rank builds the same global expert weights and its tokens (different per
rank, or the same on every rank for the ``replicated`` ones), runs the MoE through MC2's reference twin over gloo
and through the all-to-all (or local) dispatcher, and saves outputs and the raw MC2 dispatch results to
``<out_dir>/rank<r>.pt``. Inputs are deterministic (``inputs``), so the test recomputes them in one process.
"""

from __future__ import annotations

import sys

import torch

HIDDEN, INTER = 16, 8

# name -> (num_experts, tokens per rank, top_k, slots per rank or None for vLLM's linear split, replicated tokens)
SCENARIOS: dict[str, tuple[int, list[int], int, list[list[int]] | None, bool]] = {
    "uneven_tokens": (8, [9, 4], 2, None, False),
    "rank1_no_tokens": (8, [3, 0], 2, None, False),
    "swapped_redundant": (6, [7, 5], 2, [[3, 1, 5, 0], [2, 4, 0, 3]], False),
    "replicated_tokens": (8, [11, 11], 3, None, True),
    "replicated_one_token": (6, [1, 1], 2, [[3, 1, 5, 0], [2, 4, 0, 3]], True),
}


def inputs(name: str, rank: int):
    """(w13, w2, x, logits) of scenario ``name`` on ``rank`` (weights shared by all ranks)."""
    num_experts, tokens, _, _, replicated = SCENARIOS[name]
    gen = torch.Generator().manual_seed(4321)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) / INTER**0.5
    gen_r = torch.Generator().manual_seed(200 + (0 if replicated else rank))
    x = torch.randn(tokens[rank], HIDDEN, generator=gen_r)
    logits = torch.randn(tokens[rank], num_experts, generator=gen_r)
    return w13, w2, x, logits


def placement_of(name: str, world: int):
    from vllm_npu.ops.moe.placement import ExpertPlacement

    num_experts, _, _, slots, _ = SCENARIOS[name]
    if slots is None:
        per = num_experts // world
        slots = [list(range(r * per, (r + 1) * per)) for r in range(world)]
    return ExpertPlacement(num_experts, slots)


def main() -> None:
    rank, world, init, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    import torch.distributed as dist
    from vllm_npu.ops.moe.comm import torch_all_to_all
    from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
    from vllm_npu.ops.moe.gating import RoutingConfig
    from vllm_npu.ops.moe.mc2 import MC2Comm, mc2_dispatch_reference

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    all_to_all = torch_all_to_all(dist.group.WORLD)
    comm = MC2Comm(rank, world, all_to_all)
    results: dict[str, object] = {}
    for name, (num_experts, _, top_k, _, replicated) in SCENARIOS.items():
        w13, w2, x, logits = inputs(name, rank)
        placement = placement_of(name, world)
        mine = torch.tensor(placement.slots[rank])
        routing = RoutingConfig(top_k=top_k)
        common = dict(act_dtype=torch.float32, placement=placement, ep_rank=rank, backend="reference")
        exchange = None if replicated else all_to_all
        other = build_moe_plan(routing, num_experts, all_to_all=exchange, **common)
        mc2 = build_moe_plan(routing, num_experts, all_to_all=exchange, mc2=comm, mc2_capacity=16, **common)
        experts = other.unquantized_experts(w13[mine], w2[mine])
        results[name] = {
            "other": moe_forward(x, logits, plan=other, experts=experts),
            "mc2": moe_forward(x, logits, plan=mc2, experts=experts),
            "calls": dict(mc2.dispatcher.calls),
        }
        if name == "uneven_tokens":  # the raw kernel outputs, checked against a brute-force exchange
            topk_ids = torch.topk(logits, top_k, dim=-1).indices
            d = mc2_dispatch_reference(x, topk_ids, comm, num_experts, 16 * world, False)
            dq = mc2_dispatch_reference(x, topk_ids, comm, num_experts, 16 * world, True)
            results["dispatch"] = {"plain": d._asdict(), "quant": dq._asdict(), "topk_ids": topk_ids}
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
