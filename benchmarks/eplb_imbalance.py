# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Dynamic EPLB: expert-load imbalance (max / mean load per EP rank) before and after vLLM's rebalancing.

Single process, no timing (the numbers are counts, so the run is deterministic). A skewed router (Zipf-like logits
bias, expert 0 hottest) routes ``--tokens`` tokens per step through npu-ops' local dispatcher on each of
``--ranks`` expert-parallel ranks holding the same tokens (vLLM's default EP), with vLLM's initial EPLB placement
(``--redundant`` redundant experts) and the placement following vLLM-shaped EplbState tables:

- ``before``: the load the dispatchers counted (``ExpertPlacement.load``) on ``--steps`` steps, per rank;
- rebalance: what ``EplbState.rearrange`` does with that window: sum over ranks, map physical -> logical, vLLM's
  ``rebalance_experts`` (one node, one expert group), tables updated in place;
- ``after``: the same number of fresh steps from the same router distribution through the same plans.

Reported: max/mean of the per-rank load (1.0 is perfect balance), both phases, and the new physical -> logical map.

Run: ``.venv/bin/python benchmarks/eplb_imbalance.py [--experts 16] [--redundant 4] [--ranks 4] [--tokens 512]
[--steps 4] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

HIDDEN, INTER, TOP_K = 32, 16, 2


def run(experts: int, redundant: int, ranks: int, tokens: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """Counted load imbalance before and after one rebalance (see the module docstring)."""
    import torch
    from vllm.distributed.eplb.rebalance_algo import rebalance_experts
    from vllm_npu.ops.moe.eplb import eplb_placement, eplb_tables
    from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
    from vllm_npu.ops.moe.gating import RoutingConfig

    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(experts, HIDDEN, INTER, generator=gen) / INTER**0.5
    skew = -torch.log(torch.arange(1, experts + 1, dtype=torch.float32)) * 1.5
    initial = eplb_placement(experts, redundant, ranks).physical_to_logical.tolist()
    table, counts = eplb_tables(initial, experts, redundant + 2)  # shared by the ranks, as one EplbState's values
    per_rank = len(initial) // ranks
    placements, plans = [], []
    for r in range(ranks):
        place = eplb_placement(experts, redundant, ranks)
        place.follow(table, counts, torch.zeros(len(initial), dtype=torch.int32))
        placements.append(place)
        plans.append(
            build_moe_plan(
                RoutingConfig(top_k=TOP_K),
                experts,
                act_dtype=torch.float32,
                placement=place,
                ep_rank=r,
                backend="reference",
            )
        )

    def phase(physical_to_logical: list[int]) -> float:
        for place in placements:
            assert place.load is not None
            place.load.zero_()
        for _ in range(steps):
            x = torch.randn(tokens, HIDDEN, generator=gen)
            logits = torch.randn(tokens, experts, generator=gen) + skew
            for r, plan in enumerate(plans):
                mine = physical_to_logical[r * per_rank : (r + 1) * per_rank]
                moe_forward(x, logits, plan=plan, experts=plan.unquantized_experts(w13[mine], w2[mine]))
        load = torch.stack([p.load for p in placements if p.load is not None]).sum(0).float()
        per = load.view(ranks, per_rank).sum(1)
        return float(per.max() / per.mean())

    before = phase(initial)
    window = torch.stack([p.load for p in placements if p.load is not None]).sum(0).long()
    logical = torch.zeros(experts, dtype=torch.long).scatter_add_(0, torch.tensor(initial), window)
    new_p2l, new_l2p, new_counts = rebalance_experts(logical.unsqueeze(0), len(initial), 1, 1, ranks)
    table.fill_(-1)
    table[:, : new_l2p.shape[-1]].copy_(new_l2p[0])
    counts.copy_(new_counts[0])
    after_map = new_p2l[0].tolist()
    after = phase(after_map)
    return {
        "experts": experts,
        "redundant": redundant,
        "ranks": ranks,
        "tokens_per_step": tokens,
        "steps": steps,
        "before": before,
        "after": after,
        "initial_map": initial,
        "rebalanced_map": after_map,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--redundant", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    res = run(args.experts, args.redundant, args.ranks, args.tokens, args.steps)
    print(
        f"EPLB expert load max/mean over {args.ranks} ranks ({args.experts} experts + {args.redundant} redundant, "
        f"{args.steps} x {args.tokens} skewed tokens): before {res['before']:.3f}, after rebalancing "
        f"{res['after']:.3f}"
    )
    print(f"rebalanced physical -> logical map: {res['rebalanced_map']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
