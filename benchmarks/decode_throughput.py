# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Decode throughput of real vLLM on the emulated device: 8 prompts x 64 new tokens on a small Qwen2.

Model: tiny Qwen2 built on the fly (hidden 256, 4 layers, 8 query / 2 KV heads, head dim 32, vocab 512), float32,
in-process engine core (no IPC in the numbers). Prompts: 8 x 32 tokens. Reports:

- tokens/s over the timed ``generate`` (best of ``--repeats`` runs after one warm-up run);
- a split of the time per engine step: model forward (of which attention, and inside the forward the per-layer phases:
  KV write and paged decode kernels, RoPE, RMSNorm, SiluAndMul, linear layers, the embedding), sampler, input
  preparation, the rest of ``execute_model`` and everything outside it (scheduler, detokenizer, output processing).

``--graph full_decode_only`` (capture size ``--prompts``) replays a captured graph per decode step instead, and
``--compile inductor`` compiles it (``npu.emulated_compile``). Inside a replay the per-layer modules no longer run, so
the split of the forward there is: the decode-attention tasks (``paged_decode``, the twin kernel run by the graph's
updatable tasks), the inductor-compiled pieces (``compiled_pieces``: linear layers, norms, RoPE, SwiGLU, embedding),
and the rest of the replay (KV writes, views, the address checks and the output copy).

The split wraps the runner's methods with timers (in this process: the engine core is in-process), so it adds a few
microseconds per wrapped call. ``--clock cpu`` (the default) times with this thread's CPU time (``time.thread_time``:
the engine core runs in the calling thread), the measure that survives a loaded machine; ``--clock wall`` with
``time.perf_counter``, which on a shared machine includes the wait for a core. ``--model tiny`` serves the tiny
Qwen2 of ``vs_vllm_cpu.py`` (hidden 128, 4 layers, 4/2 heads) instead.

Run: ``.venv/bin/python benchmarks/decode_throughput.py [--prompts 8] [--tokens 64] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict
from typing import Any

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")

SMALL_QWEN2 = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2
)


TINY_QWEN2 = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
)


class Timers:
    def __init__(self, clock: Any = time.perf_counter) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.enabled = False
        self.clock = clock

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        timers = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not timers.enabled:
                return fn(*args, **kwargs)
            t = timers.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.total[name] += timers.clock() - t
                timers.calls[name] += 1

        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()


# Per-layer phases inside the model forward (each wrapped module's forward, or the attention impl's kernel).
PHASES = ("kv_write", "paged_decode", "rope", "norm", "act", "linear", "embed", "compiled_pieces")


def wrap_layers(timers: Timers, model: Any) -> None:
    """Wrap the forward of every RoPE, RMSNorm, SiluAndMul, linear and embedding module of ``model``."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    kinds = (
        (RotaryEmbedding, "rope"),
        (RMSNorm, "norm"),
        (SiluAndMul, "act"),
        (LinearBase, "linear"),
        (VocabParallelEmbedding, "embed"),
    )
    for module in model.modules():
        for cls, name in kinds:
            if isinstance(module, cls):
                timers.wrap(module, "forward", name)
                break


def wrap_graph(timers: Timers, runner: Any) -> None:
    """Graph mode: time the wrapper's call as the forward, the graph tasks, and each graph's compiled pieces."""
    from vllm_npu.platform.graphs.emulated.twin import _Task
    from vllm_npu.platform.graphs.wrapper import NPUGraphWrapper

    timers.wrap(NPUGraphWrapper, "__call__", "model_forward")
    timers.wrap(_Task, "run", "paged_decode")
    for entry in runner.model.concrete_cudagraph_entries.values():
        split = entry.cudagraph.compiled
        for name in [n for n in vars(split) if n.startswith("submod_") and callable(vars(split)[n])] if split else []:
            timers.wrap(split, name, "compiled_pieces")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--graph", default="eager", choices=("eager", "full_decode_only"))
    parser.add_argument("--compile", default="none", choices=("none", "inductor"))
    parser.add_argument("--clock", default="cpu", choices=("cpu", "wall"))
    parser.add_argument("--model", default="small", choices=("small", "tiny"))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    config = SMALL_QWEN2 if args.model == "small" else TINY_QWEN2

    from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, tiny_config
    from npu_testkit.models import build_tiny_model

    model = build_tiny_model(tiny_config("qwen2", **config))
    prompts = make_prompts([args.prompt_len] * args.prompts, seed=0)
    timers = Timers(clock)
    kwargs: dict[str, Any] = {}
    if args.graph != "eager":
        kwargs["compilation_config"] = {"cudagraph_mode": args.graph.upper(), "cudagraph_capture_sizes": [args.prompts]}
        kwargs["additional_config"] = {"npu": {"emulated_compile": args.compile}}
    with engine(model, emulated_env(tempfile.mkdtemp(prefix="bench-decode-"), kv_cache_gb=0.25), **kwargs) as llm:
        worker = llm.collective_rpc(lambda self: self)[0]  # in-process engine: the worker object itself
        runner = worker.model_runner
        timers.wrap(runner, "execute_model", "execute_model")
        timers.wrap(runner, "_prepare_inputs", "prepare_inputs")
        timers.wrap(runner.model, "forward", "model_forward")
        timers.wrap(runner.sampler, "forward", "sampler")
        from vllm.attention.layer import Attention
        from vllm.config import get_layers_from_vllm_config

        for layer in get_layers_from_vllm_config(worker.vllm_config, Attention).values():
            timers.wrap(layer.impl, "forward", "attention")
            for attr, name in (("reshape_and_cache", "kv_write"), ("paged_decode", "paged_decode")):
                if hasattr(layer.impl, attr):
                    timers.wrap(layer.impl, attr, name)
        wrap_layers(timers, runner.model)
        if args.graph != "eager":
            wrap_graph(timers, runner)

        greedy(llm, prompts, args.tokens)  # warm-up
        best = None
        for _ in range(args.repeats):
            timers.reset()
            timers.enabled = True
            t = clock()
            out = greedy(llm, prompts, args.tokens)
            elapsed = clock() - t
            timers.enabled = False
            if best is None or elapsed < best[0]:
                best = (elapsed, dict(timers.total), dict(timers.calls))
        assert all(len(o) == args.tokens for o in out)

    elapsed, total, calls = best
    steps = calls.get("execute_model", 1)
    generated = args.prompts * args.tokens
    ms = lambda s: 1000 * s / steps  # noqa: E731
    split = {
        "model_forward_ms": ms(total.get("model_forward", 0.0)),
        "attention_ms (inside forward)": ms(total.get("attention", 0.0)),
        **{f"{name}_ms (inside forward)": ms(total.get(name, 0.0)) for name in PHASES},
        "sampler_ms": ms(total.get("sampler", 0.0)),
        "prepare_inputs_ms": ms(total.get("prepare_inputs", 0.0)),
        "rest_of_execute_model_ms": ms(
            total["execute_model"]
            - total.get("model_forward", 0)
            - total.get("sampler", 0)
            - total.get("prepare_inputs", 0)
        ),
        "outside_execute_model_ms": ms(elapsed - total["execute_model"]),
    }
    result = {
        "model": "qwen2 " + ",".join(f"{k}={v}" for k, v in config.items()),
        "clock": args.clock,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.tokens,
        "elapsed_s (in the clock)": elapsed,
        "tokens_per_s": generated / elapsed,
        "engine_steps": steps,
        "step_ms": 1000 * elapsed / steps,
        "split_per_step": split,
    }
    print(
        f"decode throughput: {result['tokens_per_s']:.0f} tokens/s ({generated} tokens in {elapsed:.2f} s, "
        f"{steps} steps, {result['step_ms']:.2f} ms/step)"
    )
    for k, v in split.items():
        print(f"  {k:40s} {v:7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
