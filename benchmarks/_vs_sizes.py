# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Model sizes, workloads and the memory-bandwidth bound of benchmarks/vs_vllm_cpu.py (issue 35).

Sizes are Qwen2 configs built on the fly with random weights (``npu_testkit.models.build_tiny_model``, cached by
config): ``tiny`` (issue 19's model, ~0.4M parameters), ``100m`` (~100M) and ``500m`` (~500M), with a 32000-token
vocabulary for the two larger ones. Workloads: ``decode`` (the ``--prompts`` / ``--prompt-len`` / ``--tokens`` of the
command line), ``decode-b1`` and ``decode-b16`` (1 or 16 requests of 64 prompt tokens, ``--tokens`` new ones),
``prefill-1k`` (one prompt of 1024 tokens, one new token; its throughput counts prompt tokens).

The bound: a decode step reads every weight once, so a host that reads ``B`` bytes/s can decode at most
``batch * B / weight_bytes`` tokens/s (KV-cache reads and activations come on top, so the bound is optimistic).
``B`` is measured per size over a float32 buffer as large as its weights (at least 256 MiB), the better of a plain
``tensor.sum()`` and a matrix-vector product (``torch.mv``), best of 5, in a process pinned and threaded as the runs
are, per wall second and per CPU second; each side's share is given against both (tokens/s
against the wall bound, tokens per CPU second against the CPU one: on a loaded host only the latter is fair).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

#: name -> Qwen2 config overrides of npu_testkit.engine.tiny_config("qwen2").
SIZES: dict[str, dict[str, Any]] = {
    # The tiny Qwen2 of issue 19: hidden 128, 4 layers, GQA 4/2 heads (head dim 32).
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,  # room for the 1k-token prefill
    ),
    # ~105M parameters: 12 layers of hidden 768 (GQA 12/4 heads of 64), SwiGLU 2048, untied 32000-token head.
    "100m": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
    ),
    # ~505M parameters: 24 layers of hidden 1280 (GQA 20/4 heads of 64), SwiGLU 3584, untied 32000-token head.
    "500m": dict(
        hidden_size=1280,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=20,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
    ),
}

#: name -> (prompts, prompt tokens, new tokens or None for --tokens, prefill: throughput counts prompt tokens).
WORKLOADS: dict[str, tuple[int | None, int | None, int | None, bool]] = {
    "decode": (None, None, None, False),
    "decode-b1": (1, 64, None, False),
    "decode-b16": (16, 64, None, False),
    "prefill-1k": (1, 1024, 1, True),
}

BANDWIDTH_CODE = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
n = max(int(sys.argv[2]) // 4, 64 * 1024 * 1024)  # float32 elements: the weights' size, at least 256 MiB
cols = 4096
w = torch.ones(n // cols, cols, dtype=torch.float32)
x = torch.ones(cols, dtype=torch.float32)
best = {}
for name, read in (("sum", lambda: w.sum()), ("mv", lambda: torch.mv(w, x))):
    read()
    wall = cpu = float("inf")
    for _ in range(5):
        t, c = time.perf_counter(), time.process_time()
        read()
        wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.process_time() - c)
    best[name] = (w.numel() * w.element_size() / wall, w.numel() * w.element_size() / max(cpu, 1e-9))
name = max(best, key=lambda k: best[k][0])
print(name, *best[name])
"""


def workload(name: str, prompts: int, prompt_len: int, tokens: int) -> dict[str, Any]:
    """The child's request shape for workload ``name`` (command-line values fill what the workload leaves open)."""
    if name not in WORKLOADS:
        raise SystemExit(f"vs_vllm_cpu: unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    n, length, new, prefill = WORKLOADS[name]
    return {"prompts": n or prompts, "prompt_len": length or prompt_len, "tokens": new or tokens, "prefill": prefill}


def build_size(name: str, dtype: str) -> Path:
    """The checkpoint directory of size ``name`` (built on first use, then reused)."""
    from npu_testkit.engine import tiny_config
    from npu_testkit.models import build_tiny_model

    if name not in SIZES:
        raise SystemExit(f"vs_vllm_cpu: unknown size {name!r}; choose from {', '.join(SIZES)}")
    # Smaller init for the larger models: their activations stay finite through 12-24 random layers.
    std = 0.2 if name == "tiny" else 0.02
    return build_tiny_model(tiny_config("qwen2", **SIZES[name]), dtype=dtype, std=std)


def weight_bytes(model: Path) -> int:
    """Bytes of the checkpoint's tensors (the safetensors files: a decode step reads each weight once)."""
    return sum(f.stat().st_size for f in model.glob("*.safetensors"))


def measure_bandwidth(pin: list[str], threads: int, nbytes: int) -> tuple[float, float, str]:
    """Read bandwidth over a float32 buffer of ``nbytes`` (at least 256 MiB; the model's weights, so that caches
    hold as much of it as of them), pinned and threaded as the benchmark's runs: bytes per wall second and per CPU
    second (the latter holds on a loaded host, where wall time also counts the wait for a core), the better of a
    plain ``tensor.sum()`` and a matrix-vector product (``torch.mv``, BLAS's gemv: what a batch-1 linear layer
    is), and which one that was. One thread of ``sum`` can be bound by its adds, not by memory, so the bound would
    be too low without ``mv``."""
    done = subprocess.run(
        [*pin, sys.executable, "-c", BANDWIDTH_CODE, str(threads), str(nbytes)],
        capture_output=True,
        text=True,
        check=True,
    )
    name, wall, cpu = done.stdout.strip().splitlines()[-1].split()
    return float(wall), float(cpu), name


def decode_bound(batch: int, bandwidth: float, model_bytes: int) -> float:
    """The most decode tokens/s that ``bandwidth`` allows: every step reads every weight once for ``batch`` tokens."""
    return batch * bandwidth / model_bytes


def summary_line(size: str, name: str, runs: dict[str, list[dict]], bounds: tuple[float, float] | None) -> str:
    """One line per size and workload: each side's median tokens/s (wall) and tokens per CPU second, their ratios and,
    for decode, each one's share of the bound (``bounds``: wall and CPU-time, :func:`decode_bound`; None for
    prefill)."""
    import statistics

    parts = [f"{size:>5s} {name:<11s}"]
    med: dict[str, tuple[float, float]] = {}
    for side, results in runs.items():
        if not results:
            continue
        wall = statistics.median(r["tokens_per_s"] for r in results)
        cpu = statistics.median(1.0 / r["cpu_s_per_token"] for r in results)
        med[side] = (wall, cpu)
        share = "" if bounds is None else f" ({100 * wall / bounds[0]:.0f} % / {100 * cpu / bounds[1]:.0f} %)"
        parts.append(f"{side} {wall:8.0f} tok/s {cpu:8.0f} tok/cpu-s{share}")
    for side in ("ours", "eager"):
        if side in med and "peer" in med:
            ratio = f"{med[side][0] / med['peer'][0]:.2f} / {med[side][1] / med['peer'][1]:.2f}"
            parts.append(f"ratio{'' if side == 'ours' else ' eager'} {ratio}")
    if bounds is not None:
        parts.append(f"bound {bounds[0]:.0f} tok/s / {bounds[1]:.0f} tok/cpu-s")
    return "  ".join(parts)


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)
