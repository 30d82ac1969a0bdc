# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu doctor``: what is installed, what would run, and what is wrong, without importing torch or vLLM.

The report covers vLLM/torch/torch_npu/CANN versions (from metadata and CANN's version files), the device mode that
would activate and why, every installed component with its version, interface range and compatibility, the pip
commands for what is missing, and the effect of ``VLLM_PLUGINS``. Exit status: 0 when the set can run, 1 when it is
broken (version skew, a component that fails to load, bad environment, torch-npu without CANN...).

vllm-ascend's ``VLLM_ASCEND_*`` variables are reported the way the platform treats them (warning or error, see
:mod:`vllm_npu.interface.ascend_migration`). ``--vllm-surface`` also checks the installed vLLM against every layer's
table of vLLM internals (:mod:`vllm_npu.interface.vllm_surface`); that one imports vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as _platform
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_npu.interface.ascend_migration import find_ascend_settings
from vllm_npu.interface.cann import CANN_HOME_VARS, CANN_OPP_VAR
from vllm_npu.interface.config import EnvConfig
from vllm_npu.interface.device import decide_device, probe_npu
from vllm_npu.interface.errors import LAYER_DISTRIBUTIONS, ConfigError, install_command
from vllm_npu.interface.registry import discover
from vllm_npu.interface.version_triple import check_triple
from vllm_npu.interface.versions import INTERFACE_VERSION, SUPPORTED_VLLM, distribution_version

from .._version import __version__
from ._host import (
    AUTOLOAD_VAR,
    CannInstall,
    TorchNPUState,
    find_cann,
    plugin_entry_points,
    torch_state,
)

_VLLM_INSTALL = (
    'vLLM is not installed: on CPU/CUDA hosts (emulated device) pip install "npu-platform[vllm]"; on Ascend hosts '
    f"install vLLM {SUPPORTED_VLLM} built with VLLM_TARGET_DEVICE=empty"
)


def _torch_without_cann(torch: TorchNPUState, cann: CannInstall) -> tuple[str, str] | None:
    """(level, text) for torch-npu installed where CANN is not, or None."""
    if torch.torch_npu is None or cann.home is not None:
        return None
    where = ", ".join(cann.searched)
    if torch.import_torch_breaks(cann):
        return (
            "error",
            f"torch-npu {torch.torch_npu} is installed but CANN is not (looked in {where}): `import torch` itself "
            "fails here, because torch auto-loads torch_npu through its `torch.backends` entry point and torch_npu "
            "cannot load without CANN. Fix one of: source CANN's set_env.sh (e.g. "
            "/usr/local/Ascend/ascend-toolkit/set_env.sh); or, on a host without an NPU, pip uninstall torch-npu and "
            f"use VLLM_NPU_DEVICE=emulated; or set {AUTOLOAD_VAR}=0 to stop torch auto-loading it.",
        )
    return (
        "warning",
        f"torch-npu {torch.torch_npu} is installed but CANN is not (looked in {where}); `import torch` still works "
        f"({AUTOLOAD_VAR}={os.environ.get(AUTOLOAD_VAR, '1')!r} or no torch.backends entry point), but the NPU "
        "cannot be used: source CANN's set_env.sh, or uninstall torch-npu on hosts without an NPU.",
    )


def _vllm_plugins(environ: Mapping[str, str], device_active: bool, components: dict[str, Any]) -> dict[str, Any]:
    """What VLLM_PLUGINS does: vLLM splits it on "," (no stripping) and keeps only entry points named in it."""
    raw = environ.get("VLLM_PLUGINS")
    groups = plugin_entry_points()
    section: dict[str, Any] = {"value": raw, "filtered_out": [], "unknown_names": [], "notes": []}
    if raw is None:
        section["notes"].append("unset: vLLM loads every plugin")
        return section
    allowed = raw.split(",")
    known = {name for eps in groups.values() for name, _ in eps}
    section["filtered_out"] = [
        f"{group}:{name}" for group, eps in groups.items() for name, _ in eps if name not in allowed
    ]
    section["unknown_names"] = [name for name in allowed if name and name not in known]
    spaced = [name for name in allowed if name != name.strip()]
    if spaced:
        section["notes"].append(
            f"names with spaces never match (vLLM does not strip them): {', '.join(repr(n) for n in spaced)}"
        )
    if "vllm.platform_plugins:npu" in section["filtered_out"]:
        note = "the NPU platform plugin 'npu' is filtered out: vLLM will never activate it"
        section["notes"].append(note + (" although the device setting asks for it" if device_active else ""))
    for comp in components.values():
        if comp["installed"] and not comp["enabled"] and comp["name"] != "platform":
            section["notes"].append(
                f"the installed {comp['name']} layer is disabled (its plugin {comp['plugin']!r} is not listed)"
            )
    return section


def _vllm_surface() -> dict[str, Any]:
    """Every layer's vLLM internals checked against the installed vLLM (imports vLLM and the owners' modules)."""
    from vllm_npu.interface.vllm_surface import check_surface, installed_surface

    try:
        tables = installed_surface()
        problems = [p for table in tables.values() for p in check_surface(table)]
    except Exception as exc:  # e.g. `import torch` failing on this host: report it, the rest of the report stands
        return {"checked": 0, "layers": [], "problems": [f"the vLLM surface check failed: {type(exc).__name__}: {exc}"]}
    return {"checked": sum(len(t) for t in tables.values()), "layers": sorted(tables), "problems": problems}


def collect(*, vllm_surface: bool = False) -> dict[str, Any]:
    """The whole report as plain data (what ``--json`` prints), for this process's environment.

    ``vllm_surface=True`` adds the vLLM drift check (which imports vLLM)."""
    environ = os.environ
    errors: list[str] = []
    warnings: list[str] = []

    vllm = distribution_version("vllm")
    torch = torch_state(environ)
    cann = find_cann(environ)
    versions = {
        "python": _platform.python_version(),
        "vllm": vllm,
        "vllm_supported": SUPPORTED_VLLM,
        "torch": torch.torch,
        "torch_npu": torch.torch_npu,
        "cann": cann.version,
        "npu-interface": distribution_version("npu-interface"),
        "interface": INTERFACE_VERSION,
        "npu-platform": __version__,
    }
    if vllm is None:
        errors.append(_VLLM_INSTALL)
    triple = check_triple(vllm, torch.torch, torch.torch_npu, SUPPORTED_VLLM)  # the (vLLM, torch, torch-npu) triple
    errors += triple.errors
    warnings += triple.warnings
    if vllm is not None and torch.torch is None:
        errors.append(
            'vLLM is installed but torch is not (pip install vllm brings it; on Ascend hosts use "npu-platform[ascend]")'
        )
    finding = _torch_without_cann(torch, cann)
    if finding:
        (errors if finding[0] == "error" else warnings).append(finding[1])
    for var in (*CANN_HOME_VARS, CANN_OPP_VAR):
        if environ.get(var) and not os.path.isdir(environ[var]):
            warnings.append(f"{var}={environ[var]!r} is not a directory")

    for ascend in find_ascend_settings(None, environ):
        (errors if ascend.severity == "error" else warnings).append(ascend.message)
    surface = _vllm_surface() if vllm_surface and vllm is not None else None
    if surface is not None:
        errors.extend(surface["problems"])

    config: dict[str, Any] | None = None
    try:
        env_config = EnvConfig.from_environ(environ)
        config = {f"VLLM_NPU_{key}": value for key, value in env_config.model_dump().items()}
    except ConfigError as exc:
        errors.append(str(exc))
    device: dict[str, Any]
    probe = probe_npu(environ)
    probe_facts = {
        "torch_npu_installed": probe.torch_npu_installed,
        "cann_found": probe.cann_found,
        "device_nodes": list(probe.device_nodes),
        "ASCEND_RT_VISIBLE_DEVICES": probe.visible_devices,
    }
    try:
        decision = decide_device(environ, probe=probe)
        device = {
            "requested": decision.requested,
            "mode": decision.mode.value if decision.mode else None,
            "reason": decision.reason,
            "error": decision.error,
            "probe": probe_facts,
        }
        if decision.error:
            errors.append(decision.error)
    except ConfigError as exc:
        device = {
            "requested": environ.get("VLLM_NPU_DEVICE"),
            "mode": None,
            "reason": str(exc),
            "error": str(exc),
            "probe": probe_facts,
        }
        if str(exc) not in " ".join(errors):
            errors.append(str(exc))

    reports = discover()
    components: dict[str, Any] = {}
    for name, report in reports.items():
        comp = report.component
        problems = list(report.problems)
        if vllm is None:  # said once above instead of once per component
            problems = [p for p in problems if not (" requires vllm " in p and p.endswith("not installed"))]
        components[name] = {
            "name": name,
            "installed": comp is not None,
            "distribution": comp.distribution if comp else None,
            "version": comp.version if comp else None,
            "interface": comp.interface if comp else None,
            "vllm": comp.vllm if comp else None,
            "plugin": comp.plugin_name if comp else None,
            "enabled": report.enabled,
            "ok": not problems and report.load_error is None,
            "problems": problems,
            "load_error": report.load_error,
        }
        if report.load_error:
            errors.append(f"component {name!r} failed to load: {report.load_error}")
        elif report.enabled:
            errors.extend(p for p in problems if p not in errors)  # an untested vLLM: once, not once per layer
        elif problems:
            warnings.extend(f"(disabled by VLLM_PLUGINS) {p}" for p in problems)

    missing = [
        {"layer": layer, "distribution": dist, "command": install_command(layer)}
        for layer, dist in LAYER_DISTRIBUTIONS.items()
        if layer != "interface" and (layer not in components or not components[layer]["installed"])
    ]
    plugins = _vllm_plugins(environ, device.get("mode") is not None, components)
    if plugins["value"] is not None:
        if "vllm.platform_plugins:npu" in plugins["filtered_out"] and device.get("mode") is not None:
            errors.append(
                f"VLLM_NPU_DEVICE selects the {device['mode']} device but VLLM_PLUGINS={plugins['value']!r} leaves out "
                "the platform plugin 'npu', so vLLM falls back to another platform: add npu to VLLM_PLUGINS"
            )
        warnings.extend(
            f"VLLM_PLUGINS names {name!r}, which no installed plugin has" for name in plugins["unknown_names"]
        )
        warnings.extend(n for n in plugins["notes"] if n.startswith("names with spaces"))

    return {
        "ok": not errors,
        "errors": errors,
        "warnings": warnings,
        "versions": versions,
        "cann": {
            "home": cann.home,
            "home_source": cann.home_source,
            "version": cann.version,
            "version_file": cann.version_file,
            "searched": list(cann.searched),
        },
        "torch": {
            "autoload_backends": torch.autoload,
            "backends": list(torch.backends),
            "import_torch_breaks": torch.import_torch_breaks(cann),
        },
        "device": device,
        "config": config,
        "components": components,
        "missing": missing,
        "full_install": 'pip install "npu-platform[all]"' if missing else None,
        "vllm_plugins": plugins,
        "vllm_surface": surface,
    }


def _or(value: Any, default: str = "not installed") -> str:
    return default if value is None else str(value)


def render(report: dict[str, Any]) -> str:
    """The human-readable report."""
    v, cann, dev = report["versions"], report["cann"], report["device"]
    out = [f"vllm-npu doctor (npu-platform {v['npu-platform']})", "", "Versions"]
    out.append(f"  python         {v['python']}")
    out.append(f"  vllm           {_or(v['vllm'])}   (supported: {v['vllm_supported']})")
    out.append(f"  torch          {_or(v['torch'])}")
    out.append(f"  torch_npu      {_or(v['torch_npu'])}")
    if cann["home"] is None:
        out.append(f"  CANN           not found (looked in: {', '.join(cann['searched'])})")
    else:
        found = cann["version"] or "version unknown (no version file)"
        out.append(f"  CANN           {found} at {cann['home']} ({cann['home_source']})")
    out.append(f"  npu-interface  {_or(v['npu-interface'])} (interface {v['interface']})")
    if report["torch"]["backends"]:
        state = (
            "auto-loaded by `import torch`"
            if report["torch"]["autoload_backends"]
            else f"not auto-loaded ({AUTOLOAD_VAR})"
        )
        out.append(f"  torch backends {', '.join(report['torch']['backends'])}: {state}")

    out += ["", "Device"]
    mode = dev["mode"] or "not activated"
    out.append(f"  VLLM_NPU_DEVICE={dev['requested'] or 'auto'} -> {mode}")
    out.append(f"  why: {dev['reason']}")
    probe = dev["probe"]
    nodes = ", ".join(probe["device_nodes"]) or "none"
    out.append(
        f"  probe: torch_npu {'found' if probe['torch_npu_installed'] else 'absent'}, "
        f"CANN {'found' if probe['cann_found'] else 'absent'}, device nodes: {nodes}"
    )

    plugins = report["vllm_plugins"]
    filt = (
        "VLLM_PLUGINS unset: every plugin loads" if plugins["value"] is None else f"VLLM_PLUGINS={plugins['value']!r}"
    )
    out += ["", f"Components ({filt})"]
    for comp in report["components"].values():
        if not comp["installed"]:
            out.append(f"  FAIL {comp['name']:<10} failed to load: {comp['load_error']}")
            continue
        status = "OK  " if comp["ok"] else "FAIL"
        if not comp["enabled"]:
            status = "OFF " if comp["ok"] else "off!"
        out.append(
            f"  {status} {comp['name']:<10} {comp['distribution'] + ' ' + comp['version']:<22} interface {comp['interface']:<10}"
            f" vllm {comp['vllm']:<14} plugin {comp['plugin']}{'' if comp['enabled'] else ' (filtered out)'}"
        )
        out.extend(f"         - {p}" for p in comp["problems"])

    if report["missing"]:
        out += ["", "Missing for a full install"]
        out.extend(f"  {m['layer']:<10} {m['command']}" for m in report["missing"])
        out.append(f"  all layers {report['full_install']}")
    else:
        out += ["", "Every layer is installed."]

    if plugins["value"] is not None:
        out += ["", "VLLM_PLUGINS"]
        out.append(f"  filtered out: {', '.join(plugins['filtered_out']) or 'nothing'}")
        if plugins["unknown_names"]:
            out.append(f"  names matching no plugin: {', '.join(repr(n) for n in plugins['unknown_names'])}")
        out.extend(f"  note: {n}" for n in plugins["notes"])

    surface = report.get("vllm_surface")
    if surface is not None:
        state = f"{len(surface['problems'])} drifted" if surface["problems"] else "all present, signatures match"
        out += ["", "vLLM surface", f"  {surface['checked']} vLLM names of {', '.join(surface['layers'])}: {state}"]

    for title, items in (("Warnings", report["warnings"]), ("Errors", report["errors"])):
        if items:
            out += ["", title]
            out.extend(f"  - {item}" for item in items)
    out += ["", "Result: OK" if report["ok"] else f"Result: BROKEN ({len(report['errors'])} error(s))"]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-npu doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--vllm-surface",
        action="store_true",
        help="also check that the installed vLLM still has every internal our layers override or call (imports vLLM)",
    )
    args = parser.parse_args(argv)
    report = collect(vllm_surface=args.vllm_surface)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
