# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Emulated MoE layer time per token dispatcher on 2 ranks (gloo), and expert-load imbalance with a rebalanced
static placement.

Dispatchers (``moe_forward`` with the reference kernels, 2 spawned processes, gloo):

- ``local``: both ranks hold the same tokens and run their own experts (partial sums; the all-reduce that vLLM
  runs afterwards is included: ``all_reduce`` over gloo);
- ``all_to_all``: each rank holds its own tokens; rows go to their experts' ranks and back;
- ``mc2``: the same through MC2's reference twin (three all-to-alls per dispatch, one per combine);
- ``mc2_replicated``: same tokens on both ranks, each sends its half through MC2, plus the all-reduce.

Timing: median of ``--repeats`` calls after a warm-up, ms per call, rank 0's wall time. These are emulated-device
numbers (CPU, gloo): they show the twins' costs, not an NPU's.

Imbalance (single process, no timing): a skewed router (Zipf-like logits bias) over ``--imbalance-tokens`` tokens;
load per rank = routed rows its slots receive. ``before``: vLLM's linear placement; ``after``: a static placement
(``npu.expert_map_path``-style) that gives the hottest experts a replica on the other rank, with the replica choice of
:class:`vllm_npu.ops.moe.placement.ExpertPlacement`. Reported as max / mean load over ranks.

Run: ``.venv/bin/python benchmarks/moe_dispatch.py [--tokens 1,16,256] [--repeats 5] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from _timing import median_ms

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

SHAPE = dict(num_experts=16, hidden=512, inter=256, top_k=4)


def _rank(rank: int, init: str, tokens: list[int], repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from vllm_npu.ops.moe.comm import torch_all_to_all
    from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
    from vllm_npu.ops.moe.gating import RoutingConfig
    from vllm_npu.ops.moe.mc2 import MC2Comm
    from vllm_npu.ops.moe.placement import ExpertPlacement

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    e, h, i, k = SHAPE["num_experts"], SHAPE["hidden"], SHAPE["inter"], SHAPE["top_k"]
    gen = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5, torch.randn(e, h, i, generator=gen) / i**0.5
    place = ExpertPlacement(e, [list(range(r * e // 2, (r + 1) * e // 2)) for r in range(2)])
    mine = torch.tensor(place.slots[rank])
    a2a = torch_all_to_all(dist.group.WORLD)
    comm = MC2Comm(rank, 2, a2a)
    routing = RoutingConfig(top_k=k)
    common = dict(act_dtype=torch.float32, placement=place, ep_rank=rank, backend="reference")
    plans = {
        "local": (build_moe_plan(routing, e, **common), True),
        "all_to_all": (build_moe_plan(routing, e, all_to_all=a2a, **common), False),
        "mc2": (build_moe_plan(routing, e, all_to_all=a2a, mc2=comm, mc2_capacity=max(tokens), **common), False),
        "mc2_replicated": (build_moe_plan(routing, e, mc2=comm, mc2_capacity=max(tokens), **common), True),
    }
    results: dict[str, dict[int, float]] = {}
    for name, (plan, replicated) in plans.items():
        experts = plan.unquantized_experts(w13[mine], w2[mine])
        results[name] = {}
        for t in tokens:
            g = torch.Generator().manual_seed(t if replicated else 1000 * rank + t)
            x, logits = torch.randn(t, h, generator=g), torch.randn(t, e, generator=g)

            def step() -> None:
                y = moe_forward(x, logits, plan=plan, experts=experts)
                if replicated:
                    dist.all_reduce(y)

            dist.barrier()
            results[name][t] = median_ms(step, repeats)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def imbalance(num_tokens: int, hot: int = 2) -> dict[str, float]:
    """max/mean per-rank load under a skewed router, before and after giving the ``hot`` hottest experts replicas."""
    import torch
    from vllm_npu.ops.moe.placement import ExpertPlacement

    e, k = SHAPE["num_experts"], SHAPE["top_k"]
    gen = torch.Generator().manual_seed(1)
    skew = -torch.log(torch.arange(1, e + 1, dtype=torch.float32)) * 2.0  # expert 0 hottest
    ids = torch.topk(torch.randn(num_tokens, e, generator=gen) + skew, k, dim=-1).indices
    counts = torch.bincount(ids.reshape(-1), minlength=e)

    def ratio(place: ExpertPlacement) -> float:
        physical = place.choose(ids)
        load = torch.bincount(physical.reshape(-1), minlength=place.num_physical).float()
        per_rank = torch.stack([load[o : o + n].sum() for o, n in zip(place.offsets, place.local_counts)])
        return float(per_rank.max() / per_rank.mean())

    before = ExpertPlacement(e, [list(range(0, e // 2)), list(range(e // 2, e))])
    hottest = counts.argsort(descending=True)[:hot].tolist()
    # keep each rank at the same slot count: every rank gets replicas of the hottest experts it does not hold
    slots = [list(s) for s in before.slots]
    for r in range(2):
        slots[r] += [x for x in hottest if x not in slots[r]]
    width = max(len(s) for s in slots)
    for r in range(2):  # pad the shorter rank with replicas of the next-hottest experts it lacks
        for x in counts.argsort(descending=True).tolist():
            if len(slots[r]) >= width:
                break
            if x not in slots[r]:
                slots[r].append(x)
    after = ExpertPlacement(e, slots)
    return {"before": ratio(before), "after": ratio(after), "hot_experts": hottest, "slots_after": slots}  # type: ignore[dict-item]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,16,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--imbalance-tokens", type=int, default=4096)
    ap.add_argument("--json")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_rank, args=(f"file://{tmp}/pg", tokens, args.repeats, out), nprocs=2, join=True)
        with open(out) as f:
            times = json.load(f)
    print(f"MoE layer, 2 ranks gloo, {SHAPE}, ms per call (median of {args.repeats}):")
    print(f"{'dispatcher':16s}" + "".join(f"{t:>10d}" for t in tokens))
    for name, row in times.items():
        print(f"{name:16s}" + "".join(f"{row[str(t)]:10.2f}" for t in tokens))
    imb = imbalance(args.imbalance_tokens)
    print(
        f"expert load max/mean over ranks ({args.imbalance_tokens} skewed tokens): before {imb['before']:.3f}, "
        f"after replicating experts {imb['hot_experts']}: {imb['after']:.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"times_ms": times, "imbalance": imb}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
