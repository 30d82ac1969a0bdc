# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The torchair mode on the emulated device: compile time per batch size with an empty and with a warm compile cache,
and host time per decode step eager vs compiled.

Three in-process engines with a tiny Qwen2 (hidden 64, 2 layers, float32; ``--layers`` for more) and sizes 1/8/32:
eager (``npu.graph_mode='eager'``), torchair with an empty cache directory, torchair again on the same directory
(every lowered graph loaded). Compile time per size is the first FULL call of that size during start-up (Dynamo
trace, then lowering or loading, then one run), from ``npu_runtime_info()['torchair']['compile_seconds']``, and the part of it spent lowering (cold) or loading (warm)
the graph, ``backend_seconds``. The time
per decode step is measured as in ``graph_replay.py``: ``(t(1 + N tokens) - t(1 token)) / N``, best of ``--repeats``.

On the emulated device the stand-in backend runs the lowered aten graph op by op, so the step time shows what
Dynamo's guards and the lowered graph cost on the host, not a device speed-up (GE compiles the graph on an NPU).

Run: ``.venv/bin/python benchmarks/torchair_compile.py [--tokens 32] [--repeats 3] [--layers 2] [--json out.json]``
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")

from _engine_bench import parse_args, step_ms, tiny_qwen2, write_json  # noqa: E402

BATCHES = (1, 8, 32)


def main() -> None:
    args = parse_args(__doc__)
    from npu_testkit.engine import emulated_env, engine, make_prompts

    model = tiny_qwen2(args.layers)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as cache_root:
        runs = {
            "eager": {"graph_mode": "eager"},
            "torchair cold": {"graph_mode": "torchair", "torchair_cache_dir": cache_root},
            "torchair warm": {"graph_mode": "torchair", "torchair_cache_dir": cache_root},
        }
        for name, npu in runs.items():
            kwargs: dict[str, Any] = {"additional_config": {"npu": npu}, "max_num_seqs": 32}
            if npu["graph_mode"] == "torchair":
                kwargs["compilation_config"] = {"cudagraph_capture_sizes": list(BATCHES)}
            with tempfile.TemporaryDirectory() as tmp, engine(model, emulated_env(tmp), **kwargs) as llm:
                (info,) = llm.collective_rpc("npu_runtime_info")
                per_batch = {b: step_ms(llm, make_prompts([8] * b, seed=b), args.tokens, args.repeats) for b in BATCHES}
            results[name] = {"step_ms": per_batch, "torchair": info["torchair"] if name != "eager" else None}

    print(f"tiny Qwen2 with {args.layers} layers, emulated device")
    print(f"{'batch':>6} " + " ".join(f"{n:>14}" for n in results) + "   eager/torchair")
    for b in BATCHES:
        ms = [results[n]["step_ms"][b] for n in results]
        print(f"{b:>6} " + " ".join(f"{v:14.2f}" for v in ms) + f"   {ms[0] / ms[2]:14.2f}")
    previous = {"lowerings": 0, "cache_hits": 0}  # the counts are per process: each run adds to them
    for name in ("torchair cold", "torchair warm"):
        stats = results[name]["torchair"]
        secs = stats["compile_seconds"]
        lowered, hits = (stats[k] - previous[k] for k in ("lowerings", "cache_hits"))
        previous = stats
        print(f"{name}: lowerings {lowered}, cache hits {hits}")
        for size in sorted(secs, key=int):
            print(
                f"  size {size:>3}: first call {secs[size]:.3f} s, of which lowering/loading {stats['backend_seconds'][size]:.3f} s"
            )
    write_json(args.json, results)


if __name__ == "__main__":
    main()
