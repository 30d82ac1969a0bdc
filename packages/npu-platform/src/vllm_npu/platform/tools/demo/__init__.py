# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu demo``: the README's main job.

Runs real vLLM (``LLM.generate``) through the whole plugin stack on the emulated device with a small embedded model
trained on bundled public-domain text, then prints the completions, the throughput and which of our components ran.
Nothing is downloaded; the model is built once and cached (see :mod:`.checkpoint`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

DEFAULT_PROMPTS = (
    "Four score and seven years ago",
    "It was the best of times,",
    "Call me Ishmael.",
    "We the People of the United States,",
    "In the beginning God created",
    "It is a truth universally acknowledged,",
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("a prompt needs at least one non-blank character")
    return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-npu demo", description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=_positive_int, default=40, help="tokens to generate per prompt (default 40)")
    p.add_argument(
        "--prompt", action="append", dest="prompts", type=_prompt, help="a prompt (repeatable); default: six classics"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run eagerly (the default captures graphs: compiled FULL_DECODE_ONLY on the emulated device)",
    )
    p.add_argument(
        "--emulated-compile",
        choices=["auto", "none", "inductor"],
        default="auto",
        help="npu.emulated_compile; inductor: FULL_DECODE_ONLY graphs with compiled replay on the emulated device",
    )
    return p


def graph_mode(info: dict[str, Any]) -> str:
    """One line for the graph mode a worker ran (its ``npu_runtime_info``): eager, or the mode, its capture sizes
    and, for the emulated device's compiled replay, the compiled pieces and the on-disk cache's share of them."""
    mode = info["cudagraph_mode"]
    if mode == "NONE":
        return "eager (no graphs)"
    graphs = info.get("graphs") or {}
    line = f"{mode} graphs, capture sizes {info['capture_sizes']}"
    if sum((graphs.get("compiled") or {}).values()):
        pieces = graphs.get("pieces") or {}
        seconds = sum((graphs.get("compile_seconds") or {}).values())
        line += (
            f", compiled replay ({pieces.get('compiles', 0)} compiles, {pieces.get('disk_hits', 0)} from the on-disk "
            f"cache, {seconds:.1f} s)"
        )
    replays = sum((graphs.get("replays") or {}).values())
    return f"{line}, {replays} replays"


def _wants_notice(args: argparse.Namespace) -> bool:
    """Whether the start may compile (no ``--enforce-eager``, no ``--emulated-compile none``) and stdout is text."""
    return not args.json and not args.enforce_eager and args.emulated_compile != "none"


def _compile_notice() -> str:
    """What the default start does on the emulated device (issue 35), said before the wait it may cost."""
    if os.environ["VLLM_NPU_DEVICE"] != "emulated":
        return "engine start (graphs captured as the device's default mode)"
    from ...graphs.compile_cache import EMULATED_COMPILE_SUBDIR, default_cache_root

    return (
        "engine start: compiled FULL_DECODE_ONLY graphs (vLLM's default mode); the first start on a machine "
        "compiles them (about a minute on 2 cores), later starts load them from "
        f"{default_cache_root(EMULATED_COMPILE_SUBDIR)}; --enforce-eager starts without them"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # The demo is the emulated device's showcase; an explicit VLLM_NPU_DEVICE (e.g. npu on an Ascend host) wins.
    os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    json_out = None
    if args.json:
        # Keep stdout one JSON document: vLLM's logs and gloo's C++ prints go to stdout, here and in the engine's
        # child processes (they inherit file descriptor 1), so point fd 1 at stderr until the result is written.
        sys.stdout.flush()
        json_out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)

    from .checkpoint import ensure_demo_model

    t0 = time.perf_counter()
    try:
        model_dir, built = ensure_demo_model()
    except OSError as exc:  # the cache directory is not writable, is a file, the disk is full...
        where = exc.filename or "the cache directory"
        why = "it is not a directory" if exc.filename and os.path.isfile(exc.filename) else exc.strerror or str(exc)
        print(
            f"vllm-npu demo: cannot build the demo model under {where}: {why}; "
            "set VLLM_NPU_CACHE_DIR to a writable directory",
            file=sys.stderr,
        )
        return 2
    build_s = time.perf_counter() - t0
    if not args.json:
        state = f"built and trained in {build_s:.1f} s" if built else "cached"
        print(f"demo model: {model_dir} ({state})", flush=True)

    from vllm import LLM, SamplingParams

    if _wants_notice(args):
        print(_compile_notice(), flush=True)
    t1 = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        dtype=args.dtype,
        max_model_len=512,
        seed=0,
        enforce_eager=args.enforce_eager,
        additional_config={"npu": {"emulated_compile": args.emulated_compile}},
    )
    init_s = time.perf_counter() - t1
    prompts = list(args.prompts or DEFAULT_PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up, not timed
    t2 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t2
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    # NPUWorker.npu_runtime_info: what actually ran in each worker (a method name, so no pickled code is sent).
    report = llm.collective_rpc("npu_runtime_info")
    completions = [{"prompt": o.prompt, "completion": o.outputs[0].text} for o in outputs]
    result = {
        "model": str(model_dir),
        "device": os.environ["VLLM_NPU_DEVICE"],
        "completions": completions,
        "generated_tokens": n_tokens,
        "generate_seconds": round(gen_s, 3),
        "tokens_per_second": round(n_tokens / gen_s, 1) if gen_s > 0 else None,
        "engine_init_seconds": round(init_s, 2),
        "graph_mode": graph_mode(report[0]),
        "workers": report,
    }
    if json_out is not None:
        json_out.write(json.dumps(result, indent=2) + "\n")
        json_out.flush()
        return 0
    print()
    for item in completions:
        print(f"  {item['prompt']!r}\n    -> {item['completion']!r}")
    print(
        f"\n{n_tokens} tokens in {gen_s:.2f} s = {result['tokens_per_second']} tokens/s "
        f"({len(prompts)} prompts batched; engine init {init_s:.1f} s)"
    )
    for rank, info in enumerate(report):
        print(f"\ncomponents that ran (worker {rank}):")
        for key in ("platform", "worker", "model_runner"):
            print(f"  {key:<14} {info[key]}")
        print(f"  {'attention':<14} {', '.join(info['attention_backends'])}")
        ops = ", ".join(f"{k} x{v}" for k, v in info["plugin_modules"].items()) or "(none)"
        print(f"  {'ops in model':<14} {ops}")
        print(f"  {'kernels':<14} {info['kernel_backend']} ({info['device_mode']} device)")
        print(f"  {'components':<14} {', '.join(info['components'])}")
        print(f"  {'graph mode':<14} {graph_mode(info)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
