# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The kernel half of ``vllm-npu selftest``: find every kernel pair, run each layer's cases, compare the two sides.

Kernel pairs are found in the layers' *source* (every ``Kernel(...)`` call, read with :mod:`ast`, nothing imported),
so a pair added without a selftest case is reported as a failing row instead of silently going untested. The cases
come from each layer's door (``vllm_npu.<layer>.selftest_cases()``, see :mod:`vllm_npu.interface.selftest`).

A case runs twice from the same seed: the kernel the backend selects, on the device, and the reference twin on the
CPU. Float outputs pass when ``|a - b| <= atol + rtol * |b|`` everywhere (``b`` the reference; NaN only where the
reference has NaN, infinities equal), integer and bool outputs when equal (or within the case's ``int_atol``).
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import importlib.util
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from vllm_npu.interface import LAYER_DISTRIBUTIONS, MissingComponentError, install_command

#: ``(atol, rtol)`` per case dtype for float outputs (a bf16 kernel's float32 side outputs, e.g. an rstd or an LSE,
#: take the bf16 tolerance). About two units in the last place of each format at magnitude 1.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-4),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
}
#: Layers that can carry kernel pairs: every layer but the interface (which defines ``Kernel``).
KERNEL_LAYERS = tuple(layer for layer in LAYER_DISTRIBUTIONS if layer != "interface")

PASS, FAIL, SKIP = "pass", "FAIL", "skip"


@dataclass
class Row:
    """One line of the report (one case, or one problem that stands for a case)."""

    layer: str
    op: str
    shape: str
    dtype: str
    status: str
    max_abs: float | None = None
    max_rel: float | None = None
    atol: float | None = None
    rtol: float | None = None
    detail: str = ""
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``; an infinite or NaN error is written as the string ``"inf"`` / ``"nan"``."""
        data = asdict(self)
        for key in ("max_abs", "max_rel"):
            if data[key] is not None and not math.isfinite(data[key]):
                data[key] = str(data[key])
        return data


class FoundKernel(NamedTuple):
    """A ``Kernel(...)`` call in a layer's source: its name (None if not a string literal) and ``file:line``."""

    name: str | None
    where: str


def layer_source_dir(layer: str) -> str | None:
    """The directory of the installed ``vllm_npu.<layer>`` package, or None when the layer is not installed."""
    try:
        spec = importlib.util.find_spec(f"vllm_npu.{layer}")
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def find_kernels_in(root: str, label: str | None = None) -> list[FoundKernel]:
    """Every ``Kernel(...)`` / ``x.Kernel(...)`` call in the ``.py`` files under ``root``."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as handle:
                tree = ast.parse(handle.read(), filename=path)
            rel = os.path.join(label or os.path.basename(root), os.path.relpath(path, root))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                callee = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if callee != "Kernel":
                    continue
                first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"), None)
                kernel_name = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
                found.append(FoundKernel(kernel_name, f"{rel}:{node.lineno}"))
    return found


def _matches(name: str, patterns: Sequence[str] | None) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def collect(
    patterns: Sequence[str] | None = None, layers: Sequence[str] = KERNEL_LAYERS
) -> tuple[list[tuple[str, Any]], list[Row], set[str]]:
    """``(cases as (layer, KernelCase), problem rows, every kernel name seen)`` for the installed layers.

    Problem rows: a layer that is not installed (skip, with the pip command), a kernel pair without a case, a
    ``Kernel(...)`` whose name is not a literal, a layer whose ``selftest_cases`` is missing or raises (FAIL).
    """
    cases: list[tuple[str, Any]] = []
    rows: list[Row] = []
    names: set[str] = set()
    for layer in layers:
        root = layer_source_dir(layer)
        if root is None:
            fix = install_command(layer)
            rows.append(Row(layer, "*", "", "", SKIP, detail=f"skipped: layer not installed ({fix})"))
            continue
        found = find_kernels_in(root, f"vllm_npu/{layer}")
        for kernel in found:
            if kernel.name is None:
                rows.append(Row(layer, "?", "", "", FAIL, detail=f"Kernel(...) at {kernel.where} has no literal name"))
        in_source = {k.name: k.where for k in found if k.name is not None}
        names.update(in_source)
        layer_cases: list[Any] = []
        try:
            get_cases = getattr(importlib.import_module(f"vllm_npu.{layer}"), "selftest_cases", None)
            layer_cases = list(get_cases()) if get_cases is not None else []
        except Exception as exc:  # one broken layer (or a missing torch) must not hide the others' results
            detail = f"selftest_cases() raised {type(exc).__name__}: {exc}"
            rows.append(Row(layer, "*", "", "", FAIL, detail=detail))
            continue
        if get_cases is None and in_source:
            dist = LAYER_DISTRIBUTIONS[layer]
            detail = f"{dist} has kernel pairs but no selftest_cases; pip install -U {dist}"
            rows.append(Row(layer, "*", "", "", FAIL, detail=detail))
        covered = {case.kernel.name for case in layer_cases}
        names.update(covered)
        for name, where in sorted(in_source.items()):
            if name not in covered and _matches(name, patterns):
                detail = f"no selftest case for the kernel pair at {where}; add one to vllm_npu.{layer}.selftest"
                rows.append(Row(layer, name, "", "", FAIL, detail=detail))
        cases += [(layer, case) for case in layer_cases if _matches(case.kernel.name, patterns)]
    return cases, rows, names


# --- running and comparing ----------------------------------------------------------------------------------------


def _side(fn: Any, case: Any, device: Any) -> dict[str, Any]:
    """Build the case on ``device``, call ``fn`` and return its outputs as CPU tensors."""
    import torch

    call = case.build(device)
    with torch.no_grad():
        result = fn(*call.args, **call.kwargs)
        outputs = call.outputs(result, call.args, call.kwargs)
        return {name: t.detach().to("cpu") for name, t in outputs.items()}


def compare(got: Any, want: Any, atol: float, rtol: float, int_atol: int = 0) -> tuple[bool, float, float, str]:
    """``(ok, max_abs, max_rel, problem)`` of one output: ``got`` (device side) against ``want`` (the reference).
    ``max_rel`` is ``max(|a - b| / max(|b|, atol))`` (integers: ``max(|b|, 1)``)."""
    import torch

    if got.shape != want.shape:
        return False, float("inf"), float("inf"), f"shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return False, float("inf"), float("inf"), f"dtype {got.dtype} != reference {want.dtype}"
    if got.numel() == 0:
        return True, 0.0, 0.0, ""
    if not (got.is_floating_point() or got.is_complex()):
        diff = (got.to(torch.int64) - want.to(torch.int64)).abs().double()
        denom = want.to(torch.int64).abs().clamp(min=1).double()
        max_abs = float(diff.max())
        return max_abs <= int_atol, max_abs, float((diff / denom).max()), ""
    a, b = got.double(), want.double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))  # equal infinities and NaN where the reference has NaN
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    bound = atol + rtol * b.abs()
    ok = bool((same | (diff <= bound)).all())
    max_abs = float(diff.max())
    max_rel = float((diff / b.abs().clamp(min=atol)).max())
    return ok, max_abs, max_rel, ""


def run_case(layer: str, case: Any, backend: str, device: Any) -> Row:
    """One row: the selected kernel on ``device`` against the reference twin on the CPU."""
    atol, rtol = case.tolerance or TOLERANCES.get(case.dtype, TOLERANCES["float32"])
    row = Row(layer, case.kernel.name, case.shape, case.dtype, FAIL, atol=atol, rtol=rtol, note=case.note)
    try:
        got = _side(case.kernel.select(backend), case, device)
    except MissingComponentError as exc:  # e.g. the Ascend custom_ops package behind the DeepSeek-V3.2 kernels
        row.status, row.detail = SKIP, f"skipped: {exc}"
        return row
    except Exception as exc:
        row.detail = f"{backend} kernel raised {type(exc).__name__}: {exc}"
        return row
    try:
        want = _side(case.kernel.reference, case, "cpu")
    except Exception as exc:
        row.detail = f"reference twin raised {type(exc).__name__}: {exc}"
        return row
    if not want:
        row.detail = "the case compares no output (its outputs() returned nothing)"
        return row
    if set(got) != set(want):
        row.detail = f"outputs {sorted(got)} != reference outputs {sorted(want)}"
        return row
    worst_abs = worst_rel = 0.0
    problems = []
    for name in want:
        ok, max_abs, max_rel, problem = compare(got[name], want[name], atol, rtol, case.int_atol)
        worst_abs, worst_rel = max(worst_abs, max_abs), max(worst_rel, max_rel)
        if not ok:
            problems.append(f"{name}: {problem}" if problem else f"{name}: max abs err {max_abs:.3g} out of tolerance")
    row.max_abs, row.max_rel = worst_abs, worst_rel
    row.status = FAIL if problems else PASS
    row.detail = "; ".join(problems)
    return row


def run(
    backend: str, device: Any, patterns: Sequence[str] | None = None, layers: Sequence[str] = KERNEL_LAYERS
) -> list[Row]:
    """Every row: collection problems first, then each case in layer order."""
    cases, rows, _ = collect(patterns, layers)
    return rows + [run_case(layer, case, backend, device) for layer, case in cases]
