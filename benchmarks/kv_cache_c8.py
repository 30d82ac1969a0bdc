# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""C8 (int8 KV cache) vs a bf16 KV cache on the emulated device: KV capacity and decode throughput at one budget.

Model: the small Qwen2 of ``decode_throughput.py`` (hidden 256, 4 layers, 8 query / 2 KV heads of 32, vocab 512),
saved in bfloat16 and quantized by ``vllm-npu quantize --scheme W8A8_DYNAMIC`` twice: without and with
``--kv-cache C8``, so the two engines differ in the KV cache only. Both serve ``--dtype bfloat16`` with the same
emulated KV budget (``--kv-gib``), block size 32, in-process engine core. Reports, per cache:

- ``kv_tokens``: vLLM's KV capacity (``num_gpu_blocks * block_size``, what its "KV cache size: N tokens" line says);
- ``max_concurrent_seqs``: how many sequences of ``--prompt-len + --tokens`` tokens fit at once (whole blocks each),
  i.e. the concurrency the budget allows;
- ``tokens_per_s``: greedy decode throughput, ``--prompts`` prompts x ``--tokens`` new tokens, best of
  ``--repeats`` after a warm-up, timed with this thread's CPU time (the engine core runs in it): on the emulated
  device the int8 pages are dequantized by the reference twin, so this measures the host cost of the twin, not the
  NPU kernel (where antiquant is inside FIA and the pages read are half the bytes).

Run: ``.venv/bin/python benchmarks/kv_cache_c8.py [--kv-gib 0.01] [--prompts 8] [--tokens 32] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")

SMALL_QWEN2 = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2
)
BLOCK = 32


def checkpoints(root: Path) -> dict[str, Path]:
    """``{"bf16": W8A8_DYNAMIC, "c8": W8A8_DYNAMIC + C8}`` of the small bf16 Qwen2, written under ``root``."""
    from npu_testkit.engine import tiny_config
    from npu_testkit.models import build_tiny_model
    from vllm_npu.quant.tools.quantizer import quantize_checkpoint

    float_dir = build_tiny_model(tiny_config("qwen2", **SMALL_QWEN2), dtype="bfloat16")
    return {
        "bf16": quantize_checkpoint(float_dir, root / "w8a8_dynamic", "W8A8_DYNAMIC"),
        "c8": quantize_checkpoint(float_dir, root / "w8a8_dynamic_c8", "W8A8_DYNAMIC", kv_cache="C8"),
    }


def measure(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    from npu_testkit.engine import emulated_env, engine, greedy, make_prompts

    prompts = make_prompts([args.prompt_len] * args.prompts, seed=0)
    env = emulated_env(tempfile.mkdtemp(prefix="bench-c8-"), kv_cache_gb=args.kv_gib)
    with engine(model, env, dtype="bfloat16", block_size=BLOCK, max_num_seqs=max(16, args.prompts)) as llm:
        blocks = int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
        (cache_dtype,) = {str(t.dtype) for t in llm.collective_rpc(lambda w: w.model_runner.kv_caches)[0]}
        greedy(llm, prompts, args.tokens)  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            start = time.thread_time()
            out = greedy(llm, prompts, args.tokens)
            best = min(best, time.thread_time() - start)
        assert all(len(o) == args.tokens for o in out)
    per_seq = -(-(args.prompt_len + args.tokens) // BLOCK)
    return {
        "kv_cache_dtype": cache_dtype,
        "kv_blocks": blocks,
        "kv_tokens": blocks * BLOCK,
        "max_concurrent_seqs": blocks // per_seq,
        "tokens_per_s": args.prompts * args.tokens / best,
        "cpu_s": best,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-gib", type=float, default=0.01, help="the emulated KV budget of both engines (GiB)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-c8-ckpt-") as root:
        models = checkpoints(Path(root))
        results = {name: measure(path, args) for name, path in models.items()}
    results["c8_over_bf16"] = {
        key: results["c8"][key] / results["bf16"][key] for key in ("kv_tokens", "max_concurrent_seqs", "tokens_per_s")
    }
    results["setup"] = {
        "model": "qwen2 " + ",".join(f"{k}={v}" for k, v in SMALL_QWEN2.items()) + ", W8A8_DYNAMIC linears",
        "kv_gib": args.kv_gib,
        "block_size": BLOCK,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.tokens,
        "clock": "thread CPU time",
    }
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
