# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The component registry: discovery, VLLM_PLUGINS filtering, compatibility, run-once hooks, require()."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
from vllm_npu.interface import (
    INTERFACE_VERSION,
    Component,
    ComponentSkewError,
    DeviceMode,
    MissingComponentError,
    Scope,
    check_installed_set,
    compatibility_problems,
    discover,
    distribution_version,
    init_worker,
    is_available,
    load_component,
    once,
    registry,
    require,
    reset_device_selection,
)

IN_TREE = {"attention", "models", "ops", "patches", "platform", "quant"}


def component_module(
    name: str, *, version: str = "1.0.0", interface: str = ">=1.0,<2", vllm: str = ">=0.0.1", hooks: bool = False
) -> str:
    """Source of a fake layer's _component module; with ``hooks`` it records every hook call in ``CALLS``."""
    hook_args = f'on_load="{name}_comp:on_load", on_worker_init="{name}_comp:on_worker_init",' if hooks else ""
    return f"""
        from vllm_npu.interface import Component
        CALLS = []
        def on_load(ctx):
            CALLS.append(("load", ctx.mode, ctx.scope, ctx.vllm_config))
        def on_worker_init(ctx):
            CALLS.append(("worker", ctx.mode, ctx.scope, ctx.vllm_config))
        COMPONENT = Component(name="{name}", distribution="npu-{name}", version="{version}",
                              interface="{interface}", vllm="{vllm}", {hook_args})
        load_plugin = COMPONENT.plugin_entry()
    """


def add_component(fake_dist: Callable[..., Path], name: str, **kwargs: object) -> None:
    version = str(kwargs.get("version", "1.0.0"))
    fake_dist(
        f"npu-{name}",
        version,
        modules={f"{name}_comp": component_module(name, **kwargs)},  # type: ignore[arg-type]
        entry_points=f"""
            [vllm_npu.components]
            {name} = {name}_comp:COMPONENT
            [vllm.general_plugins]
            npu_{name} = {name}_comp:load_plugin
        """,
    )


def test_discovers_the_in_tree_layers() -> None:
    reports = discover()
    assert set(reports) >= IN_TREE
    for name in IN_TREE:
        report = reports[name]
        assert report.ok, report
        assert report.enabled
        assert report.component is not None and report.component.distribution == f"npu-{name}"
        assert report.component.version == distribution_version(f"npu-{name}")
    check_installed_set(reports)


def test_component_metadata() -> None:
    comp = Component(
        "quant", "npu-quant", "0.1.0", interface=">=1.0,<2", vllm=">=0.11,<0.12", on_load="m:f", on_worker_init="m:g"
    )
    assert comp.plugin_name == "npu_quant"
    assert Component("platform", "npu-platform", "0.1.0", ">=1.0", ">=0.11").plugin_name == "npu"
    assert comp.hook(Scope.PLATFORM) == "m:f" and comp.hook(Scope.WORKER) == "m:g"
    entry = comp.plugin_entry()
    assert callable(entry) and entry.__qualname__ == "load_plugin[quant]"


def test_vllm_plugins_filter_matches_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", "npu,npu_ops")
    reports = discover()
    assert reports["platform"].enabled and reports["ops"].enabled
    assert not reports["quant"].enabled and not reports["attention"].enabled
    assert not is_available("quant") and is_available("ops")
    # vLLM splits on "," without stripping: " npu_quant" is not "npu_quant". We must agree with it.
    monkeypatch.setenv("VLLM_PLUGINS", "npu, npu_quant")
    assert not discover()["quant"].enabled
    monkeypatch.setenv("VLLM_PLUGINS", "")
    assert not any(r.enabled for r in discover().values())


def test_require_names_the_pip_command_for_an_absent_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "discover", lambda: {})
    with pytest.raises(MissingComponentError) as info:
        require("quant", "this checkpoint is W8A8-quantized")
    assert str(info.value) == (
        'this checkpoint is W8A8-quantized; install the quant layer: pip install "npu-platform[quant]"'
    )
    assert info.value.layer == "quant"
    assert isinstance(info.value, ImportError)


def test_require_explains_a_layer_left_out_by_vllm_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    require("quant", "unused")  # installed and enabled: no error
    monkeypatch.setenv("VLLM_PLUGINS", "npu")
    with pytest.raises(MissingComponentError) as info:
        require("quant", "this checkpoint is W8A8-quantized")
    message = str(info.value)
    assert message.startswith("this checkpoint is W8A8-quantized; the quant layer is installed but VLLM_PLUGINS='npu'")
    assert "VLLM_PLUGINS=npu,npu_quant" in message
    assert "pip install" not in message


def test_interface_skew_names_both_versions() -> None:
    comp = Component("quant", "npu-quant", "0.9.0", interface=">=2.0,<3", vllm=">=0.11.0,<0.12")
    problems = compatibility_problems(comp, vllm_version="0.11.0")
    assert len(problems) == 1
    message = problems[0]
    assert "npu-quant 0.9.0" in message and "'>=2.0,<3'" in message
    assert f"interface {INTERFACE_VERSION}" in message
    assert f"npu-interface {distribution_version('npu-interface')}" in message
    assert 'pip install -U "npu-platform[quant]" npu-interface' in message


def test_vllm_skew_names_both_versions() -> None:
    comp = Component("ops", "npu-ops", "0.1.0", interface=">=1.0,<2", vllm=">=0.11.0,<0.12")
    assert compatibility_problems(comp, vllm_version="0.11.0") == []
    assert compatibility_problems(comp, vllm_version="0.11.1+cpu") == []
    (message,) = compatibility_problems(comp, vllm_version="0.10.2")
    assert message.startswith("vLLM 0.10.2 is installed, but this vllm-npu-plugin line is tested on vLLM")
    assert "'>=0.11.0,<0.12'" in message
    (message,) = compatibility_problems(comp, interface_version="1.3", vllm_version="0.12.0")
    assert "0.12.0" in message


def test_discovery_reports_skew_and_load_errors(fake_dist: Callable[..., Path]) -> None:
    add_component(fake_dist, "future", version="3.0.0", interface=">=2.0,<3")
    fake_dist("npu-broken", "0.1", entry_points="[vllm_npu.components]\nbroken = no_such_module_xyz:COMPONENT\n")
    fake_dist(
        "npu-notcomp",
        "0.1",
        modules={"notcomp_mod": "COMPONENT = 42\n"},
        entry_points="[vllm_npu.components]\nnotcomp = notcomp_mod:COMPONENT\n",
    )
    reports = discover()
    assert not reports["future"].ok and "'>=2.0,<3'" in reports["future"].problems[0]
    assert reports["broken"].component is None and "ModuleNotFoundError" in (reports["broken"].load_error or "")
    assert "is a int, not a Component" in (reports["notcomp"].load_error or "")
    with pytest.raises(ComponentSkewError) as info:
        check_installed_set(reports)
    text = str(info.value)
    assert text.startswith("the installed vllm-npu components do not fit together:")
    assert "npu-future 3.0.0 needs interface '>=2.0,<3'" in text
    assert "component 'broken' failed to load" in text and "component 'notcomp' failed to load" in text
    assert len(info.value.problems) == 3


def test_disabled_components_do_not_break_the_set(
    fake_dist: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    add_component(fake_dist, "future", interface=">=2.0,<3")
    with pytest.raises(ComponentSkewError):
        check_installed_set()
    monkeypatch.setenv("VLLM_PLUGINS", "npu,npu_ops")  # npu_future filtered out: vLLM will not load it
    check_installed_set()


def test_two_installations_of_one_layer(fake_dist: Callable[..., Path]) -> None:
    fake_dist(
        "npu-quant-vendored",
        "0.0.1",
        modules={"vendored_quant": component_module("quant", version="0.0.1")},
        entry_points="[vllm_npu.components]\nquant = vendored_quant:COMPONENT\n",
    )
    problems = discover()["quant"].problems
    assert problems and "two installations of the quant layer" in problems[0]
    assert "0.0.1" in problems[0] and distribution_version("npu-quant") in problems[0]


def test_hooks_run_once_per_process(fake_dist: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    add_component(fake_dist, "hooked", hooks=True)
    import hooked_comp

    comp = hooked_comp.COMPONENT
    assert registry.run_hook(comp, Scope.PLATFORM, DeviceMode.EMULATED)
    assert not registry.run_hook(comp, Scope.PLATFORM, DeviceMode.EMULATED)
    assert registry.run_hook(comp, Scope.WORKER, DeviceMode.EMULATED, vllm_config="cfg")
    assert not registry.run_hook(comp, Scope.WORKER, DeviceMode.EMULATED, vllm_config="cfg")
    assert hooked_comp.CALLS == [
        ("load", DeviceMode.EMULATED, Scope.PLATFORM, None),
        ("worker", DeviceMode.EMULATED, Scope.WORKER, "cfg"),
    ]
    no_hooks = Component("plain", "npu-plain", "1", ">=1.0", ">=0")
    assert not registry.run_hook(no_hooks, Scope.PLATFORM, DeviceMode.EMULATED)


def test_failed_hook_runs_again(fake_dist: Callable[..., Path]) -> None:
    fake_dist(
        "npu-flaky",
        "1.0",
        modules={
            "flaky_hooks": """
        ATTEMPTS = []
        def on_load(ctx):
            ATTEMPTS.append(ctx)
            if len(ATTEMPTS) == 1:
                raise RuntimeError("first try fails")
    """
        },
    )
    import flaky_hooks

    comp = Component("flaky", "npu-flaky", "1.0", ">=1.0", ">=0", on_load="flaky_hooks:on_load")
    with pytest.raises(RuntimeError):
        registry.run_hook(comp, Scope.PLATFORM, DeviceMode.EMULATED)
    assert registry.run_hook(comp, Scope.PLATFORM, DeviceMode.EMULATED)
    assert len(flaky_hooks.ATTEMPTS) == 2


def test_bad_hook_path() -> None:
    with pytest.raises(ValueError, match="hook 'no_colon_here' must look like 'package.module:attr'"):
        registry.resolve_hook("no_colon_here")


def test_load_component_only_on_our_platform(
    fake_dist: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, plugin_log
) -> None:
    add_component(fake_dist, "gated", hooks=True)
    import gated_comp

    monkeypatch.setenv("VLLM_NPU_DEVICE", "off")
    gated_comp.load_plugin()  # what vLLM's general-plugin loader calls
    assert gated_comp.CALLS == []
    reset_device_selection()
    monkeypatch.setenv("VLLM_NPU_DEVICE", "emulated")
    gated_comp.load_plugin()
    gated_comp.load_plugin()
    assert gated_comp.CALLS == [("load", DeviceMode.EMULATED, Scope.PLATFORM, None)]


def test_load_component_refuses_a_skewed_layer(
    fake_dist: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, plugin_log
) -> None:
    add_component(fake_dist, "skewed", hooks=True, interface=">=2.0,<3")
    import skewed_comp

    monkeypatch.setenv("VLLM_NPU_DEVICE", "emulated")
    load_component(skewed_comp.COMPONENT)
    assert skewed_comp.CALLS == []
    errors = [r.getMessage() for r in plugin_log.records if r.levelname == "ERROR"]
    assert any("npu-skewed is not loaded" in m and "'>=2.0,<3'" in m for m in errors)


def test_init_worker_runs_load_and_worker_hooks(
    fake_dist: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    add_component(fake_dist, "workerhooks", hooks=True)
    import workerhooks_comp

    names = init_worker("the-vllm-config", DeviceMode.EMULATED)
    assert "workerhooks" in names and set(names) >= IN_TREE
    assert workerhooks_comp.CALLS == [
        ("load", DeviceMode.EMULATED, Scope.PLATFORM, None),
        ("worker", DeviceMode.EMULATED, Scope.WORKER, "the-vllm-config"),
    ]


def test_init_worker_refuses_a_broken_set(fake_dist: Callable[..., Path]) -> None:
    add_component(fake_dist, "future2", interface=">=2.0,<3")
    with pytest.raises(ComponentSkewError, match="npu-future2"):
        init_worker(None, DeviceMode.EMULATED)


def test_init_worker_skips_filtered_components(fake_dist: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    add_component(fake_dist, "filtered", hooks=True)
    import filtered_comp

    monkeypatch.setenv("VLLM_PLUGINS", "npu")
    assert init_worker(None, DeviceMode.EMULATED) == ["platform"]
    assert filtered_comp.CALLS == []


def test_once_runs_a_key_once() -> None:
    calls: list[int] = []
    key = f"test-once-{id(calls)}"
    assert once(key, lambda: calls.append(1))
    assert not once(key, lambda: calls.append(2))
    assert calls == [1]


def test_once_retries_after_a_failure() -> None:
    key = "test-once-failure"

    def fail() -> None:
        raise ValueError("duplicate")

    with pytest.raises(ValueError):
        once(key, fail)
    assert once(key, lambda: None)
    assert not once(key, fail)


def test_entry_points_match_what_vllm_reads() -> None:
    """Every in-tree layer (but the platform) has a general plugin named after its component."""
    general = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    platform = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.platform_plugins")}
    assert platform.get("npu") == "vllm_npu.platform:register"
    for name, report in discover().items():
        if name in IN_TREE - {"platform"}:
            assert general[report.component.plugin_name] == f"vllm_npu.{name}._component:load_plugin"


def test_vllm_npu_is_a_namespace_package() -> None:
    import vllm_npu

    assert getattr(vllm_npu, "__file__", None) is None  # PEP 420: no vllm_npu/__init__.py anywhere
    assert len(list(vllm_npu.__path__)) >= 2  # one portion per installed member


def test_register_custom_ops_registers_once_and_refuses_a_foreign_override() -> None:
    from vllm.model_executor.custom_op import CustomOp

    class Mine(CustomOp):
        pass

    class Other:
        pass

    mine, theirs = "NPUInterfaceTestOp", "NPUInterfaceTestTaken"
    sys.modules["npu_iface_test_ops"] = types.SimpleNamespace(Mine=Mine)  # type: ignore[assignment]
    CustomOp.op_registry_oot[theirs] = Other
    try:
        table = {mine: "npu_iface_test_ops:Mine"}
        assert registry.register_custom_ops(table, owner="npu_iface_test") == [mine]
        assert CustomOp.op_registry_oot[mine] is Mine
        assert registry.register_custom_ops(table, owner="npu_iface_test") == []  # once per process
        with pytest.raises(RuntimeError) as info:
            registry.register_custom_ops({theirs: "npu_iface_test_ops:Mine"}, owner="npu_iface_test")
        assert str(info.value) == (
            f"vLLM CustomOp {theirs!r} is already overridden by {Other.__module__}.{Other.__qualname__}; "
            "npu_iface_test wants npu_iface_test_ops:Mine. Two out-of-tree plugins override the same op: uninstall one"
        )
        assert CustomOp.op_registry_oot[theirs] is Other
    finally:
        CustomOp.op_registry_oot.pop(mine, None)
        CustomOp.op_registry_oot.pop(theirs, None)
        sys.modules.pop("npu_iface_test_ops", None)
