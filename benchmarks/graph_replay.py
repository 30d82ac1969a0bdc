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

import argparse
import json
import os
import tempfile
import time
from typing import Any

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")

BATCHES = (1, 8, 32)
MODES = ("NONE", "PIECEWISE", "FULL_DECODE_ONLY")


def step_ms(llm: Any, prompts: list[list[int]], tokens: int, repeats: int) -> float:
    from vllm import SamplingParams

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    run(1 + tokens)  # warm-up
    best = min(run(1 + tokens) - run(1) for _ in range(repeats))
    return 1000.0 * best / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()

    from npu_testkit.engine import emulated_env, engine, make_prompts, tiny_config
    from npu_testkit.models import build_tiny_model

    model = build_tiny_model(tiny_config("qwen2", num_hidden_layers=args.layers))
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
