# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Time to first token of a long prompt: cold, device prefix-cache hit, host-offload hit, KV pool hit (fresh instance).

Emulated device, in-process engines, tiny Qwen2 (float32, ``--layers`` layers, hidden 64, block size 16), everything
on 127.0.0.1 with a real ``mooncake_master`` and memory-lending ``mooncake_client``. Per repeat a fresh prompt of
``--tokens`` tokens (4096 by default); TTFT = the wall time of a 1-token greedy ``generate`` (prefill + first token).

- cold / device hit: instance A (``MooncakeStoreConnector``) serves the prompt, then the same prompt again;
- pool hit: A stopped, a fresh instance B (same pool) serves the prompt: its blocks come from the pool;
- host-offload hit: instance C (vLLM's ``OffloadingConnector``, a device cache of one prompt and a bit) serves the
  prompt, then another (which evicts the first from the device), then the first again: from host memory.

So the pool's and the offload's cost over recompute is known on the emulated device over loopback; on an NPU the
compute is far faster and the transfer path differs (HCCS/RoCE, device memory), so only the shape carries over.
Median of ``--repeats``; ``--json`` writes the results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK = 16


def _ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    from npu_testkit.engine import greedy_outputs

    start = time.perf_counter()
    out = greedy_outputs(llm, [prompt], 1)[0]
    return (time.perf_counter() - start) * 1000.0, int(out.num_cached_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()

    import os

    os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
    from npu_testkit.engine import emulated_env, engine, make_prompts, tiny_config
    from npu_testkit.kv_pool import local_pool, pool_transfer_config
    from npu_testkit.models import build_tiny_model

    model = build_tiny_model(
        tiny_config("qwen2", num_hidden_layers=args.layers, max_position_embeddings=args.tokens + 64)
    )
    prompts = make_prompts([args.tokens] * (2 * args.repeats), seed=4096)
    mine, fillers = prompts[: args.repeats], prompts[args.repeats :]
    tmp = Path(tempfile.mkdtemp(prefix="kv-pool-ttft-"))
    common = {"block_size": BLOCK, "enable_prefix_caching": True, "max_model_len": args.tokens + 64}
    results: dict[str, list[float]] = {"cold": [], "device hit": [], "pool hit": [], "offload hit": []}
    cached: dict[str, list[int]] = {k: [] for k in results}
    with local_pool(tmp, 1 << 30) as pool:
        kv = pool_transfer_config(pool.master_address)
        env = {"PYTHONHASHSEED": "0"}
        with engine(model, emulated_env(tmp / "a", extra=env), kv_transfer_config=kv, **common) as llm:
            _ttft(llm, fillers[0])  # warm-up (compile, first allocation)
            for p in mine:
                for key in ("cold", "device hit"):
                    ms, c = _ttft(llm, p)
                    results[key].append(ms)
                    cached[key].append(c)
        with engine(model, emulated_env(tmp / "b", extra=env), kv_transfer_config=kv, **common) as llm:
            _ttft(llm, fillers[0][:64])  # warm-up on a prompt A did not store whole
            for p in mine:
                ms, c = _ttft(llm, p)
                results["pool hit"].append(ms)
                cached["pool hit"].append(c)
    offload = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_cpu_blocks": 4 * (args.tokens // BLOCK + 1)},
    }
    device_blocks = args.tokens // BLOCK + 8  # one prompt fits, two do not
    with engine(
        model,
        emulated_env(tmp / "c", extra=env),
        kv_transfer_config=offload,
        num_gpu_blocks_override=device_blocks,
        max_num_seqs=1,
        **common,
    ) as llm:
        _ttft(llm, fillers[-1])
        for p, filler in zip(mine, fillers):
            _ttft(llm, p)
            _ttft(llm, filler)  # evicts p from the device cache
            ms, c = _ttft(llm, p)
            results["offload hit"].append(ms)
            cached["offload hit"].append(c)
    report = {
        k: {"ttft_ms_median": round(statistics.median(v), 1), "cached_tokens": cached[k]} for k, v in results.items()
    }
    report["config"] = {"tokens": args.tokens, "layers": args.layers, "repeats": args.repeats}  # type: ignore[assignment]
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
