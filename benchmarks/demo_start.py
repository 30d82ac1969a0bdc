# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The README's main job, ``vllm-npu demo``, from a user's shell: its default mode (compiled FULL_DECODE_ONLY on the
emulated device, issue 35) cold and warm, against ``--enforce-eager``.

One run with empty compile caches first (``cold``: the plugin's ``$VLLM_NPU_CACHE_DIR/emulated_compile`` and
inductor's ``TORCHINDUCTOR_CACHE_DIR`` both new, what a fresh machine pays once), then ``--pairs`` pairs of a warm
default run and an eager run, alternated. Each run is the whole command in a fresh process (``/usr/bin/time``-like:
wall seconds, and the user + system CPU seconds of the process and its children, from ``RUSAGE_CHILDREN``), with the demo's
own ``--json`` report (engine init, tokens/s, the graph mode line). The demo model is trained once before (not
timed; ``npu_testkit.demo.seed_demo_model``).

Run: ``.venv/bin/python benchmarks/demo_start.py [--pairs 3] [--cpus 1] [--max-tokens 40] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def run_demo(name: str, work: Path, extra: list[str], pin: list[str], max_tokens: int) -> dict[str, Any]:
    """One ``vllm-npu demo --json`` in a fresh process: its wall seconds and its report's figures."""
    env = {
        **os.environ,
        "VLLM_NPU_CACHE_DIR": str(work / "npu_cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
    }
    demo = Path(sys.executable).with_name("vllm-npu")
    cmd = [*pin, str(demo), "demo", "--json", "--max-tokens", str(max_tokens), *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"demo_start: the {name} run failed:\n{err[-3000:]}")
    report = json.loads(out)
    return {
        "name": name,
        "wall_s": round(wall, 2),
        "engine_init_s": report["engine_init_seconds"],
        "tokens_per_s": report["tokens_per_second"],
        "graph_mode": report["graph_mode"],
    }


def cpu_of_children() -> float:
    """User + system CPU seconds of every child waited for so far (``resource.RUSAGE_CHILDREN``)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(name: str, work: Path, extra: list[str], pin: list[str], max_tokens: int) -> dict[str, Any]:
    before = cpu_of_children()
    result = run_demo(name, work, extra, pin, max_tokens)
    result["cpu_s"] = round(cpu_of_children() - before, 2)
    result["load"] = round(os.getloadavg()[0], 2)
    print(
        f"{name:8s} wall {result['wall_s']:6.1f} s  CPU {result['cpu_s']:6.1f} s  engine init "
        f"{result['engine_init_s']:5.1f} s  {result['tokens_per_s']} tok/s  load {result['load']}\n"
        f"         {result['graph_mode']}",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--cpus", default=None, help="pin every run to these CPUs (taskset -c list), e.g. 1")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    from npu_testkit.demo import seed_demo_model

    work = Path(tempfile.mkdtemp(prefix="bench-demo-start-"))
    seed_demo_model(work / "npu_cache")  # trained once per machine, linked here (not timed)
    pin = ["taskset", "-c", args.cpus] if args.cpus else []
    runs = [timed("cold", work, [], pin, args.max_tokens)]
    for i in range(args.pairs):
        runs.append(timed(f"warm{i + 1}", work, [], pin, args.max_tokens))
        runs.append(timed(f"eager{i + 1}", work, ["--enforce-eager"], pin, args.max_tokens))
    for kind in ("warm", "eager"):
        sel = [r for r in runs if r["name"].startswith(kind)]
        print(
            f"median {kind:5s}: wall {statistics.median(r['wall_s'] for r in sel):6.1f} s, CPU "
            f"{statistics.median(r['cpu_s'] for r in sel):6.1f} s, engine init "
            f"{statistics.median(r['engine_init_s'] for r in sel):5.1f} s ({len(sel)} runs)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
