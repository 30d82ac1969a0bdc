# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu selftest``: run every NPU kernel against its reference twin on this host, then a short generate.

For the first run on an Ascend host (after ``vllm-npu doctor``). Two parts:

1. **Kernels.** Every kernel pair of the installed layers (found in their source, see :mod:`._kernel_check`) runs
   over the layer's grid of shapes and dtypes (its ``selftest_cases()``): the NPU kernel on the device against the
   reference twin on the CPU, from identical inputs. One row per case: op, shape, dtype, max abs and relative error,
   pass. Float tolerances are per dtype (:data:`._kernel_check.TOLERANCES`, printed with the table); integer outputs
   must match exactly unless a case allows one quantization step.
2. **Runtime.** The layer around the kernels, row by row (:mod:`._selftest_runtime`): the front-end leaves the
   device runtime alone and workers start with spawn, torch_npu's fork rule, a GQA and an MLA decode kernel
   captured as graph tasks and replayed after an update (against eager), sleep / wake-up with captured graphs, and a
   torchair restart with another KV-cache size that must compile afresh. ``--no-runtime`` skips it.
3. **End to end.** ``vllm.LLM`` on the built-in demo model (built locally, no download) generates greedily, once
   with the device's kernels and once with ``npu.kernels='reference'``, each in its own process; the tokens must be
   identical. On a host without an NPU (the emulated device) the kernel rows compare the twins with themselves (the
   command and every case's inputs are exercised; no NPU kernel is) and the generate is compared with HF
   transformers' greedy decoding of the same checkpoint instead.

Exit status: 0 when every row passes (skipped rows do not fail), 1 when a row (kernel or runtime) or the end-to-end
check fails, 2 when
the selftest cannot run here (``VLLM_NPU_DEVICE=npu`` without an NPU, ``VLLM_NPU_DEVICE=off``, a bad setting, an
``--op`` that names no kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from vllm_npu.interface import ConfigError, DeviceMode, decide_device, reset_device_selection

from . import _kernel_check as kc

EXIT_FAILED = 1
EXIT_CANNOT_RUN = 2
#: Prompts of the end-to-end generate: passages the demo model was trained on, so its continuations are confident.
E2E_PROMPTS = ("Four score and seven years ago", "Call me Ishmael.", "It was the best of times,")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-npu selftest", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON document (for bug reports)")
    p.add_argument("--no-e2e", action="store_true", help="no end-to-end generate")
    p.add_argument("--no-runtime", action="store_true", help="no runtime section (graphs, sleep, torchair, fork rule)")
    p.add_argument(
        "--op",
        action="append",
        dest="ops",
        metavar="NAME",
        help="only kernels with this name (fnmatch pattern, repeatable, e.g. 'ring_mla' or 'npu_grouped_matmul*'); "
        "implies --no-e2e and --no-runtime",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per prompt in the end-to-end generate")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="dtype of the end-to-end generate (auto: bfloat16 on an NPU, float32 emulated)",
    )
    return p


def resolve_device() -> tuple[DeviceMode | None, str, str | None]:
    """``(mode, reason, refusal)``: the device the selftest runs on, why, and the error text when it cannot run."""
    try:
        decision = decide_device()
    except ConfigError as exc:
        return None, str(exc), str(exc)
    if decision.error is not None:  # VLLM_NPU_DEVICE=npu on a host that cannot run it
        return None, decision.reason, decision.error
    if decision.mode is not None:
        return decision.mode, decision.reason, None
    if decision.requested == "off":
        return (
            None,
            decision.reason,
            (
                "VLLM_NPU_DEVICE=off turns the plugin off, so there is nothing to test; unset it (auto) on an Ascend host, "
                "or set VLLM_NPU_DEVICE=emulated to check the reference kernels on the CPU"
            ),
        )
    # auto on a host without an NPU: the emulated device, said loudly in the report
    return DeviceMode.EMULATED, f"{decision.reason} (no NPU here: the emulated device is tested)", None


def npu_device() -> Any:
    """The NPU this process uses (imports torch_npu)."""
    import torch
    import torch_npu  # noqa: F401  (registers the npu device)

    return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]  # torch_npu's, at runtime


def release_npu() -> None:
    """Hand the cases' NPU memory back before the generate's processes start."""
    import torch

    torch.npu.empty_cache()  # type: ignore[attr-defined]  # registered at runtime by torch_npu


def _versions() -> dict[str, Any]:
    from .doctor import collect

    report = collect()
    components = {name: c["version"] for name, c in report["components"].items() if c["installed"]}
    return {**report["versions"], "components": components}


# --- end to end -----------------------------------------------------------------------------------------------------


def _leg(
    model: str, mode: DeviceMode, kernels: str, dtype: str, max_tokens: int, extra: Sequence[str] = ()
) -> dict[str, Any]:
    """One generate in a fresh process (the kernel backend is fixed per process); ``extra``: more arguments of
    :mod:`._selftest_e2e` (graph modes, sleep cycle...)."""
    with tempfile.TemporaryDirectory(prefix="vllm-npu-selftest-") as tmp:
        out = os.path.join(tmp, "leg.json")
        cmd = [sys.executable, "-m", "vllm_npu.platform.tools.cli._selftest_e2e", model, out, "--kernels", kernels]
        cmd += ["--dtype", dtype, "--max-tokens", str(max_tokens)]
        for prompt in E2E_PROMPTS:
            cmd += ["--prompt", prompt]
        cmd += extra
        if mode is DeviceMode.NPU and "--gpu-memory-utilization" not in extra:
            # The tiny model needs little; leave room for this process's NPU context, which vLLM's start-up check
            # would otherwise count against the default 0.9 of the device.
            cmd += ["--gpu-memory-utilization", "0.5"]
        env = {**os.environ, "VLLM_NPU_DEVICE": mode.value}
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        t0 = time.perf_counter()
        # The child's own output (vLLM logs) goes to stderr, keeping stdout for the report.
        proc = subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr, timeout=1800)
        if proc.returncode != 0 or not os.path.exists(out):
            return {"kernels": kernels, "error": f"the generate exited with status {proc.returncode} (log above)"}
        with open(out, encoding="utf-8") as handle:
            leg = json.load(handle)
    keys = ("device_mode", "kernel_backend", "attention_backends", "cudagraph_captured", "kv_cache_shape")
    result = {
        "kernels": kernels,
        "token_ids": leg["token_ids"],
        "texts": leg["texts"],
        "workers": [{k: w.get(k) for k in keys} for w in leg["workers"]],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if "phases" in leg:
        result["phases"] = leg["phases"]
        result["workers_after"] = [{k: w.get(k) for k in keys} for w in leg["workers_after"]]
    return result


def _hf_leg(model: str, max_tokens: int) -> dict[str, Any]:
    """HF transformers' greedy decoding of the same checkpoint on the CPU (float32), one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = []
    with torch.no_grad():
        for prompt in E2E_PROMPTS:
            inp = torch.tensor([tok(prompt)["input_ids"]])
            gen = hf.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=hf.config.pad_token_id,
            )
            ids.append(gen[0, inp.shape[1] :].tolist())
    return {"kernels": "hf-transformers (cpu, float32)", "token_ids": ids, "texts": [tok.decode(i) for i in ids]}


def _mismatches(got: list[list[int]], want: list[list[int]]) -> list[dict[str, Any]]:
    out = []
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append(
                {"prompt": E2E_PROMPTS[i], "first_diff": pos, "device": a[pos : pos + 4], "baseline": b[pos : pos + 4]}
            )
    return out


def run_e2e(mode: DeviceMode, dtype: str, max_tokens: int) -> dict[str, Any]:
    """The end-to-end check: the device's kernels against the baseline (see the module doc)."""
    from ..demo.checkpoint import ensure_demo_model

    if dtype == "auto":
        dtype = "bfloat16" if mode is DeviceMode.NPU else "float32"
    result: dict[str, Any] = {"model": None, "dtype": dtype, "max_tokens": max_tokens, "ok": False, "error": None}
    try:
        model_dir, _ = ensure_demo_model()
        model = str(model_dir)
        result["model"] = model
        result["device"] = device = _leg(model, mode, "auto", dtype, max_tokens)
        if device.get("error"):
            result["error"] = f"device run: {device['error']}"
            return result
        if mode is DeviceMode.NPU:
            baseline = _leg(model, mode, "reference", dtype, max_tokens)
        else:
            baseline = _hf_leg(model, max_tokens)
        result["baseline"] = baseline
        if baseline.get("error"):
            result["error"] = f"baseline run: {baseline['error']}"
            return result
    except Exception as exc:  # reported as a failed check, with the cause
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    result["mismatches"] = _mismatches(device["token_ids"], baseline["token_ids"])
    result["ok"] = not result["mismatches"]
    return result


def run_runtime_section(mode: DeviceMode, dtype: str, max_tokens: int) -> list[dict[str, Any]]:
    """The runtime rows (:mod:`._selftest_runtime`) on the demo model."""
    from ..demo.checkpoint import ensure_demo_model
    from ._selftest_runtime import FAIL, run_runtime

    if dtype == "auto":
        dtype = "bfloat16" if mode is DeviceMode.NPU else "float32"
    try:
        model_dir, _ = ensure_demo_model()
        model = str(model_dir)
        return run_runtime(mode, model, dtype, lambda extra: _leg(model, mode, "auto", dtype, max_tokens, extra))
    except Exception as exc:  # reported as a failed row, with the cause
        return [
            {"check": "runtime", "status": FAIL, "detail": f"{type(exc).__name__}: {exc}", "confirms": "", "seconds": 0}
        ]


# --- report -----------------------------------------------------------------------------------------------------------


def _fmt(x: float | str | None) -> str:
    return "-" if x is None else x if isinstance(x, str) else f"{x:.2e}"


def render(report: dict[str, Any]) -> str:
    dev = report["device"]
    out = [f"vllm-npu selftest (npu-platform {report['versions'].get('npu-platform')})", ""]
    out.append(f"device: {dev['mode']} ({dev['reason']})")
    if dev["mode"] == DeviceMode.EMULATED.value:
        out.append("  emulated: each kernel row compares the reference twin with itself; no NPU kernel runs here")
    tol = ", ".join(f"{d} atol={a:g} rtol={r:g}" for d, (a, r) in report["tolerances"].items())
    out += [f"tolerances: |a - b| <= atol + rtol*|b| with {tol}; integers exact unless noted", ""]
    rows = report["rows"]
    header = ("layer", "op", "shape", "dtype", "max abs err", "max rel err", "result", "confirms")
    table = [header] + [
        (r["layer"], r["op"], r["shape"], r["dtype"], _fmt(r["max_abs"]), _fmt(r["max_rel"]), r["status"], r["note"])
        for r in rows
    ]
    widths = [min(max(len(str(line[i])) for line in table), 72) for i in range(len(header))]
    for line in table:
        out.append("  ".join(str(cell)[:72].ljust(w) for cell, w in zip(line, widths)).rstrip())
    problems = [r for r in rows if r["detail"]]
    if problems:
        out += ["", "details"]
        out += [f"  {r['status']} {r['layer']}/{r['op']} {r['shape']} {r['dtype']}: {r['detail']}" for r in problems]
    runtime = report.get("runtime")
    if runtime is not None:
        out += ["", "runtime"]
        table = [("check", "result", "seconds", "confirms", "detail")] + [
            (r["check"], r["status"], str(r["seconds"]), r["confirms"], r["detail"]) for r in runtime
        ]
        widths = [max(len(line[i]) for line in table) for i in range(4)]
        for line in table:
            out.append(("  " + "  ".join(c.ljust(w) for c, w in zip(line[:4], widths)) + "  " + line[4]).rstrip())
    e2e = report["e2e"]
    if e2e is not None:
        out += [
            "",
            f"end to end ({e2e['model']}, {e2e['dtype']}, {e2e['max_tokens']} tokens x {len(E2E_PROMPTS)} prompts)",
        ]
        if e2e.get("device"):
            base = e2e.get("baseline", {})
            out.append(f"  device run: kernels={e2e['device']['kernels']}  baseline: {base.get('kernels')}")
            for text, prompt in zip(e2e["device"].get("texts", []), E2E_PROMPTS):
                out.append(f"  {prompt!r} -> {text!r}")
        if e2e["error"]:
            out.append(f"  FAIL: {e2e['error']}")
        elif e2e["mismatches"]:
            out += [
                f"  FAIL: {m['prompt']!r} differs from token {m['first_diff']}: {m['device']} vs {m['baseline']}"
                for m in e2e["mismatches"]
            ]
        else:
            out.append("  pass: identical tokens")
    s = report["summary"]
    runtime_text = ""
    if runtime is not None:
        runtime_text = "; runtime " + ", ".join(
            f"{sum(r['status'] == st for r in runtime)} {word}" for st, word in (("pass", "passed"), ("FAIL", "failed"))
        )
    out += [
        "",
        f"{s['pass']} passed, {s['fail']} failed, {s['skip']} skipped"
        + runtime_text
        + ("" if e2e is None else f"; end to end {'pass' if e2e['ok'] else 'FAIL'}"),
    ]
    out.append("Result: PASS" if report["ok"] else "Result: FAIL")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    mode, reason, refusal = resolve_device()
    if refusal is not None:
        print(f"vllm-npu selftest: {refusal}", file=sys.stderr)
        if args.json:  # the bug report still gets a document: what was asked, why it cannot run, the versions
            print(
                json.dumps(
                    {
                        "ok": False,
                        "error": refusal,
                        "device": {"mode": None, "reason": reason},
                        "versions": _versions(),
                    },
                    indent=2,
                )
            )
        return EXIT_CANNOT_RUN
    assert mode is not None
    # Layers and child processes read the decision from the environment: fix it to what is tested.
    os.environ["VLLM_NPU_DEVICE"] = mode.value
    reset_device_selection()

    # vLLM's logs (and those of the generate's child processes, which inherit fd 1) go to stdout: point fd 1 at
    # stderr until the report is written, so stdout holds the report alone (one JSON document with --json).
    sys.stdout.flush()
    report_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    if args.ops:
        _, _, names = kc.collect()
        unknown = [p for p in args.ops if not any(kc._matches(n, [p]) for n in names)]
        if unknown:
            print(
                f"vllm-npu selftest: --op {', '.join(unknown)} names no kernel; known: {', '.join(sorted(names))}",
                file=sys.stderr,
            )
            return EXIT_CANNOT_RUN
    backend, device = ("npu", npu_device()) if mode is DeviceMode.NPU else ("reference", "cpu")
    rows = [r.as_dict() for r in kc.run(backend, device, args.ops)]
    if mode is DeviceMode.NPU:
        release_npu()
    runtime = None if (args.no_runtime or args.ops) else run_runtime_section(mode, args.dtype, args.max_tokens)
    e2e = None if (args.no_e2e or args.ops) else run_e2e(mode, args.dtype, args.max_tokens)
    summary = {
        key: sum(r["status"] == status for r in rows)
        for key, status in (("pass", kc.PASS), ("fail", kc.FAIL), ("skip", kc.SKIP))
    }
    report = {
        "ok": summary["fail"] == 0
        and (runtime is None or all(r["status"] != "FAIL" for r in runtime))
        and (e2e is None or e2e["ok"]),
        "versions": _versions(),
        "device": {"mode": mode.value, "reason": reason, "kernel_backend": backend, "torch_device": str(device)},
        "tolerances": kc.TOLERANCES,
        "summary": summary,
        "rows": rows,
        "runtime": runtime,
        "e2e": e2e,
    }
    text = json.dumps(report, indent=2) if args.json else render(report)
    sys.stdout.flush()
    report_out.write(text + "\n")
    report_out.flush()
    return 0 if report["ok"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
