# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The vLLM internals the models layer overrides, calls or writes, with the vLLM 0.11.0 signatures. Checked by
``tests/test_vllm_surface.py`` and ``vllm-npu doctor --vllm-surface``; see :mod:`vllm_npu.interface.vllm_surface`."""

from __future__ import annotations

from vllm_npu.interface import VllmName

_REGISTRY = "vllm.model_executor.models.registry"
_LAZY = f"{_REGISTRY}:_LazyRegisteredModel"
_ENTRY = ("vllm_npu.models._registry_entry",)

SURFACE: tuple[VllmName, ...] = (
    VllmName(
        f"{_REGISTRY}:_ModelRegistry",
        "models",
        "attribute",
        "writes",
        ("vllm_npu.models._hooks",),
        "our overrides' registry entries are put there after register_model (arch -> entry); without it vLLM's own "
        "lazy entry serves them and their inspection is not cached",
    ),
    VllmName(
        _LAZY,
        "inspect_model_cls",
        "method",
        "overrides",
        _ENTRY,
        "NPULazyModel caches the inspection on our sources; a renamed method would bring back the subprocess per start",
        signature="(self)",
    ),
    VllmName(
        _LAZY,
        "_load_modelinfo_from_cache",
        "method",
        "calls",
        _ENTRY,
        "reads the cached inspection under $VLLM_CACHE_ROOT/modelinfos with our key",
        signature="(self, module_hash)",
    ),
    VllmName(
        _LAZY,
        "_save_modelinfo_to_cache",
        "method",
        "calls",
        _ENTRY,
        "writes the inspection with our key",
        signature="(self, mi, module_hash)",
    ),
    VllmName(
        _LAZY,
        "load_model_cls",
        "method",
        "calls",
        _ENTRY,
        "imports the class in the inspection subprocess",
        signature="(self)",
    ),
    VllmName(
        _REGISTRY,
        "_LazyRegisteredModel",
        "module_global",
        "calls",
        _ENTRY,
        "NPULazyModel subclasses vLLM's lazily imported registry entry (module_name, class_name; frozen dataclass)",
    ),
    VllmName(
        _REGISTRY,
        "_ModelInfo",
        "module_global",
        "calls",
        _ENTRY,
        "the inspection result NPULazyModel caches and returns",
    ),
    VllmName(
        _REGISTRY,
        "_run_in_subprocess",
        "module_global",
        "calls",
        _ENTRY,
        "the inspection runs in a subprocess as vLLM's does (importing a model may initialise the device runtime)",
    ),
    VllmName(
        f"{_REGISTRY}:_ModelInfo",
        "from_model_cls",
        "method",
        "calls",
        _ENTRY,
        "builds the inspection result vLLM reads",
        signature="(model)",
    ),
)
