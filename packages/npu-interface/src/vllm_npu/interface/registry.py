# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The component registry: discovery, compatibility checks and hook execution.

Discovery reads the ``vllm_npu.components`` entry-point group; loading one imports only the layer's tiny
``_component`` module. Hooks run at most once per (component, scope) per process, so vLLM calling plugin hooks
several times (it does: the platform hook twice, general plugins once in every process) is harmless.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .component import Component, HookContext, Scope
from .device import DeviceMode, current_mode
from .errors import ComponentSkewError, MissingComponentError
from .log import get_logger
from .targets import import_target
from .versions import INTERFACE_VERSION, RangeCheck, distribution_version, in_range
from .vllm_line import allow_untested, untested_vllm, warn_untested_once

ENTRY_POINT_GROUP = "vllm_npu.components"

logger = get_logger(__name__)

_lock = threading.RLock()
_ran: set[tuple[str, Scope]] = set()  # (component, scope) pairs whose hook already ran in this process
_once_keys: set[str] = set()  # keys of once() calls that already ran


@dataclass(frozen=True)
class ComponentReport:
    """One discovered component and its compatibility with this process."""

    name: str
    component: Component | None
    enabled: bool
    problems: tuple[str, ...]
    load_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.component is not None and not self.problems and self.load_error is None


def _vllm_plugins_filter() -> set[str] | None:
    """vLLM's ``VLLM_PLUGINS`` filter: None = every plugin; otherwise the allowed entry-point names.

    Parsed exactly as ``vllm.envs`` does (``split(",")``, no stripping), so ``"npu, npu_quant"`` leaves out
    ``npu_quant`` here just as it does in vLLM; ``vllm-npu doctor`` points such spaces out.
    """
    raw = os.environ.get("VLLM_PLUGINS")
    if raw is None:
        return None
    return set(raw.split(","))


def plugin_enabled(component: Component) -> bool:
    allowed = _vllm_plugins_filter()
    return allowed is None or component.plugin_name in allowed


def compatibility_problems(
    component: Component, *, interface_version: str = INTERFACE_VERSION, vllm_version: str | None = None
) -> list[str]:
    """Why ``component`` cannot run here (empty list = it can). Both versions are named in every message."""
    problems = []
    if not in_range(interface_version, component.interface, what=f"{component.distribution} interface range"):
        problems.append(
            f"{component.distribution} {component.version} needs interface {component.interface!r} but "
            f"npu-interface {distribution_version('npu-interface') or '?'} provides interface {interface_version}; "
            f'install matching versions: pip install -U "npu-platform[{component.name}]" npu-interface'
            if component.name != "platform"
            else f"npu-platform {component.version} needs interface {component.interface!r} but npu-interface "
            f"provides interface {interface_version}; pip install -U npu-platform npu-interface"
        )
    vllm_version = vllm_version if vllm_version is not None else distribution_version("vllm")
    untested = untested_vllm(vllm_version, component.vllm)
    if untested is not None:
        # One message for every layer (check_installed_set drops the repeats), unless the user allowed it.
        if allow_untested():
            warn_untested_once(untested)
        else:
            problems.append(untested)
        return problems
    check = RangeCheck(component.distribution, "vllm", component.vllm, vllm_version)
    if not check.ok:
        problems.append(str(check))
    return problems


def discover(group: str = ENTRY_POINT_GROUP) -> dict[str, ComponentReport]:
    """Every installed component, by name, with its compatibility report. Never raises."""
    reports: dict[str, ComponentReport] = {}
    for ep in importlib.metadata.entry_points(group=group):
        try:
            component = ep.load()
            if not isinstance(component, Component):
                raise TypeError(f"{ep.value} is a {type(component).__name__}, not a Component")
        except Exception as exc:  # a broken third-party or half-installed package must not break discovery
            reports[ep.name] = ComponentReport(ep.name, None, False, (), load_error=f"{type(exc).__name__}: {exc}")
            continue
        problems = compatibility_problems(component)
        previous = reports.get(component.name)
        if previous is not None and previous.component is not None and previous.component != component:
            # Two copies of one layer (a wheel plus a PYTHONPATH/vendored copy): which one imports is an accident.
            problems.insert(
                0,
                f"two installations of the {component.name} layer: {previous.component.distribution} "
                f"{previous.component.version} and {component.distribution} {component.version} "
                f"({ep.value}); remove one",
            )
        reports[component.name] = ComponentReport(component.name, component, plugin_enabled(component), tuple(problems))
    return dict(sorted(reports.items()))


def check_installed_set(reports: dict[str, ComponentReport] | None = None) -> None:
    """Raise :class:`ComponentSkewError` if any installed, enabled component cannot run with the others."""
    reports = discover() if reports is None else reports
    problems = [p for r in reports.values() if r.enabled or r.component is None for p in r.problems]
    problems += [f"component {r.name!r} failed to load: {r.load_error}" for r in reports.values() if r.load_error]
    if problems:
        raise ComponentSkewError(list(dict.fromkeys(problems)))  # an untested vLLM: one line, not one per layer


def is_available(layer: str) -> bool:
    """Whether ``layer`` is installed and enabled (by ``VLLM_PLUGINS``). Reads metadata only."""
    report = discover().get(layer)
    return report is not None and report.enabled and report.component is not None


def require(layer: str, reason: str) -> None:
    """Raise :class:`MissingComponentError` (with the pip command) unless ``layer`` is installed and enabled."""
    report = discover().get(layer)
    if report is None or report.component is None:
        raise MissingComponentError(layer, reason)
    if not report.enabled:
        raise MissingComponentError(
            layer,
            reason,
            fix=f"the {layer} layer is installed but VLLM_PLUGINS={os.environ.get('VLLM_PLUGINS')!r} leaves out its "
            f"plugin {report.component.plugin_name!r}: add it (e.g. VLLM_PLUGINS=npu,{report.component.plugin_name}) "
            "or unset VLLM_PLUGINS",
        )


def resolve_hook(path: str) -> Callable[[HookContext], Any]:
    """Import a ``"module:function"`` hook."""
    hook: Callable[[HookContext], Any] = import_target(path, what="hook")
    return hook


def run_hook(component: Component, scope: Scope, mode: DeviceMode, vllm_config: Any | None = None) -> bool:
    """Run one component's hook for ``scope`` once per process. Returns True if it ran now."""
    path = component.hook(scope)
    if path is None:
        return False
    with _lock:
        if (component.name, scope) in _ran:
            return False
        resolve_hook(path)(HookContext(mode=mode, scope=scope, vllm_config=vllm_config))
        _ran.add((component.name, scope))
        logger.debug("ran %s hook of %s", scope.value, component.distribution)
        return True


def load_component(component: Component) -> None:
    """Body of every layer's ``vllm.general_plugins`` entry: run its load hook if our platform is active here."""
    mode = current_mode()
    if mode is None:
        logger.debug("%s: the NPU platform is not active in this process; nothing to register", component.plugin_name)
        return
    problems = compatibility_problems(component)
    if problems:
        # vLLM swallows plugin exceptions; the platform raises at start instead. An untested vLLM is one message for
        # the whole plugin (the platform raises it), not one per layer.
        untested = untested_vllm(distribution_version("vllm"), component.vllm)
        if untested is not None and problems == [untested]:
            once(f"untested-vllm:{untested}", lambda: logger.error("every NPU layer is off: %s", untested))
            return
        logger.error("%s is not loaded: %s", component.distribution, "; ".join(problems))
        return
    run_hook(component, Scope.PLATFORM, mode)


def init_worker(vllm_config: Any, mode: DeviceMode) -> list[str]:
    """Run every enabled, compatible component's load and worker hooks in a worker process.

    The load hook runs here too (once) so that a worker never depends on the order in which vLLM loaded general
    plugins. Returns the names of the components initialised.
    """
    reports = discover()
    check_installed_set(reports)
    names = []
    for report in reports.values():
        if not (report.enabled and report.component is not None):
            continue
        run_hook(report.component, Scope.PLATFORM, mode)
        run_hook(report.component, Scope.WORKER, mode, vllm_config)
        names.append(report.name)
    return names


def once(key: str, fn: Callable[[], Any]) -> bool:
    """Run ``fn`` the first time ``key`` is seen in this process (thread-safe). For guarding vLLM registries
    that raise or assert on duplicates (``CustomOp.register_oot``, ``register_quantization_config``)."""
    with _lock:
        if key in _once_keys:
            return False
        fn()
        _once_keys.add(key)
        return True


def register_custom_ops(table: Mapping[str, str], *, owner: str) -> list[str]:
    """Register ``table`` (vLLM CustomOp class name -> ``"module:Class"`` of the override) with vLLM, once per process.

    ``CustomOp.register_oot`` keys on the exact class name (subclasses under other names keep vLLM's class) and
    asserts on a duplicate name, so each name goes through :func:`once`. A name that another out-of-tree plugin
    already overrides is an error naming both classes, never a silent replacement. ``owner`` (e.g.
    ``"vllm_npu.ops"``) names the layer in that error and keys the ``once`` guard. Imports vLLM and each override
    only here. Returns the names registered by this call.
    """
    from vllm.model_executor.custom_op import CustomOp

    done = []
    for name, target in table.items():

        def _register(name: str = name, target: str = target) -> None:
            cls = import_target(target, what=f"{owner} override of vLLM CustomOp {name!r}")
            existing = CustomOp.op_registry_oot.get(name)
            if existing is not None and existing is not cls:
                raise RuntimeError(
                    f"vLLM CustomOp {name!r} is already overridden by {existing.__module__}.{existing.__qualname__}; "
                    f"{owner} wants {target}. Two out-of-tree plugins override the same op: uninstall one"
                )
            if existing is None:
                CustomOp.register_oot(_decorated_op_cls=cls, name=name)

        if once(f"{owner}.register_oot:{name}", _register):
            done.append(name)
    if done:
        logger.debug("%s registered CustomOp overrides: %s", owner, ", ".join(done))
    return done
