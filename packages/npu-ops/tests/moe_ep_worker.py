# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""One rank of the expert-parallel all-to-all test (run as a script by test_moe_ep.py; not a test module).

Usage: python moe_ep_worker.py <rank> <world> <init_method> <out_dir> <comm: torch|npu>

Every rank builds the same global expert weights, its own tokens (different per rank), runs moe_forward with the
all-to-all dispatcher over gloo for each scenario of ``SCENARIOS``, and saves ``{name: output}`` to
``<out_dir>/rank<r>.pt``. Inputs are deterministic (``inputs``), so the test recomputes them in one process.
"""

from __future__ import annotations

import sys

import torch

HIDDEN, INTER = 16, 8

# name -> (num_experts, tokens per rank, routing kwargs, placement)
SCENARIOS: dict[str, tuple[int, list[int], dict, str]] = {
    "softmax_top2_linear_uneven": (7, [9, 4], {"top_k": 2}, "linear"),
    "grouped_bias_top3_round_robin": (
        12,
        [5, 6],
        {
            "top_k": 3,
            "use_grouped_topk": True,
            "num_expert_group": 4,
            "topk_group": 2,
            "scoring_func": "sigmoid",
            "routed_scaling_factor": 2.0,
            "has_correction_bias": True,
        },
        "round_robin",
    ),
    "top1_one_rank_empty": (4, [3, 0], {"top_k": 1, "renormalize": False}, "linear"),
}


def inputs(name: str, rank: int):
    """(w13, w2, bias, x, logits) of scenario ``name`` on ``rank`` (weights and bias shared by all ranks)."""
    num_experts, tokens, _, _ = SCENARIOS[name]
    gen = torch.Generator().manual_seed(1234)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) / INTER**0.5
    bias = torch.rand(num_experts, generator=gen) * 0.2
    gen_r = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens[rank], HIDDEN, generator=gen_r)
    logits = torch.randn(tokens[rank], num_experts, generator=gen_r)
    return w13, w2, bias, x, logits


def expert_maps(num_experts: int, world: int, placement: str) -> list[torch.Tensor]:
    """vLLM's placement (determine_expert_map's rules), written out so the worker need not import vLLM."""
    maps = []
    base, rem = divmod(num_experts, world)
    for r in range(world):
        m = torch.full((num_experts,), -1, dtype=torch.int32)
        if placement == "linear":
            n = base + (1 if r < rem else 0)
            start = r * base + min(r, rem)
            m[start : start + n] = torch.arange(n, dtype=torch.int32)
        else:
            ids = torch.arange(r, num_experts, world)
            m[ids] = torch.arange(ids.numel(), dtype=torch.int32)
        maps.append(m)
    return maps


def main() -> None:
    rank, world, init, out_dir, comm = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    import torch.distributed as dist
    from vllm_npu.ops.moe.comm import coordinator_all_to_all, torch_all_to_all
    from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
    from vllm_npu.ops.moe.gating import RoutingConfig

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = dist.group.WORLD
    if comm == "npu":
        from types import SimpleNamespace

        from vllm_npu.platform.communicator import NPUCommunicator

        coordinator = SimpleNamespace(
            device_communicator=NPUCommunicator(group, torch.device("cpu"), group, "ep"), device_group=group
        )
        all_to_all = coordinator_all_to_all(coordinator)
    else:
        all_to_all = torch_all_to_all(group)
    results = {}
    for name, (num_experts, _, routing, placement) in SCENARIOS.items():
        w13, w2, bias, x, logits = inputs(name, rank)
        maps = expert_maps(num_experts, world, placement)
        local = (maps[rank] >= 0).nonzero().flatten()[maps[rank][maps[rank] >= 0].argsort()]
        plan = build_moe_plan(
            RoutingConfig(**routing),
            num_experts,
            act_dtype=torch.float32,
            all_to_all=all_to_all,
            ep_rank=rank,
            expert_maps=maps,
            backend="reference",
        )
        out = moe_forward(
            x,
            logits,
            plan=plan,
            experts=plan.unquantized_experts(w13[local], w2[local]),
            e_score_correction_bias=bias if routing.get("has_correction_bias") else None,
        )
        results[name] = out
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
