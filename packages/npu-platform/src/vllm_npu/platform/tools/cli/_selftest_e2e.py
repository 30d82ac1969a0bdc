# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""One leg of ``vllm-npu selftest``'s end-to-end check, run in its own process.

``python -m vllm_npu.platform.tools.cli._selftest_e2e MODEL_DIR OUT.json --kernels {auto,npu,reference} --dtype D
--max-tokens N --prompt P ... [--gpu-memory-utilization F]`` starts ``vllm.LLM`` on the device ``VLLM_NPU_DEVICE``
names, with the ``npu.kernels`` setting given, generates greedily and writes ``{"token_ids", "texts", "workers",
"seconds"}`` to ``OUT.json``. The kernel backend is fixed once per process, so each leg needs its own.

The runtime section's legs (:mod:`._selftest_runtime`) add: ``--cudagraph-mode`` / ``--capture-sizes`` (vLLM's
graph knobs), ``--graph-mode`` / ``--torchair-cache-dir`` / ``--emulated-kv-gb`` (the plugin's ``npu.*`` settings),
and ``--sleep-cycle``: sleep mode on, and after the first generate the engine sleeps at level 1, wakes up and
generates again, then the same at level 2; ``phases`` holds each phase's token ids and ``workers_after`` the
workers' runtime info after the last wake-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_npu.platform.tools.cli._selftest_e2e")
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--kernels", default="auto", choices=["auto", "npu", "reference"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt", action="append", dest="prompts", required=True)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--cudagraph-mode", default=None, help="vLLM's compilation_config.cudagraph_mode")
    p.add_argument("--capture-sizes", default=None, help="comma-separated cudagraph_capture_sizes")
    p.add_argument("--graph-mode", default=None, help="npu.graph_mode")
    p.add_argument("--torchair-cache-dir", default=None, help="npu.torchair_cache_dir")
    p.add_argument("--emulated-kv-gb", type=float, default=None, help="npu.emulated_kv_cache_gb")
    p.add_argument("--sleep-cycle", action="store_true", help="sleep level 1 and 2 with a generate after each wake-up")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    extra: dict[str, Any] = {}
    if args.gpu_memory_utilization is not None:
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    compilation: dict[str, Any] = {}
    if args.cudagraph_mode is not None:
        compilation["cudagraph_mode"] = args.cudagraph_mode
    if args.capture_sizes is not None:
        compilation["cudagraph_capture_sizes"] = [int(s) for s in args.capture_sizes.split(",")]
    if compilation:
        extra["compilation_config"] = compilation
    npu: dict[str, Any] = {"kernels": args.kernels}
    if args.cudagraph_mode is None and args.graph_mode is None:
        # The plain leg checks the stack, not compilation: on the emulated device it stays eager (its default would
        # compile each capture size first); on an NPU the key is ignored and the NPU's default graphs run.
        npu["emulated_compile"] = "none"
    for key, value in (
        ("graph_mode", args.graph_mode),
        ("torchair_cache_dir", args.torchair_cache_dir),
        ("emulated_kv_cache_gb", args.emulated_kv_gb),
    ):
        if value is not None:
            npu[key] = value
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=256,
        seed=0,
        additional_config={"npu": npu},
        enable_sleep_mode=args.sleep_cycle,
        **extra,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def token_ids() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(args.prompts, params, use_tqdm=False)]

    outputs = llm.generate(args.prompts, params, use_tqdm=False)
    result: dict[str, Any] = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "texts": [o.outputs[0].text for o in outputs],
        "workers": llm.collective_rpc("npu_runtime_info"),
    }
    if args.sleep_cycle:
        phases = {}
        for level in (1, 2):
            llm.sleep(level=level)
            llm.wake_up()
            phases[f"level{level}"] = token_ids()
        result["phases"] = phases
        result["workers_after"] = llm.collective_rpc("npu_runtime_info")
    result["seconds"] = round(time.perf_counter() - t0, 2)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
