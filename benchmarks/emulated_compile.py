# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``npu.emulated_compile``: decode step time of the emulated device eager / twin replay / inductor-compiled twin
replay, A/B/C alternated inside one engine, and the compile cost per capture size.

One in-process engine (FULL_DECODE_ONLY by default, ``--mode PIECEWISE`` for the other) with
``npu.emulated_compile=inductor`` serves the tiny Qwen2 of ``vs_vllm_cpu.py`` (hidden 128, 4 layers) with capture
sizes ``--sizes``. For each batch size, ``--rounds`` rounds each time the three variants in turn:

- ``eager``: the graph wrapper bypassed (the model runs eagerly on the same padded batch);
- ``twin``: the captured graphs replayed uncompiled (their compiled pieces set aside for the round);
- ``compiled``: the captured graphs replayed with their inductor-compiled pieces.

A variant's time per decode step is ``(t(generate 1 + N tokens) - t(generate 1 token)) / N`` in *process CPU time*
(``time.process_time``): on a machine shared with other jobs, wall time mostly measures the wait for a core. The
best round of each variant is printed; torch runs ``--threads`` threads (1, as ``vs_vllm_cpu.py``).

Run: ``.venv/bin/python benchmarks/emulated_compile.py [--sizes 1 8] [--rounds 5] [--json out.json]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")

MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
VARIANTS = ("eager", "twin", "compiled")


def _graphs(llm: Any) -> list[Any]:
    from vllm_npu.platform.graphs.wrapper import NPUGraphWrapper

    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    found = []
    for module in [runner.model, *getattr(runner.model, "modules", lambda: [])()]:
        if isinstance(module, NPUGraphWrapper):
            found += [entry.cudagraph for entry in module.concrete_cudagraph_entries.values()]
    return found


@contextlib.contextmanager
def variant(llm: Any, name: str, graphs: list[Any]) -> Iterator[None]:
    from vllm_npu.platform.graphs.wrapper import NPUGraphWrapper

    saved = [g.compiled for g in graphs]
    with contextlib.ExitStack() as stack:
        if name == "eager":
            stack.enter_context(patch.object(NPUGraphWrapper, "__call__", lambda self, *a, **k: self.runnable(*a, **k)))
        elif name == "twin":
            for g in graphs:
                g.compiled = None
        try:
            yield
        finally:
            for g, c in zip(graphs, saved, strict=True):
                g.compiled = c


def step_cpu_ms(llm: Any, prompts: list[list[int]], tokens: int) -> float:
    from vllm import SamplingParams

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.process_time()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.process_time() - start

    run(1 + tokens)  # warm-up
    return 1000.0 * (run(1 + tokens) - run(1)) / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="FULL_DECODE_ONLY", choices=("FULL_DECODE_ONLY", "PIECEWISE"))
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    from npu_testkit.engine import emulated_env, engine, make_prompts, tiny_config
    from npu_testkit.models import build_tiny_model

    torch.set_num_threads(args.threads)
    model = build_tiny_model(tiny_config("qwen2", **MODEL))
    kwargs = {
        "compilation_config": {"cudagraph_mode": args.mode, "cudagraph_capture_sizes": args.sizes},
        "additional_config": {"npu": {"emulated_compile": "inductor"}},
        "max_num_seqs": max(args.sizes),
    }
    results: dict[str, Any] = {"args": vars(args), "step_ms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        with engine(model, emulated_env(tmp), **kwargs) as llm:
            results["init_s"] = time.perf_counter() - start
            (info,) = llm.collective_rpc("npu_runtime_info")
            results["compile_seconds"] = info["graphs"]["compile_seconds"]
            results["capture_seconds"] = info["graphs"]["capture_seconds"]
            graphs = _graphs(llm)
            assert graphs and all(g.compiled is not None for g in graphs), "no compiled graphs found"
            for b in args.sizes:
                prompts = make_prompts([8] * b, seed=b)
                rounds: dict[str, list[float]] = {v: [] for v in VARIANTS}
                for _ in range(args.rounds):
                    for v in VARIANTS:
                        with variant(llm, v, graphs):
                            rounds[v].append(step_cpu_ms(llm, prompts, args.tokens))
                results["step_ms"][b] = rounds

    print(f"{args.mode}, tiny Qwen2 (hidden 128, 4 layers), {args.threads} thread(s); load {os.getloadavg()}")
    print(f"engine init {results['init_s']:.1f} s")
    for size, secs in sorted(results["compile_seconds"].items()):
        print(f"size {size:>3}: capture {results['capture_seconds'][size]:.2f} s, of which inductor {secs:.2f} s")
    print(f"{'batch':>6} " + " ".join(f"{v:>9}" for v in VARIANTS) + "  (best CPU ms per decode step)")
    for b, rounds in results["step_ms"].items():
        print(f"{b:>6} " + " ".join(f"{min(rounds[v]):9.2f}" for v in VARIANTS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
