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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_npu.interface import (
    CANN_HOME_VARS,
    CANN_OPP_VAR,
    INTERFACE_VERSION,
    LAYER_DISTRIBUTIONS,
    SUPPORTED_VLLM,
    ConfigError,
    DeviceMode,
    EnvConfig,
    check_triple,
    decide_device,
    discover,
    distribution_version,
    find_ascend_settings,
    install_command,
    probe_npu,
    read_emulated_soc,
)

from ..._cann import CannInstall, find_cann
from ..._version import __version__
from ._host import AUTOLOAD_VAR, TorchNPUState, plugin_entry_points, torch_state

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
    from vllm_npu.interface import check_surface, installed_surface

    try:
        tables = installed_surface()
        problems = [p for table in tables.values() for p in check_surface(table)]
    except Exception as exc:  # e.g. `import torch` failing on this host: report it, the rest of the report stands
        return {"checked": 0, "layers": [], "problems": [f"the vLLM surface check failed: {type(exc).__name__}: {exc}"]}
    return {"checked": sum(len(t) for t in tables.values()), "layers": sorted(tables), "problems": problems}


@dataclass
class _Doctor:
    """One doctor run: the environment read, the findings so far (in report order), and the sections collected so
    far (a later section may read an earlier one's, e.g. the VLLM_PLUGINS section reads the device and the
    components)."""

    environ: Mapping[str, str]
    vllm_surface: bool
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)

    def finding(self, level: str, text: str) -> None:
        (self.errors if level == "error" else self.warnings).append(text)


def _host_section(run: _Doctor) -> dict[str, Any]:
    """Versions of Python, vLLM, torch, torch_npu, CANN and our own wheels, and what is wrong between them."""
    environ = run.environ
    vllm = distribution_version("vllm")
    torch = torch_state(environ)
    cann = find_cann(environ)
    if vllm is None:
        run.finding("error", _VLLM_INSTALL)
    triple = check_triple(vllm, torch.torch, torch.torch_npu, SUPPORTED_VLLM)  # the (vLLM, torch, torch-npu) triple
    run.errors += triple.errors
    run.warnings += triple.warnings
    if vllm is not None and torch.torch is None:
        run.finding(
            "error",
            'vLLM is installed but torch is not (pip install vllm brings it; on Ascend hosts use "npu-platform[ascend]")',
        )
    finding = _torch_without_cann(torch, cann)
    if finding:
        run.finding(*finding)
    for var in (*CANN_HOME_VARS, CANN_OPP_VAR):
        if environ.get(var) and not os.path.isdir(environ[var]):
            run.finding("warning", f"{var}={environ[var]!r} is not a directory")
    return {
        "versions": {
            "python": _platform.python_version(),
            "vllm": vllm,
            "vllm_supported": SUPPORTED_VLLM,
            "torch": torch.torch,
            "torch_npu": torch.torch_npu,
            "cann": cann.version,
            "npu-interface": distribution_version("npu-interface"),
            "interface": INTERFACE_VERSION,
            "npu-platform": __version__,
        },
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
    }


def _ascend_section(run: _Doctor) -> dict[str, Any]:
    """vllm-ascend's ``VLLM_ASCEND_*`` variables, as the platform treats them (findings only)."""
    for ascend in find_ascend_settings(None, run.environ):
        run.finding(ascend.severity, ascend.message)
    return {}


def _surface_section(run: _Doctor) -> dict[str, Any]:
    """``--vllm-surface``: every layer's vLLM internals against the installed vLLM (None when not asked or no vLLM)."""
    surface = _vllm_surface() if run.vllm_surface and run.report["versions"]["vllm"] is not None else None
    if surface is not None:
        run.errors.extend(surface["problems"])
    return {"vllm_surface": surface}


def _config_section(run: _Doctor) -> dict[str, Any]:
    """Every ``VLLM_NPU_*`` variable, validated (None when one is invalid: the error says which)."""
    try:
        env_config = EnvConfig.from_environ(run.environ)
    except ConfigError as exc:
        run.finding("error", str(exc))
        return {"config": None}
    return {"config": {f"VLLM_NPU_{key}": value for key, value in env_config.model_dump().items()}}


def _device_section(run: _Doctor) -> dict[str, Any]:
    """The device mode that would activate, why, and what the probe saw."""
    environ = run.environ
    probe = probe_npu(environ)
    probe_facts = {
        "torch_npu_installed": probe.torch_npu_installed,
        "cann_found": probe.cann_found,
        "device_nodes": list(probe.device_nodes),
        "ASCEND_RT_VISIBLE_DEVICES": probe.visible_devices,
    }
    try:
        decision = decide_device(environ, probe=probe)
    except ConfigError as exc:
        if str(exc) not in " ".join(run.errors):
            run.finding("error", str(exc))
        device = {"requested": environ.get("VLLM_NPU_DEVICE"), "mode": None, "reason": str(exc), "error": str(exc)}
        return {"device": {**device, "probe": probe_facts}}
    if decision.error:
        run.finding("error", decision.error)
    device = {
        "requested": decision.requested,
        "mode": decision.mode.value if decision.mode else None,
        "reason": decision.reason,
        "error": decision.error,
        "chip": _chip(run, decision.mode),
    }
    return {"device": {**device, "probe": probe_facts}}


def _chip(run: _Doctor, mode: DeviceMode | None) -> str:
    """The chip family the stack will take the paths of. The emulated device's is ``VLLM_NPU_EMULATED_SOC``; an
    NPU's is asked at run time (``torch.npu.get_device_name()``, in ``vllm-npu selftest`` and the worker's
    ``npu_runtime_info``): the doctor never imports torch_npu."""
    try:
        soc = read_emulated_soc(run.environ)
    except ConfigError as exc:
        if str(exc) not in " ".join(run.errors):
            run.finding("error", str(exc))
        return "unknown"
    if mode is DeviceMode.EMULATED:
        return "emulated Ascend 310P (VLLM_NPU_EMULATED_SOC=310P)" if soc == "310P" else "none emulated"
    if soc != "none":
        run.finding("warning", f"VLLM_NPU_EMULATED_SOC={soc} is ignored: the device is not the emulated one")
    return "asked at run time (torch.npu.get_device_name)" if mode is DeviceMode.NPU else "none"


def _component_entry(run: _Doctor, name: str, report: Any) -> dict[str, Any]:
    """One discovered component as reported, its problems added to the findings."""
    comp = report.component
    problems = list(report.problems)
    if run.report["versions"]["vllm"] is None:  # said once by the host section instead of once per component
        problems = [p for p in problems if not (" requires vllm " in p and p.endswith("not installed"))]
    if report.load_error:
        run.finding("error", f"component {name!r} failed to load: {report.load_error}")
    elif report.enabled:
        run.errors.extend(p for p in problems if p not in run.errors)  # an untested vLLM: once, not per layer
    elif problems:
        run.warnings.extend(f"(disabled by VLLM_PLUGINS) {p}" for p in problems)
    return {
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


def _components_section(run: _Doctor) -> dict[str, Any]:
    """Every installed component (version, ranges, compatibility) and the install command of each missing layer."""
    components = {name: _component_entry(run, name, report) for name, report in discover().items()}
    missing = [
        {"layer": layer, "distribution": dist, "command": install_command(layer)}
        for layer, dist in LAYER_DISTRIBUTIONS.items()
        if layer != "interface" and (layer not in components or not components[layer]["installed"])
    ]
    full_install = 'pip install "npu-platform[all]"' if missing else None
    return {"components": components, "missing": missing, "full_install": full_install}


def _plugins_section(run: _Doctor) -> dict[str, Any]:
    """What ``VLLM_PLUGINS`` does to our plugins (reads the device and components sections)."""
    mode = run.report["device"].get("mode")
    plugins = _vllm_plugins(run.environ, mode is not None, run.report["components"])
    if plugins["value"] is not None:
        if "vllm.platform_plugins:npu" in plugins["filtered_out"] and mode is not None:
            run.finding(
                "error",
                f"VLLM_NPU_DEVICE selects the {mode} device but VLLM_PLUGINS={plugins['value']!r} leaves out the "
                "platform plugin 'npu', so vLLM falls back to another platform: add npu to VLLM_PLUGINS",
            )
        run.warnings.extend(
            f"VLLM_PLUGINS names {name!r}, which no installed plugin has" for name in plugins["unknown_names"]
        )
        run.warnings.extend(n for n in plugins["notes"] if n.startswith("names with spaces"))
    return {"vllm_plugins": plugins}


#: The report's sections in order: each reads the environment (and the sections before it), adds its findings and
#: returns its keys of the report. A new check is one more function here.
SECTIONS: tuple[Callable[[_Doctor], dict[str, Any]], ...] = (
    _host_section,
    _ascend_section,
    _surface_section,
    _config_section,
    _device_section,
    _components_section,
    _plugins_section,
)


def collect(*, vllm_surface: bool = False) -> dict[str, Any]:
    """The whole report as plain data (what ``--json`` prints), for this process's environment: ``ok``, the
    ``errors`` and ``warnings`` in section order, then each section's keys (:data:`SECTIONS`).

    ``vllm_surface=True`` adds the vLLM drift check (which imports vLLM)."""
    run = _Doctor(os.environ, vllm_surface)
    for section in SECTIONS:
        run.report.update(section(run))
    return {"ok": not run.errors, "errors": run.errors, "warnings": run.warnings, **run.report}


def _or(value: Any, default: str = "not installed") -> str:
    return default if value is None else str(value)


def _render_versions(report: dict[str, Any]) -> list[str]:
    v, cann = report["versions"], report["cann"]
    out = ["", "Versions"]
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
    return out


def _render_device(report: dict[str, Any]) -> list[str]:
    dev = report["device"]
    probe = dev["probe"]
    nodes = ", ".join(probe["device_nodes"]) or "none"
    return [
        "",
        "Device",
        f"  VLLM_NPU_DEVICE={dev['requested'] or 'auto'} -> {dev['mode'] or 'not activated'}",
        f"  why: {dev['reason']}",
        f"  chip: {dev.get('chip', 'unknown')}",
        f"  probe: torch_npu {'found' if probe['torch_npu_installed'] else 'absent'}, "
        f"CANN {'found' if probe['cann_found'] else 'absent'}, device nodes: {nodes}",
    ]


def _render_component(comp: dict[str, Any]) -> list[str]:
    if not comp["installed"]:
        return [f"  FAIL {comp['name']:<10} failed to load: {comp['load_error']}"]
    status = "OK  " if comp["ok"] else "FAIL"
    if not comp["enabled"]:
        status = "OFF " if comp["ok"] else "off!"
    line = (
        f"  {status} {comp['name']:<10} {comp['distribution'] + ' ' + comp['version']:<22} interface {comp['interface']:<10}"
        f" vllm {comp['vllm']:<14} plugin {comp['plugin']}{'' if comp['enabled'] else ' (filtered out)'}"
    )
    return [line, *(f"         - {p}" for p in comp["problems"])]


def _render_components(report: dict[str, Any]) -> list[str]:
    value = report["vllm_plugins"]["value"]
    filt = "VLLM_PLUGINS unset: every plugin loads" if value is None else f"VLLM_PLUGINS={value!r}"
    out = ["", f"Components ({filt})"]
    for comp in report["components"].values():
        out += _render_component(comp)
    if not report["missing"]:
        return [*out, "", "Every layer is installed."]
    out += ["", "Missing for a full install"]
    out.extend(f"  {m['layer']:<10} {m['command']}" for m in report["missing"])
    return [*out, f"  all layers {report['full_install']}"]


def _render_plugins(report: dict[str, Any]) -> list[str]:
    plugins = report["vllm_plugins"]
    if plugins["value"] is None:
        return []
    out = ["", "VLLM_PLUGINS", f"  filtered out: {', '.join(plugins['filtered_out']) or 'nothing'}"]
    if plugins["unknown_names"]:
        out.append(f"  names matching no plugin: {', '.join(repr(n) for n in plugins['unknown_names'])}")
    return out + [f"  note: {n}" for n in plugins["notes"]]


def _render_surface(report: dict[str, Any]) -> list[str]:
    surface = report.get("vllm_surface")
    if surface is None:
        return []
    state = f"{len(surface['problems'])} drifted" if surface["problems"] else "all present, signatures match"
    return ["", "vLLM surface", f"  {surface['checked']} vLLM names of {', '.join(surface['layers'])}: {state}"]


def _render_findings(report: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for title, items in (("Warnings", report["warnings"]), ("Errors", report["errors"])):
        if items:
            out += ["", title, *(f"  - {item}" for item in items)]
    return out + ["", "Result: OK" if report["ok"] else f"Result: BROKEN ({len(report['errors'])} error(s))"]


def render(report: dict[str, Any]) -> str:
    """The human-readable report: one block per section, then the findings and the result."""
    out = [f"vllm-npu doctor (npu-platform {report['versions']['npu-platform']})"]
    for block in (_render_versions, _render_device, _render_components, _render_plugins, _render_surface):
        out += block(report)
    return "\n".join(out + _render_findings(report))


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
