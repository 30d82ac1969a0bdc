# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Hook of the attention component: register the MLA layer override with vLLM's CustomOp registry.

``on_load`` runs in every process where our platform is active, and again in each worker through
``registry.init_worker``; idempotent (``registry.once``; vLLM asserts on duplicate CustomOp names).
"""

from __future__ import annotations

from vllm_npu.interface import HookContext, register_custom_ops

#: vLLM CustomOp class name -> "module:Class" of our override.
OOT_LAYERS: dict[str, str] = {
    "MultiHeadLatentAttention": "vllm_npu.attention.ops.mla_layer:AscendMultiHeadLatentAttention",
}


def on_load(ctx: HookContext) -> None:
    register_custom_ops(OOT_LAYERS, owner="vllm_npu.attention")
