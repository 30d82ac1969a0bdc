# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Hooks of the attention component: register the MLA layer override with vLLM's CustomOp registry.

``on_load`` runs in every process where our platform is active, ``on_worker_init`` again in each worker; both are
idempotent (``registry.once``; vLLM asserts on duplicate CustomOp names).
"""

from __future__ import annotations

from vllm_npu.interface.component import HookContext
from vllm_npu.interface.registry import once

#: vLLM CustomOp class name -> "module:Class" of our override.
OOT_LAYERS: dict[str, str] = {
    "MultiHeadLatentAttention": "vllm_npu.attention.ops.mla_layer:AscendMultiHeadLatentAttention",
}


def register_oot_layers() -> list[str]:
    """Register :data:`OOT_LAYERS` with ``CustomOp.register_oot`` once per process; returns the names registered now."""
    import importlib

    from vllm.model_executor.custom_op import CustomOp

    done = []
    for name, target in OOT_LAYERS.items():
        module, _, attr = target.partition(":")

        def _register(name: str = name, module: str = module, attr: str = attr) -> None:
            cls = getattr(importlib.import_module(module), attr)
            existing = CustomOp.op_registry_oot.get(name)
            if existing is not None and existing is not cls:
                raise RuntimeError(
                    f"vLLM CustomOp {name!r} is already overridden by {existing.__module__}.{existing.__qualname__}; "
                    f"vllm_npu.attention wants {module}.{attr}. Two out-of-tree plugins override the same layer: "
                    "uninstall one"
                )
            if existing is None:
                CustomOp.register_oot(_decorated_op_cls=cls, name=name)

        if once(f"vllm_npu.attention.register_oot:{name}", _register):
            done.append(name)
    return done


def on_load(ctx: HookContext) -> None:
    register_oot_layers()


def on_worker_init(ctx: HookContext) -> None:
    register_oot_layers()
