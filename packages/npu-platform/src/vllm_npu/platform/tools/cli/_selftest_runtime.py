# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The runtime section of ``vllm-npu selftest``: the device runtime's rules and the layer around the kernels.

For the first Ascend host, each row checks one thing the emulated device can only imitate (``docs/npu-calls.md``,
"Runtime calls", names the audit rows each confirms):

- ``front-end``: building the engine config in the front-end process (``EngineArgs.create_engine_config``, which
  asks the platform for defaults) leaves the device runtime uninitialised, and the worker start method is spawn;
- ``fork rule``: a child that ``multiprocessing`` forks after its parent initialised the runtime cannot use the
  device (torch_npu's bad-fork error), which is why the front-end must not initialise it;
- ``graph task (gqa)`` / ``graph task (mla)``: one decode attention kernel captured in a static graph as an
  updatable task, then replayed with other sequence lengths after the task update, equals the eager call
  (:mod:`._selftest_graphs`);
- ``sleep with graphs``: an engine with FULL_DECODE_ONLY graphs sleeps at level 1 and 2 and wakes up; the greedy
  tokens after each wake-up equal those before, and the graphs were captured again;
- ``torchair restart``: two torchair engines on one compile-cache root with different KV-cache budgets; the second
  gets another KV-cache shape, and must compile into a new cache directory instead of loading the first's graphs.

The probes of the first two rows run in a child process (``python -m vllm_npu.platform.tools.cli._selftest_runtime
probe MODEL DTYPE OUT.json``): the selftest process itself has initialised the device for the kernel rows.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from vllm_npu.interface import DeviceMode

PASS, FAIL, SKIP = "pass", "FAIL", "skip"
#: Capture sizes of the graph legs: the selftest's three prompts need no more.
LEG_CAPTURE_SIZES = "1,2,4"

#: ``leg(extra_args) -> result`` of :func:`.selftest._leg`, bound to the model, device and dtype of the run.
Leg = Callable[[Sequence[str]], dict[str, Any]]


def _row(check: str, status: str, detail: str, confirms: str, seconds: float) -> dict[str, Any]:
    return {"check": check, "status": status, "detail": detail, "confirms": confirms, "seconds": round(seconds, 1)}


# --- the probe (a child process) --------------------------------------------------------------------------------------


def _touch_device(queue: Any) -> None:
    """A forked child's first runtime call; puts the error it raised (or None) on ``queue``."""
    from ..._device import device_backend

    backend = device_backend()
    try:
        backend.set_device(backend.torch_device(0))
        queue.put(None)
    except Exception as exc:  # the rule's error, reported to the parent
        queue.put(f"{type(exc).__name__}: {exc}")


def probe(model: str, dtype: str) -> dict[str, Any]:
    """The front-end and fork-rule facts of this process (run in a fresh one: the selftest's own process has
    initialised the device)."""
    os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)  # the default start method is what is checked
    from vllm.engine.arg_utils import EngineArgs

    from ..._device import device_backend

    EngineArgs(model=model, dtype=cast(Any, dtype), max_model_len=256).create_engine_config()
    backend = device_backend()
    result: dict[str, Any] = {
        "front_end_initialized": backend.runtime_initialized(),
        "start_method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
    }
    backend.set_device(backend.torch_device(0))
    backend.mem_get_info(backend.torch_device(0))
    result["parent_initialized"] = backend.runtime_initialized()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_touch_device, args=(queue,))
    child.start()
    child.join(120)
    result["child_error"] = queue.get(timeout=5) if child.exitcode == 0 else f"child exited with {child.exitcode}"
    return result


def _probe_rows(mode: DeviceMode, model: str, dtype: str) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm-npu-selftest-probe-") as tmp:
        out = os.path.join(tmp, "probe.json")
        cmd = [sys.executable, "-m", "vllm_npu.platform.tools.cli._selftest_runtime", "probe", model, dtype, out]
        env = {**os.environ, "VLLM_NPU_DEVICE": mode.value}
        proc = subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr, timeout=600)
        seconds = time.perf_counter() - t0
        if proc.returncode != 0 or not os.path.exists(out):
            detail = f"the probe exited with status {proc.returncode} (log above)"
            return [_row(c, FAIL, detail, a, seconds) for c, a in (("front-end", "A#35, A#36"), ("fork rule", "A#36"))]
        with open(out, encoding="utf-8") as handle:
            facts = json.load(handle)
    front_ok = not facts["front_end_initialized"] and facts["start_method"] == "spawn"
    front = _row(
        "front-end",
        PASS if front_ok else FAIL,
        f"runtime initialised after create_engine_config: {facts['front_end_initialized']}; "
        f"start method: {facts['start_method']}",
        "A#35, A#36",
        seconds,
    )
    error = facts["child_error"] or ""
    fork_ok = facts["parent_initialized"] and "forked subprocess" in error.lower()
    fork = _row(
        "fork rule",
        PASS if fork_ok else FAIL,
        f"forked child's first device call: {error or 'no error (the rule did not hold)'}",
        "A#36",
        0.0,
    )
    return [front, fork]


# --- engine legs ------------------------------------------------------------------------------------------------------


def _sleep_row(leg: Leg) -> dict[str, Any]:
    t0 = time.perf_counter()
    result = leg(["--sleep-cycle", "--cudagraph-mode", "FULL_DECODE_ONLY", "--capture-sizes", LEG_CAPTURE_SIZES])
    seconds = time.perf_counter() - t0
    if result.get("error"):
        return _row("sleep with graphs", FAIL, result["error"], "A#37, A#38", seconds)
    before = result["token_ids"]
    phases = result["phases"]
    captured = [w["cudagraph_captured"] for w in result["workers"]]
    recaptured = [w["cudagraph_captured"] for w in result["workers_after"]]
    same = all(ids == before for ids in phases.values())
    again = all(after > first > 0 for first, after in zip(captured, recaptured, strict=True))
    detail = (
        f"tokens after level-1 and level-2 wake-ups {'equal' if same else 'DIFFER from'} those before; "
        f"graphs captured {captured} at start, {recaptured} after both wake-ups"
    )
    return _row("sleep with graphs", PASS if same and again else FAIL, detail, "A#37, A#38", seconds)


def _torchair_row(mode: DeviceMode, leg: Leg) -> dict[str, Any]:
    t0 = time.perf_counter()
    # Two KV-cache budgets: on an NPU through gpu_memory_utilization (profiling sizes num_blocks), on the emulated
    # device through its own budget (the same worker code path).
    budgets = (["--gpu-memory-utilization", "0.5"], ["--gpu-memory-utilization", "0.4"])
    if mode is DeviceMode.EMULATED:
        budgets = (["--emulated-kv-gb", "0.0625"], ["--emulated-kv-gb", "0.03125"])
    with tempfile.TemporaryDirectory(prefix="vllm-npu-selftest-torchair-") as root:
        common = ["--graph-mode", "torchair", "--capture-sizes", LEG_CAPTURE_SIZES, "--torchair-cache-dir", root]
        runs, dirs = [], []
        for budget in budgets:
            run = leg([*common, *budget])
            if run.get("error"):
                return _row("torchair restart", FAIL, run["error"], "part 2 §4", time.perf_counter() - t0)
            runs.append(run)
            dirs.append(sorted(p.name for p in Path(root).iterdir() if p.is_dir()))
    seconds = time.perf_counter() - t0
    shapes = [run["workers"][0]["kv_cache_shape"] for run in runs]
    if shapes[0] == shapes[1]:
        return _row("torchair restart", SKIP, f"both budgets gave the KV-cache shape {shapes[0]}", "part 2 §4", seconds)
    fresh = len(dirs[0]) == 1 and len(dirs[1]) == 2
    same = runs[0]["token_ids"] == runs[1]["token_ids"]
    detail = (
        f"KV-cache shapes {shapes[0]} then {shapes[1]}; cache directories after each run {dirs[0]}, {dirs[1]} "
        f"({'the restart compiled into a new one' if fresh else 'the restart REUSED the first graphs'}); "
        f"tokens {'equal' if same else 'DIFFER'}"
    )
    return _row("torchair restart", PASS if fresh and same else FAIL, detail, "part 2 §4", seconds)


def run_runtime(mode: DeviceMode, model: str, dtype: str, leg: Leg) -> list[dict[str, Any]]:
    """Every row of the runtime section (see the module docstring)."""
    from ._selftest_graphs import graph_rows

    rows = _probe_rows(mode, model, dtype)
    rows += graph_rows(mode)
    rows.append(_sleep_row(leg))
    rows.append(_torchair_row(mode, leg))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 4 or args[0] != "probe":
        print(
            "usage: python -m vllm_npu.platform.tools.cli._selftest_runtime probe MODEL DTYPE OUT.json", file=sys.stderr
        )
        return 2
    _, model, dtype, out = args
    facts = probe(model, dtype)
    with open(out, "w", encoding="utf-8") as handle:
        json.dump(facts, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
