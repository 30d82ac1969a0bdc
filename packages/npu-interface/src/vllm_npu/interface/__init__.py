# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm_npu.interface: the contracts every vllm-npu-plugin layer codes against.

Importing this package costs nothing: every export is loaded on first access (PEP 562), because vLLM runs the
platform hook on its start-up path in every process. Nothing here imports torch, torch_npu or vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__

# Lazy exports (PEP 562): name -> ".module:attr", imported on first access. The TYPE_CHECKING block and
# __all__ mirror the table for type checkers and IDEs; tests/test_doors.py checks that the three agree.
_EXPORTS = {
    "Component": ".component:Component",
    "HookContext": ".component:HookContext",
    "Scope": ".component:Scope",
    "AdditionalConfig": ".config:AdditionalConfig",
    "EnvConfig": ".config:EnvConfig",
    "ADDITIONAL_CONFIG_KEY": ".settings:ADDITIONAL_CONFIG_KEY",
    "DEVICE_SETTINGS": ".settings:DEVICE_SETTINGS",
    "read_device_setting": ".settings:read_device_setting",
    "DeviceDecision": ".device:DeviceDecision",
    "DeviceMode": ".device:DeviceMode",
    "Kernel": ".kernels:Kernel",
    "KernelBackend": ".device:KernelBackend",
    "NPUProbe": ".device:NPUProbe",
    "configure_kernels": ".device:configure_kernels",
    "current_device": ".device:current_device",
    "current_mode": ".device:current_mode",
    "decide_device": ".device:decide_device",
    "kernel_backend": ".device:kernel_backend",
    "probe_npu": ".device:probe_npu",
    "reset_device_selection": ".device:reset_device_selection",
    "ComponentSkewError": ".errors:ComponentSkewError",
    "ConfigError": ".errors:ConfigError",
    "DeviceUnavailableError": ".errors:DeviceUnavailableError",
    "KernelContractError": ".errors:KernelContractError",
    "MissingComponentError": ".errors:MissingComponentError",
    "NPUPluginError": ".errors:NPUPluginError",
    "install_command": ".errors:install_command",
    "get_logger": ".log:get_logger",
    "GraphInputsProvider": ".protocols:GraphInputsProvider",
    "LayerMoEPlanRunner": ".protocols:LayerMoEPlanRunner",
    "MoEGraphTraceable": ".protocols:MoEGraphTraceable",
    "OutputBufferFiller": ".protocols:OutputBufferFiller",
    "RequestFaultReport": ".protocols:RequestFaultReport",
    "fills_output_buffer": ".protocols:fills_output_buffer",
    "graph_inputs_of": ".protocols:graph_inputs_of",
    "report_request_faults": ".protocols:report_request_faults",
    "request_faults_of": ".protocols:request_faults_of",
    "runs_layer_moe_plan": ".protocols:runs_layer_moe_plan",
    "traces_moe_in_graph": ".protocols:traces_moe_in_graph",
    "ENTRY_POINT_GROUP": ".registry:ENTRY_POINT_GROUP",
    "ComponentReport": ".registry:ComponentReport",
    "check_installed_set": ".registry:check_installed_set",
    "compatibility_problems": ".registry:compatibility_problems",
    "discover": ".registry:discover",
    "init_worker": ".registry:init_worker",
    "is_available": ".registry:is_available",
    "load_component": ".registry:load_component",
    "once": ".registry:once",
    "require": ".registry:require",
    "KernelCall": ".selftest:KernelCall",
    "KernelCase": ".selftest:KernelCase",
    "INTERFACE_VERSION": ".versions:INTERFACE_VERSION",
    "SUPPORTED_VLLM": ".versions:SUPPORTED_VLLM",
    "distribution_version": ".versions:distribution_version",
    "in_range": ".versions:in_range",
}

if TYPE_CHECKING:
    from .component import Component, HookContext, Scope
    from .config import AdditionalConfig, EnvConfig
    from .device import (
        DeviceDecision,
        DeviceMode,
        KernelBackend,
        NPUProbe,
        configure_kernels,
        current_device,
        current_mode,
        decide_device,
        kernel_backend,
        probe_npu,
        reset_device_selection,
    )
    from .errors import (
        ComponentSkewError,
        ConfigError,
        DeviceUnavailableError,
        KernelContractError,
        MissingComponentError,
        NPUPluginError,
        install_command,
    )
    from .kernels import Kernel
    from .log import get_logger
    from .protocols import (
        GraphInputsProvider,
        LayerMoEPlanRunner,
        MoEGraphTraceable,
        OutputBufferFiller,
        RequestFaultReport,
        fills_output_buffer,
        graph_inputs_of,
        report_request_faults,
        request_faults_of,
        runs_layer_moe_plan,
        traces_moe_in_graph,
    )
    from .registry import (
        ENTRY_POINT_GROUP,
        ComponentReport,
        check_installed_set,
        compatibility_problems,
        discover,
        init_worker,
        is_available,
        load_component,
        once,
        require,
    )
    from .selftest import KernelCall, KernelCase
    from .settings import ADDITIONAL_CONFIG_KEY, DEVICE_SETTINGS, read_device_setting
    from .versions import INTERFACE_VERSION, SUPPORTED_VLLM, distribution_version, in_range
else:
    from .lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "DEVICE_SETTINGS",
    "ENTRY_POINT_GROUP",
    "INTERFACE_VERSION",
    "SUPPORTED_VLLM",
    "AdditionalConfig",
    "Component",
    "ComponentReport",
    "ComponentSkewError",
    "ConfigError",
    "DeviceDecision",
    "DeviceMode",
    "DeviceUnavailableError",
    "EnvConfig",
    "GraphInputsProvider",
    "HookContext",
    "Kernel",
    "KernelBackend",
    "KernelCall",
    "KernelCase",
    "KernelContractError",
    "LayerMoEPlanRunner",
    "MissingComponentError",
    "MoEGraphTraceable",
    "NPUPluginError",
    "NPUProbe",
    "OutputBufferFiller",
    "RequestFaultReport",
    "Scope",
    "__version__",
    "check_installed_set",
    "compatibility_problems",
    "configure_kernels",
    "current_device",
    "current_mode",
    "decide_device",
    "discover",
    "distribution_version",
    "fills_output_buffer",
    "get_logger",
    "graph_inputs_of",
    "in_range",
    "init_worker",
    "install_command",
    "is_available",
    "kernel_backend",
    "load_component",
    "once",
    "probe_npu",
    "read_device_setting",
    "report_request_faults",
    "request_faults_of",
    "require",
    "reset_device_selection",
    "runs_layer_moe_plan",
    "traces_moe_in_graph",
]
