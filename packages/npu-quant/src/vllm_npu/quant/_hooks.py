# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The quant component's hook (see ``_component.py``); idempotent. No worker hook: a worker's init runs this load
hook too (``registry.init_worker``), so a worker never depends on plugin load order."""

from __future__ import annotations

from vllm_npu.interface import HookContext


def on_load(ctx: HookContext) -> None:
    """Every process, when vLLM loads general plugins: register the ``ascend`` quantization method."""
    from .config import register

    register()
