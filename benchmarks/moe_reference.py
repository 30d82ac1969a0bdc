# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Time of npu-ops' reference MoE (the emulated device's kernels) at decode and prefill sizes.

For each token count it times, with the reference kernels on the CPU (``torch.set_num_threads(--threads)``):

- ``gate``: router logits -> top-k weights/ids (softmax top-k, or the DeepSeek-V3 grouped top-k with bias);
- ``route``: init_routing (stable sort by expert, gather rows, counts);
- ``experts``: grouped matmul (w13) + swiglu + grouped matmul (w2) over the sorted rows;
- ``combine``: unpermute (weighted sum back per token);
- ``total``: ``moe_forward`` end to end;
- ``vllm_cpu``: vLLM's own pure-torch CPU MoE (``cpu_fused_moe.CPUFusedMOE``: same routing, per-expert loop), the
  reference point for what a CPU MoE costs in vLLM itself.

Timing: median of ``--repeats`` runs after a warm-up, in milliseconds per call. This is a reference-kernel
measurement (emulated device), not an NPU number.

Run: ``.venv/bin/python benchmarks/moe_reference.py [--router softmax|deepseek] [--dtype float32|bfloat16]
[--tokens 1,8,32,512,2048] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from _timing import median_ms

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

# A scaled-down Qwen3-MoE / DeepSeek-V3 layer that fits a laptop: 64 experts, hidden 1024, expert width 512.
SHAPES = {
    "softmax": dict(num_experts=64, hidden=1024, inter=512, top_k=8),
    "deepseek": dict(num_experts=64, hidden=1024, inter=512, top_k=6, groups=8, topk_group=4),
}


def _time_parts(
    plan: Any, experts: Any, vllm_moe: Any, layer: Any, cfg: Any, x: Any, logits: Any, bias: Any, repeats: int = 5
) -> dict[str, float]:
    from vllm_npu.ops.moe import routing as rt
    from vllm_npu.ops.moe.forward import moe_forward

    e, k = plan.num_experts, cfg.top_k
    w, ids = plan.gate(x, logits, bias)
    rows, row_idx, counts = rt.init_routing_reference(x, ids, e, (0, e))
    y = experts(rows, counts)
    return {
        "gate": median_ms(lambda: plan.gate(x, logits, bias), repeats),
        "route": median_ms(lambda: rt.init_routing_reference(x, ids, e, (0, e)), repeats),
        "experts": median_ms(lambda: experts(rows, counts), repeats),
        "combine": median_ms(lambda: rt.unpermute_reference(y, row_idx, w), repeats),
        "total": median_ms(
            lambda: moe_forward(x, logits, plan=plan, experts=experts, e_score_correction_bias=bias), repeats
        ),
        "vllm_cpu": median_ms(
            lambda: vllm_moe(
                layer,
                x,
                cfg.use_grouped_topk,
                k,
                logits,
                True,
                topk_group=cfg.topk_group,
                num_expert_group=cfg.num_expert_group,
                global_num_experts=e,
                scoring_func=cfg.scoring_func,
                routed_scaling_factor=cfg.routed_scaling_factor,
                e_score_correction_bias=bias,
            ),
            repeats,
        ),
    }


def bench(router: str, dtype_name: str, tokens: list[int], repeats: int) -> list[dict[str, Any]]:
    import torch
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import CPUFusedMOE
    from vllm_npu.ops.moe.forward import build_moe_plan
    from vllm_npu.ops.moe.gating import RoutingConfig

    dtype = getattr(torch, dtype_name)
    s = SHAPES[router]
    e, h, i, k = s["num_experts"], s["hidden"], s["inter"], s["top_k"]
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype)
    bias = torch.rand(e, generator=gen) * 0.1 if router == "deepseek" else None
    if router == "deepseek":
        cfg = RoutingConfig(
            top_k=k,
            renormalize=True,
            use_grouped_topk=True,
            num_expert_group=s["groups"],
            topk_group=s["topk_group"],
            scoring_func="sigmoid",
            routed_scaling_factor=2.5,
            has_correction_bias=True,
        )
    else:
        cfg = RoutingConfig(top_k=k, renormalize=True)
    plan = build_moe_plan(cfg, e, act_dtype=dtype, backend="reference")
    experts = plan.unquantized_experts(w13, w2)
    layer = type("L", (), {"w13_weight": w13, "w2_weight": w2})()
    vllm_moe = CPUFusedMOE(layer)
    rows_out = []
    for t in tokens:
        x = torch.randn(t, h, generator=gen).to(dtype)
        logits = torch.randn(t, e, generator=gen).to(dtype)
        with torch.no_grad():
            res = {
                "router": router,
                "dtype": dtype_name,
                "tokens": t,
                **_time_parts(plan, experts, vllm_moe, layer, cfg, x, logits, bias, repeats),
            }
        rows_out.append(res)
        print(
            f"{router:8s} {dtype_name:8s} T={t:5d}  "
            + "  ".join(
                f"{key}={res[key]:8.2f}" for key in ("gate", "route", "experts", "combine", "total", "vllm_cpu")
            )
            + "  (ms)",
            flush=True,
        )
    return rows_out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--router", choices=sorted(SHAPES), action="append")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", default="1,8,32,512,2048", help="comma-separated token counts (decode .. prefill)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    results = []
    for router in args.router or sorted(SHAPES):
        results += bench(router, args.dtype, tokens, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "shapes": SHAPES, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
