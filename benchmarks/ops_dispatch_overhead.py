"""Per-call dispatch overhead of the ops layer's overrides vs calling the reference kernel directly.

For decode-size tensors (1-8 tokens) this times, on the emulated device (reference kernels, 1 CPU thread):

- ``kernel``: the reference function called directly with the layer's tensors (the floor);
- ``forward_oot``: the override's method (what ``CustomOp.forward`` dispatches to);
- ``module``: the full ``layer(...)`` call (nn.Module ``__call__`` + ``CustomOp.forward`` + ``forward_oot``), which
  every vLLM CustomOp pays, ours or vLLM's own.

Overhead = (forward_oot - kernel) / kernel; target <= 5 %. An A/A control (the kernel timed twice in separate slots)
shows the measurement noise of the run: an overhead below the A/A figure is not resolved. Timing: the three variants are timed interleaved
(kernel, forward_oot, module, kernel, ...) in ``--repeats`` rounds of ``--number`` calls each, and the minimum per
variant is kept. The clock is the thread's CPU time (``time.thread_time``), not wall time: on a shared 2-core machine
wall time mostly measures the other processes.

Run: ``VLLM_NPU_DEVICE=emulated .venv/bin/python benchmarks/ops_dispatch_overhead.py [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import timeit
from collections.abc import Callable
from typing import Any

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def _time_interleaved(fns: list[Callable[[], Any]], number: int, repeats: int) -> list[float]:
    """Minimum microseconds per call of each function, timed in interleaved rounds."""
    for fn in fns:
        for _ in range(max(10, number // 10)):
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], timeit.Timer(fn, timer=time.thread_time).timeit(number=number) / number * 1e6)
    return best


def cases(tokens: int, dtype: Any) -> list[tuple[str, Callable[[], Any], Callable[[], Any], Callable[[], Any]]]:
    import torch
    from vllm.model_executor.layers.activation import QuickGELU, SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    g = torch.Generator().manual_seed(0)
    hidden, inter, heads, kv, head = 4096, 11008 // 4, 32, 8, 128
    out = []

    norm = RMSNorm(hidden).to(dtype)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    r = torch.randn(tokens, hidden, generator=g).to(dtype)
    k_add, w, eps = norm._add_norm, norm.weight, norm.variance_epsilon
    out.append(("add+rms_norm", lambda: k_add(x, r, w, eps), lambda: norm.forward_oot(x, r), lambda: norm(x, r)))
    k_norm = norm._norm
    out.append(("rms_norm", lambda: k_norm(x, w, eps), lambda: norm.forward_oot(x), lambda: norm(x)))

    act = SiluAndMul()
    xa = torch.randn(tokens, 2 * inter, generator=g).to(dtype)
    k_act = act._kernel
    out.append(("silu_and_mul", lambda: k_act(xa), lambda: act.forward_oot(xa), lambda: act(xa)))

    gelu = QuickGELU()
    xg = torch.randn(tokens, inter, generator=g).to(dtype)
    k_gelu = gelu._kernel
    out.append(("quick_gelu", lambda: k_gelu(xg), lambda: gelu.forward_oot(xg), lambda: gelu(xg)))

    rope = RotaryEmbedding(head, head, 4096, 10000.0, True, dtype)
    pos = torch.randint(0, 4096, (tokens,), generator=g)
    q = torch.randn(tokens, heads * head, generator=g).to(dtype)
    k = torch.randn(tokens, kv * head, generator=g).to(dtype)
    rope(pos, q, k)  # gather cos/sin once: later layers of a forward hit the cache, which is what is timed
    cos, sin = rope._cos_sin._value
    k_rot, mode = rope._rotary_mul, rope._mode

    def rope_kernels() -> Any:
        return (k_rot(q.view(1, tokens, heads, head), cos, sin, mode).view(tokens, -1),
                k_rot(k.view(1, tokens, kv, head), cos, sin, mode).view(tokens, -1))

    out.append(("rope (cache hit)", rope_kernels, lambda: rope.forward_oot(pos, q, k), lambda: rope(pos, q, k)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--number", type=int, default=200)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)

    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm_npu.ops._registry import register_oot_ops

    torch.set_num_threads(1)
    register_oot_ops()
    dtype = getattr(torch, args.dtype)
    rows = []
    # no_grad, not inference_mode: the engine's positions buffer is a normal tensor (it has a version counter, which
    # the per-forward cos/sin cache keys on); inference tensors would make every RoPE call a cache miss.
    with set_current_vllm_config(VllmConfig()), torch.no_grad():
        for tokens in args.tokens:
            for name, kernel, oot, module in cases(tokens, dtype):
                kernel_again = (lambda f: lambda: f())(kernel)  # A/A control: same work, separate timing slot
                t_k, t_a, t_o, t_m = _time_interleaved([kernel, kernel_again, oot, module], args.number, args.repeats)
                rows.append({"op": name, "tokens": tokens, "kernel_us": round(t_k, 2), "forward_oot_us": round(t_o, 2),
                             "module_us": round(t_m, 2), "oot_overhead_pct": round(100 * (t_o - t_k) / t_k, 1),
                             "module_overhead_pct": round(100 * (t_m - t_k) / t_k, 1),
                             "noise_aa_pct": round(100 * (t_a - t_k) / t_k, 1)})
    print(f"dtype={args.dtype}, 1 thread, min of {args.repeats} interleaved rounds x {args.number} calls; us per call")
    print(f"{'op':<18}{'T':>3}{'kernel':>9}{'fwd_oot':>9}{'module':>9}{'oot ovh':>9}{'module ovh':>12}{'A/A noise':>11}")
    for r in rows:
        print(f"{r['op']:<18}{r['tokens']:>3}{r['kernel_us']:>9.2f}{r['forward_oot_us']:>9.2f}{r['module_us']:>9.2f}"
              f"{r['oot_overhead_pct']:>8.1f}%{r['module_overhead_pct']:>11.1f}%{r['noise_aa_pct']:>10.1f}%")
    worst = max(r["oot_overhead_pct"] for r in rows)
    print(f"worst forward_oot overhead: {worst:.1f}% (target <= 5%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
