# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The patches layer's component hooks: platform patches at plugin load, worker patches at worker init."""

from __future__ import annotations

from vllm_npu.interface import HookContext, Scope

from ._registry import apply_patches


def on_load(ctx: HookContext) -> None:
    """Apply the ``platform`` patches in every process where our platform is active (env settings only)."""
    apply_patches(Scope.PLATFORM)


def on_worker_init(ctx: HookContext) -> None:
    """Apply the ``worker`` patches in a worker process; ``additional_config.npu.disabled_patches`` applies too."""
    apply_patches(Scope.WORKER, vllm_config=ctx.vllm_config)
