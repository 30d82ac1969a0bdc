# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The component protocol: how a layer (ops, attention, quant, models, patches) announces itself.

A layer ships a module ``vllm_npu.<layer>._component`` that imports nothing but this package and defines::

    COMPONENT = Component(
        name="ops", distribution="npu-ops", version=__version__,
        interface=">=1.0,<2", vllm=SUPPORTED_VLLM,
        on_load="vllm_npu.ops._hooks:on_load",  # every process, when vLLM loads general plugins (and each worker)
        on_worker_init=None,                    # or a hook that needs the worker's VllmConfig, at NPUWorker init
    )
    load_plugin = COMPONENT.plugin_entry()

and two entry points in its pyproject::

    [project.entry-points."vllm.general_plugins"]   npu_ops = "vllm_npu.ops._component:load_plugin"
    [project.entry-points."vllm_npu.components"]    ops = "vllm_npu.ops._component:COMPONENT"

Hooks are ``"module:function"`` strings, imported only when they run, so discovering components stays cheap.
A hook takes one :class:`HookContext` and must be idempotent; the registry also runs each hook at most once per
process.

``vllm`` is the plugin line's :data:`~vllm_npu.interface.versions.SUPPORTED_VLLM`. ``interface`` stays a literal
in each layer: it is the contract that layer was written against, and deriving it from the installed
npu-interface would make the skew check pass for any pairing (a layer forced in with ``--no-deps`` from another
interface major would no longer be refused).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .device import DeviceMode


class Scope(str, enum.Enum):
    """When a hook runs: ``platform`` at plugin load in every process, ``worker`` at each worker's init."""

    PLATFORM = "platform"
    WORKER = "worker"


@dataclass(frozen=True)
class HookContext:
    """What a hook receives. ``vllm_config`` is set for worker hooks (the worker's VllmConfig), None at load."""

    mode: DeviceMode
    scope: Scope
    vllm_config: Any | None = None


@dataclass(frozen=True)
class Component:
    """A layer's declaration. Everything here is data; nothing is imported until a hook runs."""

    name: str
    distribution: str
    version: str
    interface: str
    vllm: str
    summary: str = ""
    on_load: str | None = None
    on_worker_init: str | None = None
    #: The general-plugin entry-point name when it is not ``npu_<name>`` (npu-kv's is ``npu_kv_connector``).
    plugin: str | None = None

    @property
    def plugin_name(self) -> str:
        """The vLLM general-plugin entry-point name (what ``VLLM_PLUGINS`` filters on)."""
        if self.plugin is not None:
            return self.plugin
        return "npu" if self.name == "platform" else f"npu_{self.name}"

    def hook(self, scope: Scope) -> str | None:
        return self.on_load if scope is Scope.PLATFORM else self.on_worker_init

    def plugin_entry(self) -> Callable[[], None]:
        """The function vLLM's ``vllm.general_plugins`` loader calls for this component."""

        def load_plugin() -> None:
            from .registry import load_component

            load_component(self)

        load_plugin.__qualname__ = f"load_plugin[{self.name}]"
        return load_plugin
