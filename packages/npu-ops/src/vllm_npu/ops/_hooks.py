# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Hook of the ops component: register the CustomOp overrides with vLLM.

``on_load`` runs in every process where our platform is active (vLLM loads general plugins in the front-end,
the engine core and each worker), and the registry runs it again in each worker at NPUWorker init
(``registry.init_worker``), so a worker never depends on plugin load order. Idempotent (``registry.once``).
"""

from __future__ import annotations

from vllm_npu.interface import HookContext

from ._registry import register_oot_ops


def on_load(ctx: HookContext) -> None:
    register_oot_ops()
