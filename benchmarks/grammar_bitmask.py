# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Per-step cost of structured output's grammar bitmask: the NPU's on-device mask against the host round trip.

The two sides of ``vllm_npu.platform.sample.GRAMMAR_BITMASK`` on every structured row of a step (batch 1/8/32 x
vocabulary 32000/152064, float32 and bfloat16 logits), measured on this host (the emulated device is the CPU):

- ``host_ms``: the reference twin, the round trip vllm-ascend v0.11.0 makes on an NPU (the rows to float32 on the
  host, xgrammar's CPU kernel, back in the logits' dtype), as the emulated device runs it. On an NPU host the same
  CPU work comes on top of the transfers (``round_trip_bytes``) and of a blocking device sync.
- ``device_on_cpu_ms``: the NPU side's aten ops (bitmask unpacked with ``bitwise_and``/``eq``, ``masked_fill_``)
  executed on the CPU: what it would cost the emulated device, not what it costs an NPU.
- ``device_dispatch_ms``: the NPU side on ``meta`` tensors: its host-side cost (Python and the dispatcher, no
  computation), i.e. what an NPU step pays on the host for it, the NPU's own launch latency and kernel time aside.
- ``round_trip_bytes`` / ``device_bytes``: what crosses the host-device link per step: the rows of logits both ways
  as float32 (an upper bound: the device-to-host leg is in the model's dtype when the cast is on the host), against
  the bitmask and the row indices one way.

Run: ``.venv/bin/python benchmarks/grammar_bitmask.py [--repeats N] [--threads T] [--json FILE]``. Times are medians
after a warm-up, in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import median_ms  # noqa: E402

BATCHES = (1, 8, 32)
VOCABS = (32000, 152064)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def measure(batch: int, vocab: int, dtype: str, repeats: int) -> dict[str, Any]:
    """One row: both sides on ``batch`` structured rows of ``vocab`` logits in ``dtype`` (checked equal first)."""
    from vllm_npu.platform.sample.grammar import grammar_mask_npu, grammar_mask_reference

    words = (vocab + 31) // 32
    gen = torch.Generator().manual_seed(batch * vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, generator=gen)
    logits = torch.randn(batch, vocab, generator=gen).to(DTYPES[dtype])
    rows = list(range(batch))
    host, device = logits.clone(), logits.clone()
    grammar_mask_reference(host, rows, bitmask)
    grammar_mask_npu(device, rows, bitmask)
    assert torch.equal(host, device), "the two sides disagree"
    meta = torch.empty(batch, vocab, dtype=DTYPES[dtype], device="meta")
    # Masking is idempotent, so repeating it on one tensor measures the same work every time.
    return {
        "batch": batch,
        "vocab": vocab,
        "dtype": dtype,
        "host_ms": median_ms(lambda: grammar_mask_reference(host, rows, bitmask), repeats),
        "device_on_cpu_ms": median_ms(lambda: grammar_mask_npu(device, rows, bitmask), repeats),
        "device_dispatch_ms": median_ms(lambda: grammar_mask_npu(meta, rows, bitmask), repeats),
        "round_trip_bytes": 2 * batch * vocab * 4,
        "device_bytes": batch * words * 4,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [
        measure(batch, vocab, dtype, args.repeats)
        for vocab in args.vocabs
        for batch in args.batches
        for dtype in DTYPES
    ]
    print(f"grammar bitmask per step, torch threads {torch.get_num_threads()} (medians of {args.repeats}, ms)")
    print(f"{'vocab':>7} {'batch':>5} {'dtype':>8} {'host':>8} {'dev@cpu':>8} {'dev host':>8} {'link MB':>14}")
    for r in rows:
        link = f"{r['round_trip_bytes'] / 1e6:.2f} / {r['device_bytes'] / 1e6:.3f}"
        print(
            f"{r['vocab']:>7} {r['batch']:>5} {r['dtype']:>8} {r['host_ms']:>8.3f} {r['device_on_cpu_ms']:>8.3f} "
            f"{r['device_dispatch_ms']:>8.3f} {link:>14}"
        )
    print(
        "host: the round trip's CPU work (+ transfers and a sync on an NPU); dev@cpu: the device side run on the CPU;"
    )
    print("dev host: the device side's host cost (meta tensors); link MB: round trip / device side per step")
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
