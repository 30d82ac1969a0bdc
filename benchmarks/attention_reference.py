# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Time of npu-attention's reference attention kernels (the emulated device's) vs PyTorch's SDPA on the same shapes.

Cases (one attention layer, GQA ``--heads``/``--kv-heads``, head size ``--head-size``, block size 128):

- ``decode``: ``paged_decode`` reference (gathers each request's pages, fp32 math) for B requests of L cached tokens,
  vs ``torch.nn.functional.scaled_dot_product_attention`` on the same K/V already contiguous ``[B, N, L, D]``;
- ``prefill``: ``prefill_no_cache`` reference for one S-token first prefill vs causal SDPA;
- ``chunk``: ``paged_prefill`` reference for a C-token chunk over L cached tokens (bottom-right causal) vs SDPA
  with the equivalent explicit mask.

SDPA gets the K/V in its preferred contiguous layout (no paging) and computes in the input dtype, so the ratio
(reference / SDPA) is an upper bound of what paging, the fp32 upcast and the GQA view cost on the CPU. Timing: median
of ``--repeats`` runs after a warm-up, milliseconds per call. Reference kernels only: not an NPU number.

Run: ``.venv/bin/python benchmarks/attention_reference.py [--dtype float32|bfloat16] [--threads 2] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from _timing import median_ms

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

BLOCK = 128


def _paged(torch: Any, k: Any, v: Any, gen: Any) -> tuple[Any, Any, Any]:
    """Scatter contiguous ``[B, L, Nkv, D]`` K/V into shuffled 128-token pages; returns (k_cache, v_cache, table)."""
    b, length, nkv, d = k.shape
    per = -(-length // BLOCK)
    nblocks = b * per + 1
    order = torch.randperm(nblocks - 1, generator=gen) + 1
    table = order.view(b, per).to(torch.int32)
    kc = torch.zeros(nblocks, BLOCK, nkv, d, dtype=k.dtype)
    vc = torch.zeros_like(kc)
    pad = per * BLOCK - length
    kp = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).view(b, per, BLOCK, nkv, d)
    vp = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(b, per, BLOCK, nkv, d)
    kc[table.long()] = kp
    vc[table.long()] = vp
    return kc, vc, table


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    from vllm_npu.attention.ops.flash_attention import prefill_no_cache_reference
    from vllm_npu.attention.ops.paged_attention import paged_decode_reference, paged_prefill_reference

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    n, nkv, d = args.heads, args.kv_heads, args.head_size
    scale = d**-0.5
    gen = torch.Generator().manual_seed(0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows: list[dict[str, Any]] = []

    def record(case: str, shape: str, ref_ms: float, sdpa_ms: float) -> None:
        rows.append(
            {"case": case, "shape": shape, "reference_ms": ref_ms, "sdpa_ms": sdpa_ms, "ratio": ref_ms / sdpa_ms}
        )
        print(
            f"{case:8s} {shape:24s} reference {ref_ms:9.3f} ms   sdpa {sdpa_ms:9.3f} ms   ratio {ref_ms / sdpa_ms:6.2f}"
        )

    for b, length in [(1, 512), (8, 512), (32, 512), (8, 2048), (32, 2048)]:
        k = torch.randn(b, length, nkv, d, generator=gen).to(dtype)
        v = torch.randn(b, length, nkv, d, generator=gen).to(dtype)
        q = torch.randn(b, n, d, generator=gen).to(dtype)
        kc, vc, table = _paged(torch, k, v, gen)
        out = torch.empty_like(q)
        lens = [length] * b
        ref = median_ms(
            lambda: paged_decode_reference(q, kc, vc, table, lens, num_heads=n, num_kv_heads=nkv, scale=scale, out=out),
            args.repeats,
        )
        qs, ks, vs = q[:, :, None], k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        base = median_ms(lambda: sdpa(qs, ks, vs, scale=scale, enable_gqa=True), args.repeats)
        record("decode", f"B={b} L={length}", ref, base)

    for s in [128, 512, 1024]:
        q = torch.randn(s, n, d, generator=gen).to(dtype)
        k = torch.randn(s, nkv, d, generator=gen).to(dtype)
        v = torch.randn(s, nkv, d, generator=gen).to(dtype)
        out = torch.empty_like(q)
        ref = median_ms(
            lambda: prefill_no_cache_reference(
                q, k, v, [s], num_heads=n, num_kv_heads=nkv, scale=scale, attn_mask=None, out=out
            ),
            args.repeats,
        )
        qs, ks, vs = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        base = median_ms(lambda: sdpa(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True), args.repeats)
        record("prefill", f"S={s}", ref, base)

    for chunk, length in [(128, 1024), (512, 2048)]:
        k = torch.randn(1, length, nkv, d, generator=gen).to(dtype)
        v = torch.randn(1, length, nkv, d, generator=gen).to(dtype)
        q = torch.randn(chunk, n, d, generator=gen).to(dtype)
        kc, vc, table = _paged(torch, k, v, gen)
        out = torch.empty_like(q)
        ref = median_ms(
            lambda: paged_prefill_reference(
                q,
                kc,
                vc,
                table,
                [0, chunk],
                [length],
                num_heads=n,
                num_kv_heads=nkv,
                scale=scale,
                attn_mask=None,
                out=out,
            ),
            args.repeats,
        )
        q_pos = torch.arange(length - chunk, length)[:, None]
        mask = torch.arange(length)[None, :] <= q_pos
        qs, ks, vs = q.transpose(0, 1)[None], k[0].transpose(0, 1)[None], v[0].transpose(0, 1)[None]
        base = median_ms(lambda: sdpa(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True), args.repeats)
        record("chunk", f"C={chunk} L={length}", ref, base)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    rows = run(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
