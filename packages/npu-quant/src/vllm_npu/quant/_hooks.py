"""Hooks of the quant component (see ``_component.py``). Both are idempotent."""

from __future__ import annotations

from vllm_npu.interface import HookContext


def on_load(ctx: HookContext) -> None:
    """Every process, when vLLM loads general plugins: register the ``ascend`` quantization method."""
    from .config import register

    register()


def on_worker_init(ctx: HookContext) -> None:
    """Each worker: the same registration (a worker must not depend on plugin load order)."""
    from .config import register

    register()
