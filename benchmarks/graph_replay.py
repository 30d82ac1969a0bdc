# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Static graphs on the emulated device: host time per decode step eager vs graph replay, and capture cost.

For each mode (eager = cudagraph_mode NONE, PIECEWISE, FULL_DECODE_ONLY) one in-process engine with a tiny Qwen2
(hidden 64, 2 layers, float32; ``--layers`` for more) and capture sizes 1/8/32. For batch B in 1/8/32: B prompts of
8 tokens; the time per decode step is ``(t(generate 1 + N tokens) - t(generate 1 token)) / N`` (best of
``--repeats``), so prefill and request setup cancel out. On the emulated device everything is host time: the ratio
eager / replay is the per-step Python and dispatch work a graph removes (on an NPU, kernel launches).

Capture cost per batch size comes from the graph wrapper's own counters (``npu_runtime_info()['graphs']``): seconds
spent tracing/capturing, and the device free-memory delta. On the emulated device that delta is the host's available
memory, i.e. noise around 0: the twin has no graph pool. On an NPU it is the graph pool growth.

Run: ``.venv/bin/python benchmarks/graph_replay.py [--tokens 32] [--repeats 3] [--layers 2] [--json out.json]``
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")

from _engine_bench import parse_args, step_ms, tiny_qwen2, write_json  # noqa: E402

BATCHES = (1, 8, 32)
MODES = ("NONE", "PIECEWISE", "FULL_DECODE_ONLY")


def main() -> None:
    args = parse_args(__doc__)
    from npu_testkit.engine import emulated_env, engine, make_prompts

    model = tiny_qwen2(args.layers)
    results: dict[str, Any] = {}
    for mode in MODES:
        kwargs = {"compilation_config": {"cudagraph_mode": mode, "cudagraph_capture_sizes": list(BATCHES)}}
        with tempfile.TemporaryDirectory() as tmp, engine(model, emulated_env(tmp), max_num_seqs=32, **kwargs) as llm:
            (info,) = llm.collective_rpc("npu_runtime_info")
            per_batch = {b: step_ms(llm, make_prompts([8] * b, seed=b), args.tokens, args.repeats) for b in BATCHES}
            (after,) = llm.collective_rpc("npu_runtime_info")
        results[mode] = {
            "step_ms": per_batch,
            "capture_seconds": info["graphs"]["capture_seconds"],
            "capture_bytes": info["graphs"]["capture_bytes"],
            "replays": after["graphs"]["replays"],
        }

    print(f"host time per decode step (ms), tiny Qwen2 with {args.layers} layers, emulated device")
    print(f"{'batch':>6} " + " ".join(f"{m:>17}" for m in MODES) + "   eager/piecewise  eager/full")
    for b in BATCHES:
        ms = [results[m]["step_ms"][b] for m in MODES]
        print(f"{b:>6} " + " ".join(f"{v:17.2f}" for v in ms) + f"   {ms[0] / ms[1]:15.2f}  {ms[0] / ms[2]:10.2f}")
    for mode in MODES[1:]:
        secs, mem = results[mode]["capture_seconds"], results[mode]["capture_bytes"]
        for size in sorted(secs, key=int):
            print(f"capture {mode:>16} size {size:>3}: {secs[size]:.3f} s, {mem.get(size, 0) / 2**20:.1f} MiB")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
