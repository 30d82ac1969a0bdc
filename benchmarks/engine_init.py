# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Engine start-up time on the emulated device, split by phase.

Measures, for the tiny Qwen2 of the e2e tests (float32, in-process engine core):

- ``import_vllm_s``: ``from vllm import LLM`` in a fresh interpreter (a subprocess, so nothing is cached in memory);
- ``llm_init_s``: ``LLM(...)`` in this process, and inside it the worker phases (wrapped with timers): device and
  distributed init, model loading, profile run + KV budget, KV-cache allocation, warm-up. ``other_s`` is the rest
  (config, tokenizer, processor, scheduler, engine-core set-up).

Run: ``.venv/bin/python benchmarks/engine_init.py [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")

PHASES = {
    "init_device": "device + distributed init, model runner",
    "load_model": "model loading",
    "determine_available_memory": "profile run + KV budget",
    "initialize_from_config": "KV-cache allocation",
    "compile_or_warm_up_model": "warm-up",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()

    from npu_testkit.engine import emulated_env, make_llm, patched_environ, shutdown_llm, tiny_config
    from npu_testkit.models import build_tiny_model

    model = build_tiny_model(tiny_config("qwen2"))
    env = emulated_env(tempfile.mkdtemp(prefix="bench-init-"))

    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "from vllm import LLM"], env={**os.environ, **env}, check=True, capture_output=True
    )
    import_s = time.perf_counter() - t

    t = time.perf_counter()
    from vllm_npu.platform.worker import NPUWorker  # imports vLLM (the in-process part of llm_init is then warm)

    pre_import_s = time.perf_counter() - t
    phases: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(self: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    for name in PHASES:
        setattr(NPUWorker, name, timed(name, getattr(NPUWorker, name)))

    with patched_environ(env):
        t = time.perf_counter()
        llm = make_llm(model)
        init_s = time.perf_counter() - t
        shutdown_llm(llm)

    result = {
        "import_vllm_s": import_s,
        "import_worker_modules_in_process_s": pre_import_s,
        "llm_init_s": init_s,
        "phases_s": phases,
        "other_s": init_s - sum(phases.values()),
    }
    print(f"import vllm (fresh process): {import_s:.2f} s")
    print(f"import worker/runner modules (this process): {pre_import_s:.2f} s")
    print(f"LLM() init: {init_s:.2f} s")
    for name, label in PHASES.items():
        print(f"  {label:42s} {phases.get(name, 0.0):6.2f} s")
    print(f"  {'other (config, tokenizer, engine core)':42s} {result['other_s']:6.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
