# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Milliseconds per call of the paged-decode reference twin (the emulated device's ``_npu_paged_attention``), issue 35.

The cache is laid out as in an engine: vLLM's per-layer ``[2, num_blocks, block_size, Nkv, D]`` tensor unbound into
K and V, ``--block-size`` tokens a block (16: the emulated device's default, vLLM's; 128: the NPU's). Pages are
either ``runs`` (each request's blocks consecutive and the requests one after another: a batch of prompts prefilled
together, before prefix-cache hits and decode growth interleave blocks) or ``shuffled`` (every block anywhere: what
an engine's table looks like after a while). Head shapes: ``tiny`` (4 query / 2 KV heads of 32, the tiny Qwen2 of
benchmarks/_vs_sizes.py) and ``100m`` (12 / 4 heads of 64). Each row: B requests of L cached tokens (with
``--mixed`` request ``b`` has ``L * (b + 1) / B``), the twin's median CPU ms per call over ``--repeats`` calls after
a warm-up, with the step's :class:`DecodePlan` built outside the timing (the metadata builder's, shared by every
layer of a step; its per-block-table memos are cleared before each call, as a new step's plan starts empty) and the
builder's :class:`PageScratch` kept across calls (as the builder keeps it across steps); and the same attention by
one ``scaled_dot_product_attention`` on contiguous ``[B, Nkv, L, D]`` K/V (no paging, no gather: a floor, not a
goal). CPU time (``time.process_time``, one thread): a loaded host inflates wall time, not CPU time.

Run: ``.venv/bin/python benchmarks/paged_decode_twin.py [--lengths 128,1024,8192] [--batches 1,16] [--json out.json]``
Reference kernels only: not an NPU number.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from _timing import median_cpu_ms

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

SHAPES = {"tiny": (4, 2, 32), "100m": (12, 4, 64)}


def make_case(
    torch: Any, b: int, lens: list[int], nkv: int, d: int, layout: str, gen: Any, block: int
) -> tuple[Any, ...]:
    """(key_cache, value_cache, block_table, k, v): the caches unbound from one ``[2, blocks, block, Nkv, D]``
    tensor, and each request's contiguous K/V ``[B, Lmax, Nkv, D]`` (zero past its length)."""
    per = [-(-n // block) for n in lens]
    width = max(per)
    total = sum(per) + 1  # block 0: vLLM's null block
    order = torch.arange(1, total) if layout == "runs" else torch.randperm(total - 1, generator=gen) + 1
    table = torch.zeros(b, width, dtype=torch.int32)
    kv = torch.zeros(2, total, block, nkv, d)
    lmax = max(lens)
    k, v = torch.zeros(b, lmax, nkv, d), torch.zeros(b, lmax, nkv, d)
    used = 0
    for i, n in enumerate(lens):
        blocks = order[used : used + per[i]]
        used += per[i]
        table[i, : per[i]] = blocks.to(torch.int32)
        k[i, :n], v[i, :n] = torch.randn(n, nkv, d, generator=gen), torch.randn(n, nkv, d, generator=gen)
        pad = per[i] * block
        kv[0, blocks.long()] = torch.nn.functional.pad(k[i, :n], (0, 0, 0, 0, 0, pad - n)).view(per[i], block, nkv, d)
        kv[1, blocks.long()] = torch.nn.functional.pad(v[i, :n], (0, 0, 0, 0, 0, pad - n)).view(per[i], block, nkv, d)
    key_cache, value_cache = kv.unbind(0)
    return key_cache, value_cache, table, k, v


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    from vllm_npu.attention.ops.paged_attention import DecodePlan, PageScratch, paged_decode_reference

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows: list[dict[str, Any]] = []
    scratch = PageScratch()
    for shape in args.shapes.split(","):
        n, nkv, d = SHAPES[shape]
        scale = d**-0.5
        for layout in args.layouts.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                for length in (int(x) for x in args.lengths.split(",")):
                    lens = [max(2, length * (i + 1) // b) for i in range(b)] if args.mixed else [length] * b
                    kc, vc, table, k, v = make_case(torch, b, lens, nkv, d, layout, gen, args.block_size)
                    q = torch.randn(b, n, d, generator=gen)
                    out = torch.empty_like(q)
                    plan = DecodePlan.build(lens, args.block_size, q.device, scratch)

                    def twin() -> None:
                        plan._pages.clear()  # a new step's plan: nothing memoized yet
                        plan._runs.clear()
                        paged_decode_reference(
                            q, kc, vc, table, lens, num_heads=n, num_kv_heads=nkv, scale=scale, out=out, plan=plan
                        )

                    ms = median_cpu_ms(twin, args.repeats)
                    # the floor: one fused SDPA over contiguous K/V (GQA folded into the query rows, as the twin
                    # does), the padding masked by an additive bias
                    g = n // nkv
                    bias = torch.zeros(b, 1, 1, max(lens)).masked_fill_(
                        (torch.arange(max(lens))[None, :] >= torch.tensor(lens)[:, None])[:, None, None], -1e30
                    )
                    qs, ks, vs = q.view(b, nkv, g, d), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
                    base = median_cpu_ms(lambda: sdpa(qs, ks, vs, attn_mask=bias, scale=scale), args.repeats)
                    row = {"shape": shape, "layout": layout, "batch": b, "length": length, "twin_ms": ms}
                    rows.append(row | {"sdpa_ms": base, "mixed": args.mixed})
                    print(
                        f"{shape:5s} {layout:8s} B={b:<3d} L={length:<6d} twin {ms:8.3f} ms   "
                        f"sdpa on contiguous K/V {base:8.3f} ms",
                        flush=True,
                    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="tiny,100m")
    parser.add_argument("--layouts", default="runs,shuffled")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--lengths", default="128,1024,8192")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--mixed", action="store_true", help="request b has length L * (b + 1) / B")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}, {args.threads} thread(s)")
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
