# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""KV + state memory per sequence and decode throughput: Qwen3-Next (gated delta-net hybrid) vs a dense model.

Memory per sequence at each ``--contexts`` length, from the layers' cache specs (vLLM 0.11's
``MambaStateShapeCalculator.gated_delta_net_state_shape`` for the GDN layers, ``2 x kv_heads x head_dim`` per token for
attention), before vLLM's page rounding and state-page padding:

- ``tiny``: the test model (``npu_testkit.models_hybrid``: 3 GDN + 1 attention layer, hidden 64) and its dense twin
  (the same config with every layer full attention);
- ``qwen3-next-80b``: Qwen3-Next-80B-A3B's published shape (48 layers, every 4th full attention with 2 KV heads of
  256; GDN 16 key / 32 value heads of 128, conv 4; bf16; TP=1) and its all-attention twin.

Decode throughput (unless ``--no-engine``): the tiny pair in real vLLM on the emulated device, float32, eager,
in-process engine core, ``--prompts`` sequences at each context, ``--tokens`` new tokens: the median wall time of the
engine steps once every sequence is decoding (the prefill is not in it). CPU numbers: they show the shape of the saving (the GDN step does not grow with the context),
not NPU speed.

Run: ``.venv/bin/python benchmarks/hybrid_memory.py [--contexts 1024 8192] [--no-engine] [--json out.json]``
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")

#: Qwen3-Next-80B-A3B's cache-relevant shape (its config.json).
QWEN3_NEXT_80B = dict(
    num_hidden_layers=48,
    full_attention_interval=4,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    dtype_bytes=2,
)


def per_sequence_bytes(shape: dict[str, Any], layer_types: list[str], context: int) -> dict[str, int]:
    """Attention KV and GDN state bytes one sequence of ``context`` tokens holds (TP=1)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    conv, ssm = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1,
        shape["linear_num_key_heads"],
        shape["linear_num_value_heads"],
        shape["linear_key_head_dim"],
        shape["linear_value_head_dim"],
        shape["linear_conv_kernel_dim"],
        0,
    )
    state = (conv[0] * conv[1] + ssm[0] * ssm[1] * ssm[2]) * shape["dtype_bytes"]
    per_token = 2 * shape["num_key_value_heads"] * shape["head_dim"] * shape["dtype_bytes"]
    attention = sum(t == "full_attention" for t in layer_types)
    return {"kv": attention * per_token * context, "state": (len(layer_types) - attention) * state}


def memory_rows(contexts: list[int]) -> list[dict[str, Any]]:
    from npu_testkit.models_hybrid import tiny_qwen3_next_config

    tiny = tiny_qwen3_next_config()
    models = {
        "tiny": ({**tiny.to_dict(), "dtype_bytes": 4}, list(tiny.layer_types)),
        "qwen3-next-80b": (
            QWEN3_NEXT_80B,
            [
                "full_attention" if (i + 1) % QWEN3_NEXT_80B["full_attention_interval"] == 0 else "linear_attention"
                for i in range(QWEN3_NEXT_80B["num_hidden_layers"])
            ],
        ),
    }
    rows = []
    for name, (shape, types) in models.items():
        for context in contexts:
            hybrid = per_sequence_bytes(shape, types, context)
            dense = per_sequence_bytes(shape, ["full_attention"] * len(types), context)
            rows.append(
                {
                    "model": name,
                    "context": context,
                    "hybrid_kv_bytes": hybrid["kv"],
                    "hybrid_state_bytes": hybrid["state"],
                    "hybrid_total_bytes": hybrid["kv"] + hybrid["state"],
                    "dense_total_bytes": dense["kv"],
                    "ratio": (hybrid["kv"] + hybrid["state"]) / dense["kv"],
                }
            )
    return rows


def decode_step_ms(llm: Any, prompts: list[list[int]], tokens: int) -> float:
    """Median wall time in ms of the engine steps after every prompt has its first token (pure decode steps: the
    prefill, however long, is not in the number)."""
    import statistics
    import time

    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, params)
    started: set[str] = set()
    steps: list[float] = []
    while engine.has_unfinished_requests():
        decoding = len(started) == len(prompts)
        t0 = time.perf_counter()
        outputs = engine.step()
        if decoding:
            steps.append(time.perf_counter() - t0)
        started.update(o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids)
    return 1000.0 * statistics.median(steps)


def throughput_rows(contexts: list[int], prompts: int, tokens: int) -> list[dict[str, Any]]:
    from npu_testkit.engine import emulated_env, engine, make_prompts
    from npu_testkit.models import build_tiny_model
    from npu_testkit.models_hybrid import tiny_qwen3_next_config

    rows = []
    for name, config in (
        ("hybrid", tiny_qwen3_next_config(max_position_embeddings=16384)),
        ("dense", tiny_qwen3_next_config(max_position_embeddings=16384, layer_types=["full_attention"] * 4)),
    ):
        model = build_tiny_model(config)
        longest = max(contexts) + tokens + 2
        with engine(
            model,
            emulated_env(tempfile.mkdtemp(), kv_cache_gb=0.5),
            enforce_eager=True,
            max_model_len=longest,
            max_num_batched_tokens=2048,
        ) as llm:
            for context in contexts:
                ms = decode_step_ms(llm, make_prompts([context] * prompts, seed=context), tokens)
                rows.append({"model": name, "context": context, "ms_per_step": ms, "tokens_per_s": prompts * 1000 / ms})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--no-engine", action="store_true", help="memory rows only")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from _engine_bench import write_json

    results: dict[str, Any] = {"memory": memory_rows(args.contexts)}
    print(f"{'model':>15} {'context':>8} {'hybrid KV':>12} {'hybrid state':>13} {'dense KV':>12} {'ratio':>6}")
    for r in results["memory"]:
        print(
            f"{r['model']:>15} {r['context']:>8} {r['hybrid_kv_bytes'] / 2**20:>10.2f}Mi "
            f"{r['hybrid_state_bytes'] / 2**20:>11.2f}Mi {r['dense_total_bytes'] / 2**20:>10.2f}Mi {r['ratio']:>6.3f}"
        )
    if not args.no_engine:
        results["decode"] = throughput_rows(args.contexts, args.prompts, args.tokens)
        for r in results["decode"]:
            print(
                f"{r['model']:>8} context {r['context']:>6}: {r['ms_per_step']:.1f} ms/step, {r['tokens_per_s']:.1f} tok/s"
            )
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
