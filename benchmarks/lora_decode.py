# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Multi-LoRA decode throughput of real vLLM on the emulated device: the overhead of the Punica wrapper's path.

Model: the tiny Qwen2 of ``decode_throughput.py`` (hidden 256, 4 layers, 8 query / 2 KV heads), float32, in-process
engine core. Adapters: rank 16 on every projection (q/k/v/o/gate/up/down), written as PEFT checkpoints. Workload:
``--prompts`` prompts of 32 tokens, ``--tokens`` new tokens each (greedy), best of ``--repeats`` timed runs after a
warm-up, the LoRA rows run round-robin. Rows:

- ``no LoRA engine``: ``enable_lora=False`` (the reference of every ratio);
- ``LoRA engine, 0 adapters``: ``enable_lora=True, max_loras=4``, no request uses an adapter;
- ``1 adapter``: every request uses the same adapter;
- ``4 adapters``: the requests are spread over four adapters (all four slots active every step).

On the emulated device the kernels are the reference twins (plain torch), so the ratios measure the Python path and
the CPU matmuls, not NPU kernels. Wall time on a shared machine includes other processes' load; the ratios to the
0-adapter row come from the same engine and the same round-robin rounds, so they are the least exposed to it.

Run: ``.venv/bin/python benchmarks/lora_decode.py [--prompts 8] [--tokens 64] [--json out.json]``
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


def _rounds(llm: Any, prompts: list[list[int]], tokens: int, cases: dict[str, Any], repeats: int) -> dict[str, float]:
    """tokens/s per case (``{name: lora_request list or None}``): the cases are run round-robin ``repeats`` times
    after one warm-up each (which also loads the adapters), so background load hits them alike; best run kept."""
    from npu_testkit.engine import token_prompts
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    def run(lora: Any) -> float:
        t = time.perf_counter()
        outs = llm.generate(token_prompts(prompts), params, lora_request=lora, use_tqdm=False)
        wall = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        return wall

    for lora in cases.values():
        run(lora)
    best = {name: float("inf") for name in cases}
    for _ in range(repeats):
        for name, lora in cases.items():
            best[name] = min(best[name], run(lora))
    return {name: len(prompts) * tokens / wall for name, wall in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    from npu_testkit.engine import emulated_env, engine, make_prompts, tiny_config
    from npu_testkit.lora import write_peft_adapter
    from npu_testkit.models import build_tiny_model
    from vllm.lora.request import LoRARequest

    model = build_tiny_model(tiny_config("qwen2", **SMALL_QWEN2))
    prompts = make_prompts([32] * args.prompts, seed=0)
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(write_peft_adapter(model, root / f"a{i}", rank=args.rank, seed=i)))
        for i in range(4)
    ]
    rows: dict[str, float] = {}
    with engine(model, emulated_env(root / "base", kv_cache_gb=0.25)) as llm:
        rows.update(_rounds(llm, prompts, args.tokens, {"no LoRA engine": None}, args.repeats))
    lora_kwargs = {"enable_lora": True, "max_loras": 4, "max_lora_rank": args.rank}
    n = len(prompts)
    cases = {
        "LoRA engine, 0 adapters": [None] * n,
        "1 adapter": [adapters[0]] * n,
        "4 adapters": [adapters[i % 4] for i in range(n)],
    }
    with engine(model, emulated_env(root / "lora", kv_cache_gb=0.25), **lora_kwargs) as llm:
        rows.update(_rounds(llm, prompts, args.tokens, cases, args.repeats))

    base = rows["no LoRA engine"]
    result = {
        "workload": f"{args.prompts} prompts x 32 tokens, {args.tokens} new tokens, rank {args.rank}, float32",
        "tokens_per_s": {k: round(v, 1) for k, v in rows.items()},
        "ratio_to_no_lora": {k: round(v / base, 3) for k, v in rows.items()},
        # same engine, same rounds: the least exposed to background load
        "ratio_to_0_adapters": {
            k: round(v / rows["LoRA engine, 0 adapters"], 3) for k, v in rows.items() if k != "no LoRA engine"
        },
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
