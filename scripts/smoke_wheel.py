#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Smoke-test an installation of vllm-npu-plugin wheels, from inside the environment under test.

Run it with the environment's interpreter (``<venv>/bin/python -I scripts/smoke_wheel.py [--expect DIST ...]``).
Standard library only, so it runs in a fresh venv holding nothing but our wheels. It:

- imports every installed ``vllm_npu.<layer>`` package and records the absent ones (``importlib.util.find_spec``);
- lists the entry points vLLM would see in ``vllm.platform_plugins`` / ``vllm.general_plugins`` and ours in
  ``vllm_npu.components``, read with ``importlib.metadata.entry_points(group=...)`` exactly as vLLM's loader does;
- loads every entry point of ours and calls the plugin functions the way vLLM does (the platform hook twice), which
  must work without vLLM installed and without activating anything on a host without an NPU;
- checks that none of this imported torch, torch_npu or vLLM.

Prints a JSON report; exits 1 if an expected distribution is missing, an entry point fails, or a heavy module was
imported.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import sys

LAYERS = ("interface", "platform", "ops", "attention", "quant", "models", "patches", "kv")
GROUPS = ("vllm.platform_plugins", "vllm.general_plugins", "vllm_npu.components")
HEAVY = ("torch", "torch_npu", "vllm", "transformers")


def inspect() -> dict:
    report: dict = {"present": [], "absent": [], "versions": {}, "entry_points": {}, "errors": []}
    for layer in LAYERS:
        module = f"vllm_npu.{layer}"
        if importlib.util.find_spec(module) is None:
            report["absent"].append(module)
            continue
        try:
            imported = importlib.import_module(module)
            report["present"].append(module)
            report["versions"][module] = getattr(imported, "__version__", None)
        except Exception as exc:  # noqa: BLE001 - report every failure, not just the first
            report["errors"].append(f"import {module}: {type(exc).__name__}: {exc}")
    for group in GROUPS:
        eps = importlib.metadata.entry_points(group=group)
        report["entry_points"][group] = sorted(ep.name for ep in eps)
        for ep in eps:
            if not ep.value.startswith("vllm_npu."):
                continue
            try:
                obj = ep.load()
                if group == "vllm.platform_plugins":
                    first, second = obj(), obj()
                    if first != second:
                        report["errors"].append(f"{group}:{ep.name} is not pure: {first!r} then {second!r}")
                    report.setdefault("platform", {})[ep.name] = first
                elif group == "vllm.general_plugins":
                    obj()
            except Exception as exc:  # noqa: BLE001
                report["errors"].append(f"{group}:{ep.name} ({ep.value}): {type(exc).__name__}: {exc}")
    report["heavy_imported"] = sorted(m for m in HEAVY if m in sys.modules)
    if report["heavy_imported"]:
        report["errors"].append(f"imported heavy modules: {report['heavy_imported']}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--expect",
        action="append",
        default=[],
        metavar="DIST",
        help="a distribution that must be installed (repeatable)",
    )
    args = parser.parse_args(argv)
    report = inspect()
    for dist in args.expect:
        try:
            report["versions"][dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            report["errors"].append(f"{dist} is not installed")
    print(json.dumps(report, indent=2, sort_keys=True))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
