#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Cost of the NPU platform hook on vLLM's start-up path.

vLLM resolves the platform in every process (front-end, engine core, each worker): it loads the
``vllm.platform_plugins`` entry point ``npu`` (= ``import vllm_npu.platform``) and calls ``register()`` twice. This
benchmark measures exactly that, every sample in a fresh interpreter:

- ``import``: ``import vllm_npu.platform`` (what loading the entry point costs);
- ``cold``:   the import plus the first ``register()`` (device decision: env parsing, the NPU probe) - the target;
- ``warm``:   the second ``register()`` (vLLM calls it again for the class path);
- ``cpu``:    CPU time of ``cold`` (less sensitive than wall time to other processes on a shared machine);

for ``VLLM_NPU_DEVICE`` unset (a CPU host: the hook declines) and ``emulated`` (it activates), in two contexts:

- ``in-vllm``: the standard-library modules vLLM has always imported before it calls the hook (logging,
  dataclasses, typing, enum, re, inspect, importlib.metadata, ...) are imported first, so the number is what the
  hook adds to a vLLM process. PASS/FAIL is judged on this one: median ``cold`` <= 20 ms.
- ``bare``: nothing preloaded (the hook's cost including those standard-library imports).

``--vllm`` adds a context that really imports vLLM first (``import vllm.plugins``, which loads torch: slow).
Our modules' bytecode is written by a warm-up run first, as any pip/uv install does (``--no-pyc`` measures
compiling from source instead, e.g. an editable install with ``PYTHONDONTWRITEBYTECODE=1``).

``--python`` runs the samples with another interpreter, e.g. a venv holding our wheels (one ``site-packages``
directory instead of the dev env's eight editable ``src`` directories that the ``vllm_npu`` namespace spans).

Usage: python benchmarks/register_hook.py [--runs 21] [--target-ms 20] [--vllm] [--no-pyc] [--python PY] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# Modules vLLM imports long before vllm.platforms calls the hook (vllm.envs, vllm.logger, vllm.plugins, torch...).
_VLLM_STDLIB = (
    "logging, logging.config, dataclasses, typing, enum, re, inspect, functools, glob, json, os, threading, "
    "collections.abc, contextlib, importlib.util, importlib.metadata, itertools, traceback"
)
PRELOAD = {"bare": "", "in-vllm": f"import {_VLLM_STDLIB}", "vllm": "import vllm.plugins, vllm.envs"}

_SAMPLE = r"""
{preload}
import json, time
c0 = time.process_time()
t0 = time.perf_counter()
import vllm_npu.platform as platform
t1 = time.perf_counter()
first = platform.register()
t2 = time.perf_counter()
c2 = time.process_time()
second = platform.register()
t3 = time.perf_counter()
assert first == second, (first, second)
print("@@" + json.dumps({{"import": t1 - t0, "cold": t2 - t0, "warm": t3 - t2, "cpu": c2 - c0, "result": first}}))
"""

SETTINGS = {"unset": None, "emulated": "emulated"}


def sample(context: str, device: str | None, pyc: bool, python: str = sys.executable) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_NPU_", "VLLM_PLUGINS"))}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if not pyc:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    if device is not None:
        env["VLLM_NPU_DEVICE"] = device
    code = _SAMPLE.format(preload=PRELOAD[context])
    flags = [] if pyc else ["-B"]
    out = subprocess.run([python, *flags, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.rpartition("@@")[2])


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values) * 1e3, "min": min(values) * 1e3, "max": max(values) * 1e3}


def measure(contexts: list[str], runs: int, pyc: bool, python: str = sys.executable) -> dict[str, dict[str, dict]]:
    results: dict[str, dict[str, dict]] = {}
    for context in contexts:
        for label, device in SETTINGS.items():
            sample(context, device, pyc, python)  # warm-up: OS file cache, and our .pyc files unless --no-pyc
            samples = [sample(context, device, pyc, python) for _ in range(runs)]
            results.setdefault(context, {})[label] = {
                "result": samples[0]["result"],
                **{f"{key}_ms": _stats([s[key] for s in samples]) for key in ("import", "cold", "warm", "cpu")},
            }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=21, help="fresh interpreters per setting and context (default 21)")
    parser.add_argument("--target-ms", type=float, default=20.0, help="budget for the median cold cost (default 20)")
    parser.add_argument("--vllm", action="store_true", help="also measure after really importing vLLM (slow)")
    parser.add_argument("--no-pyc", action="store_true", help="compile our modules from source in every sample")
    parser.add_argument("--python", default=sys.executable, help="interpreter to measure (default: this one)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args(argv)

    contexts = ["in-vllm", "bare"] + (["vllm"] if args.vllm else [])
    results = measure(contexts, args.runs, pyc=not args.no_pyc, python=args.python)
    judged = max(r["cold_ms"]["median"] for r in results["in-vllm"].values())
    passed = judged <= args.target_ms
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    if args.json:
        print(
            json.dumps(
                {
                    "runs": args.runs,
                    "target_ms": args.target_ms,
                    "pass": passed,
                    "loadavg": load,
                    "python": args.python,
                    "pyc": not args.no_pyc,
                    "contexts": results,
                },
                indent=2,
            )
        )
    else:
        print(
            f"vllm_npu.platform:register: median over {args.runs} fresh interpreters (min..max), "
            f"bytecode {'cached' if not args.no_pyc else 'compiled from source'}, "
            f"load average {' '.join(f'{x:.1f}' for x in load) if load else '?'} on {os.cpu_count()} CPUs, "
            f"python {args.python}"
        )
        for context, settings in results.items():
            for label, r in settings.items():
                print(f"  [{context}] VLLM_NPU_DEVICE={label:<9} -> {r['result']}")
                for key in ("import", "cold", "warm", "cpu"):
                    m = r[f"{key}_ms"]
                    print(f"      {key:<7} {m['median']:9.3f} ms   ({m['min']:.3f}..{m['max']:.3f})")
        print(
            f"{'PASS' if passed else 'FAIL'}: median cold cost in a vLLM process (import + first register) "
            f"{judged:.3f} ms {'<=' if passed else '>'} {args.target_ms:g} ms"
        )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
