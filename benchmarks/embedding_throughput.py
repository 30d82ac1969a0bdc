# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Embedding throughput (sequences/s) of real vLLM on the emulated device, at 128 and 512 tokens per sequence.

Models: the testkit's tiny retrieval checkpoints (``npu_testkit.pooling``, hidden 64, 2 layers, float32): a
bge-m3-shaped ``XLMRobertaModel`` (CLS pooling, encoder-only attention) and a Qwen3-Embedding-shaped
``Qwen3ForCausalLM`` (last-token pooling, causal attention with the paged KV cache), each served as vLLM serves a
pooling model by default (PIECEWISE graphs; ``--eager`` for ``enforce_eager``), in-process engine core (no IPC).
For each length, ``--batch`` sequences of that many tokens go to one ``LLM.embed`` call; the figure is
``batch / time``, best of ``--repeats`` after one warm-up call (prefix caching off: the calls repeat the inputs).
``--clock wall`` (the default) times with ``time.perf_counter``; ``--clock cpu`` with this thread's CPU time (the
in-process engine core runs in the calling thread), which survives a loaded machine better but misses the work of
torch's intra-op threads. A step with more tokens than the largest capture size (vLLM's default for
``--batch`` 16: 32 tokens) runs eagerly, so at these lengths the graphs do not change the figures.

The tiny models measure the plugin's and vLLM's per-sequence overhead (scheduling, input preparation, pooling
and the attention twins) more than arithmetic; on an NPU the numbers are not comparable.

Run: ``.venv/bin/python benchmarks/embedding_throughput.py [--models xlmr_embed qwen3_embed] [--lengths 128 512]
[--batch 16] [--repeats 3] [--eager] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")

CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["xlmr_embed", "qwen3_embed"], choices=["xlmr_embed", "qwen3_embed"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[128, 512])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no graphs)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    ap.add_argument("--json")
    return ap.parse_args(argv)


def prompts(kind: str, length: int, batch: int) -> list[list[int]]:
    """``batch`` token-id inputs of exactly ``length`` tokens, framed as the model's tokenizer frames a text."""
    from npu_testkit.engine import make_prompts

    if kind == "xlmr_embed":  # <s> ... </s>
        return [[0, *p, 2] for p in make_prompts([length - 2] * batch, seed=1, vocab_size=500, avoid=(0, 1, 2, 3))]
    return [[*p, 0] for p in make_prompts([length - 1] * batch, seed=1, vocab_size=500, avoid=(0, 1, 2))]  # + EOS


def measure(llm: Any, inputs: list[list[int]], repeats: int, clock: Any) -> float:
    """Best time in seconds of one ``LLM.embed`` call over ``inputs`` (after a warm-up call)."""
    batch = [{"prompt_token_ids": p} for p in inputs]
    llm.embed(batch, use_tqdm=False)
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        llm.embed(batch, use_tqdm=False)
        best = min(best, clock() - start)
    return best


def run_model(kind: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from npu_testkit import pooling
    from npu_testkit.engine import emulated_env, engine

    if max(args.lengths) > pooling.MAX_LEN:
        raise SystemExit(f"--lengths: at most {pooling.MAX_LEN} tokens (the tiny models' max_model_len)")
    # No prefix caching (vLLM enables it for last-token pooling): every timed call re-sends the same inputs.
    kwargs = {**pooling.llm_kwargs(kind), "max_num_seqs": args.batch, "enforce_eager": args.eager}
    kwargs["enable_prefix_caching"] = False
    kwargs["max_num_batched_tokens"] = max(pooling.MAX_LEN, args.batch * max(args.lengths))
    rows = []
    with tempfile.TemporaryDirectory() as tmp, engine(pooling.build(kind), emulated_env(tmp), **kwargs) as llm:
        for length in args.lengths:
            seconds = measure(llm, prompts(kind, length, args.batch), args.repeats, CLOCKS[args.clock])
            rows.append(
                {
                    "model": kind,
                    "tokens": length,
                    "batch": args.batch,
                    "graphs": not args.eager,
                    "clock": args.clock,
                    "seconds": seconds,
                    "sequences_per_s": args.batch / seconds,
                    "tokens_per_s": args.batch * length / seconds,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [row for kind in args.models for row in run_model(kind, args)]
    mode = "eager" if args.eager else "PIECEWISE graphs"
    print(
        f"embedding throughput, emulated device, {mode}, batch {args.batch}, {args.clock} clock, best of {args.repeats}"
    )
    for r in rows:
        print(
            f"  {r['model']:<12} {r['tokens']:>4} tokens: {r['sequences_per_s']:8.1f} sequences/s ({r['tokens_per_s']:.0f} tokens/s)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
