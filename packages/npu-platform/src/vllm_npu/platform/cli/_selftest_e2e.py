# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""One leg of ``vllm-npu selftest``'s end-to-end check, run in its own process.

``python -m vllm_npu.platform.cli._selftest_e2e MODEL_DIR OUT.json --kernels {auto,npu,reference} --dtype D
--max-tokens N --prompt P ... [--gpu-memory-utilization F]`` starts ``vllm.LLM`` on the device ``VLLM_NPU_DEVICE`` names, with the ``npu.kernels``
setting given, generates greedily and writes ``{"token_ids", "texts", "workers", "seconds"}`` to ``OUT.json``.
The kernel backend is fixed once per process, so each leg needs its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_npu.platform.cli._selftest_e2e")
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--kernels", default="auto", choices=["auto", "npu", "reference"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt", action="append", dest="prompts", required=True)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    extra = {} if args.gpu_memory_utilization is None else {"gpu_memory_utilization": args.gpu_memory_utilization}
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=256,
        seed=0,
        additional_config={"npu": {"kernels": args.kernels}},
        **extra,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs = llm.generate(args.prompts, params, use_tqdm=False)
    result = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "texts": [o.outputs[0].text for o in outputs],
        "workers": llm.collective_rpc("npu_runtime_info"),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
