# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Speculative decoding on the emulated device: decode throughput and mean accepted length, MTP k = 1..3 vs none.

Target: the tiny DeepSeek-V3 with one MTP layer of ``npu_testkit.drafts.build_mtp_model`` (MLA, MoE, float32,
random weights, so the MTP drafts are almost never accepted: the numbers show the cost of the drafting path, the
worst case). ``--eagle`` adds the tiny 8-layer Llama with the trained EAGLE-1 head of tests/e2e/test_spec_decode_eagle.py,
k = 1..3 vs none (drafts often accepted). One engine per configuration (separate engine-core process: vLLM drafts
only from its busy loop); ``--batch`` prompts of 8..60 tokens, ``--tokens`` greedy tokens each, best of
``--repeats`` after a warm-up. Reported: generated tokens / s (wall time of the whole ``generate``), and vLLM's mean
accepted length ``1 + accepted / drafts`` (tokens per verification step per request). Every configuration must
produce the same tokens as the one without speculation (checked).

Run: ``.venv/bin/python benchmarks/spec_decode.py [--tokens 64] [--batch 4] [--repeats 2] [--eagle] [--json out.json]``
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")

from _engine_bench import write_json  # noqa: E402


def _run(model: Path, spec: dict[str, Any] | None, prompts: list[list[int]], tokens: int, repeats: int) -> dict:
    from npu_testkit.engine import emulated_env, engine, greedy
    from npu_testkit.spec_e2e import counter

    kwargs: dict[str, Any] = {"max_num_batched_tokens": 256, "disable_log_stats": False}
    if spec is not None:
        kwargs["speculative_config"] = spec
    with tempfile.TemporaryDirectory() as tmp, engine(model, emulated_env(tmp, multiprocessing=True), **kwargs) as llm:
        out = greedy(llm, prompts, tokens)  # warm-up, and the tokens compared across configurations
        best = float("inf")
        drafts0 = counter(llm, "vllm:spec_decode_num_drafts")
        acc0 = counter(llm, "vllm:spec_decode_num_accepted_tokens")
        for _ in range(repeats):
            start = time.perf_counter()
            greedy(llm, prompts, tokens)
            best = min(best, time.perf_counter() - start)
        drafts = counter(llm, "vllm:spec_decode_num_drafts") - drafts0
        accepted = counter(llm, "vllm:spec_decode_num_accepted_tokens") - acc0
    return {
        "tokens_per_s": len(prompts) * tokens / best,
        "mean_accepted_length": 1.0 + accepted / drafts if drafts else None,
        "tokens": out,
    }


def _series(name: str, model: Path, spec_of, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for k in (0, 1, 2, 3):
        rows[f"k={k}"] = _run(model, spec_of(k) if k else None, prompts, args.tokens, args.repeats)
    base = rows["k=0"]["tokens"]
    for key, row in rows.items():
        if row.pop("tokens") != base:
            raise SystemExit(f"{name} {key}: greedy tokens differ from the run without speculation")
    print(f"{name}: {args.batch} requests x {args.tokens} tokens, emulated device")
    print(f"{'config':>8} {'tokens/s':>10} {'vs none':>8} {'mean accepted len':>18}")
    for key, row in rows.items():
        mal = row["mean_accepted_length"]
        ratio = row["tokens_per_s"] / rows["k=0"]["tokens_per_s"]
        print(f"{key:>8} {row['tokens_per_s']:10.1f} {ratio:8.2f} {f'{mal:.2f}' if mal else '-':>18}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--eagle", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    from npu_testkit.drafts import build_mtp_model
    from npu_testkit.engine import make_prompts, tiny_config

    lengths = [8 + (52 * i) // max(1, args.batch - 1) for i in range(args.batch)]
    prompts = make_prompts(lengths, seed=5)
    results = {
        "mtp": _series(
            "DeepSeek-V3 MTP",
            build_mtp_model(tiny_config("deepseek_v3")),
            lambda k: {"method": "deepseek_mtp", "num_speculative_tokens": k},
            args,
            prompts,
        )
    }
    if args.eagle:
        from npu_testkit.drafts import train_eagle_head
        from npu_testkit.models import build_tiny_model
        from npu_testkit.spec_e2e import mixed_prompts

        target = build_tiny_model(tiny_config("llama", num_hidden_layers=8), std=0.1)
        head = train_eagle_head(target, mixed_prompts() + make_prompts([4, 9, 17, 25, 33, 48, 70, 90], seed=40), 64)
        results["eagle"] = _series(
            "Llama EAGLE (trained head)",
            target,
            lambda k: {"method": "eagle", "model": str(head), "num_speculative_tokens": k},
            args,
            prompts,
        )
    write_json(args.json, results)


if __name__ == "__main__":
    main()
