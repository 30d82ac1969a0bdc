# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The errors every layer raises. Each one names the cause and the exact fix.

Nothing here imports torch or vLLM: errors must be raisable from the import-light plugin hooks.
"""

from __future__ import annotations

#: Every layer of the plugin; layer ``x`` ships as the distribution ``npu-x`` (the single source for install commands).
LAYERS: tuple[str, ...] = ("interface", "platform", "ops", "attention", "quant", "models", "patches", "kv")
LAYER_DISTRIBUTIONS: dict[str, str] = {layer: f"npu-{layer}" for layer in LAYERS}


def install_command(layer: str) -> str:
    """The pip command that installs ``layer`` (e.g. ``quant``) the way users install the plugin."""
    if layer not in LAYER_DISTRIBUTIONS:
        raise ValueError(f"unknown layer {layer!r}; expected one of {sorted(LAYER_DISTRIBUTIONS)}")
    if layer in ("interface", "platform"):
        return f'pip install "{LAYER_DISTRIBUTIONS[layer]}"'
    return f'pip install "npu-platform[{layer}]"'


class NPUPluginError(Exception):
    """Base class of every error raised by vllm-npu-plugin."""


class MissingComponentError(NPUPluginError, ImportError):
    """A layer that the request needs is not installed.

    The message reads ``<reason>; install the <layer> layer: pip install "npu-platform[<layer>]"``. ``fix``
    replaces the install advice when the layer is present but unusable (e.g. left out by ``VLLM_PLUGINS``).
    """

    def __init__(self, layer: str, reason: str, *, fix: str | None = None) -> None:
        self.layer = layer
        self.reason = reason
        self.fix = fix if fix is not None else f"install the {layer} layer: {install_command(layer)}"
        super().__init__(f"{reason}; {self.fix}")


class ComponentSkewError(NPUPluginError, RuntimeError):
    """Installed components that cannot work together (interface or vLLM version outside a declared range)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"the installed vllm-npu components do not fit together:\n{lines}")


class DeviceUnavailableError(NPUPluginError, RuntimeError):
    """The requested device mode cannot run on this host (e.g. ``VLLM_NPU_DEVICE=npu`` without an NPU)."""


class ConfigError(NPUPluginError, ValueError):
    """An environment variable or ``--additional-config`` key holds a bad value or is unknown."""


class KernelContractError(NPUPluginError, ValueError):
    """A kernel was called with shapes, dtypes or layouts outside its documented contract."""
