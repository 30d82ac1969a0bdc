# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The lean reference twins vs the previous ones (the oracles the pinning tests keep), per call and per decode step.

Shapes: one decode step of benchmarks/decode_throughput.py's model (hidden 256, 4 layers, 8 query / 2 KV heads,
head dim 32, 8 requests of ``--context`` cached tokens, block size 16). Each kernel pair is timed A/B alternated in
this one process (``--rounds`` rounds of ``--calls`` calls each, the median per call), so a loaded machine slows
both alike; per-step numbers multiply by the calls per step (4 layers: 4 KV writes, 4 decode attentions, 4 RoPE,
8 add+RMSNorm + 1 RMSNorm, 4 SwiGLU). The previous twins come from the test files that pin the lean ones to them.

Run: ``.venv/bin/python benchmarks/lean_twins_ab.py [--threads 1] [--json out.json]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _load(rel: str) -> Any:
    spec = importlib.util.spec_from_file_location(Path(rel).stem, ROOT / rel)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ab(old: Any, new: Any, rounds: int, calls: int) -> tuple[float, float]:
    times: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(rounds):
        for name, fn in (("old", old), ("new", new)):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times["old"]), statistics.median(times["new"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from vllm_npu.attention.ops.kv_cache import reshape_and_cache_reference
    from vllm_npu.attention.ops.paged_attention import DecodePlan, paged_decode_reference
    from vllm_npu.ops.layernorm import add_rms_norm_reference, rms_norm_reference
    from vllm_npu.ops.rotary_embedding import rotary_mul_qk_reference, rotary_mul_reference
    from vllm_npu.ops.swiglu import swiglu_reference

    attn_t = _load("packages/npu-attention/tests/test_reference_lean.py")
    kv_t = _load("packages/npu-attention/tests/test_kv_cache.py")
    ops_t = _load("packages/npu-ops/tests/test_lean_twins.py")

    b, n, nkv, d, hidden, inter, bs = 8, 8, 2, 32, 256, 512, 16
    g = torch.Generator().manual_seed(0)
    lens = [args.context + i for i in range(b)]
    per = -(-max(lens) // bs) + 1
    key_cache = torch.randn(b * per + 1, bs, nkv, d, generator=g)
    value_cache = torch.randn_like(key_cache)
    table = (torch.randperm(b * per, generator=g) + 1).view(b, per).int()
    query = torch.randn(b, n, d, generator=g)
    out = torch.empty(b, n, d)
    scale = d**-0.5
    k_new, v_new = torch.randn(b, nkv, d, generator=g), torch.randn(b, nkv, d, generator=g)
    slots32 = (table[:, 0].long() * bs + 3).int()
    slots64 = slots32.long()
    qkv = torch.randn(b, (n + 2 * nkv) * d, generator=g)
    q4, k4 = qkv[:, : n * d].view(1, b, n, d), qkv[:, n * d : (n + nkv) * d].view(1, b, nkv, d)
    cos, sin = torch.randn(1, b, 1, d, generator=g), torch.randn(1, b, 1, d, generator=g)
    x, res, gamma = torch.randn(b, hidden), torch.randn(b, hidden), torch.ones(hidden)
    gate_up = torch.randn(b, 2 * inter, generator=g)

    def decode_new() -> None:
        # the plan is built once per step by the metadata builder: its cost is counted once per step below
        paged_decode_reference(
            query, key_cache, value_cache, table, lens, num_heads=n, num_kv_heads=nkv, scale=scale, out=out, plan=plan
        )

    plan = DecodePlan.build(lens, bs, key_cache.device)
    cases = {
        "paged_decode": (
            4,
            lambda: out.copy_(attn_t._decode_oracle(query, key_cache, value_cache, table, lens, scale, None, None)),
            decode_new,
        ),
        "decode_plan (once per step)": (1, lambda: None, lambda: DecodePlan.build(lens, bs, key_cache.device)),
        "kv_write": (
            4,
            lambda: kv_t._skip_padding_oracle(k_new, v_new, key_cache, value_cache, slots32),
            lambda: reshape_and_cache_reference(k_new, v_new, key_cache, value_cache, slots64),
        ),
        "slot redirect (once per step)": (1, lambda: None, lambda: torch.clamp(slots64, min=0, out=slots64)),
        "rope q+k": (
            4,
            lambda: (rotary_mul_reference(q4, cos, sin, "half"), rotary_mul_reference(k4, cos, sin, "half")),
            lambda: rotary_mul_qk_reference(q4, k4, cos, sin, "half"),
        ),
        "add_rms_norm": (
            8,
            lambda: ops_t._add_rms_oracle(x, res, gamma, 1e-6),
            lambda: add_rms_norm_reference(x, res, gamma, 1e-6),
        ),
        "rms_norm": (1, lambda: ops_t._rms_oracle(x, gamma, 1e-6), lambda: rms_norm_reference(x, gamma, 1e-6)),
        "swiglu": (4, lambda: ops_t._swiglu_oracle(gate_up), lambda: swiglu_reference(gate_up)),
    }
    rows = {}
    for name, (per_step, old, new) in cases.items():
        o, nw = _ab(old, new, args.rounds, args.calls)
        rows[name] = {
            "old_us": o,
            "new_us": nw,
            "calls_per_step": per_step,
            "saved_ms_per_step": (o - nw) * per_step / 1e3,
        }
        print(
            f"{name:30s} old {o:8.1f} us  new {nw:8.1f} us  x{per_step}/step  saves {rows[name]['saved_ms_per_step']:.3f} ms/step"
        )
    total_old = sum(r["old_us"] * r["calls_per_step"] for r in rows.values()) / 1e3
    total_new = sum(r["new_us"] * r["calls_per_step"] for r in rows.values()) / 1e3
    print(f"these kernels per decode step: {total_old:.3f} ms -> {total_new:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "rows": rows, "total_old_ms": total_old, "total_new_ms": total_new}, f, indent=2
            )


if __name__ == "__main__":
    main()
