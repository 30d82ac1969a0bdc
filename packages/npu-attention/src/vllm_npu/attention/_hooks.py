# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Hook of the attention component: register the MLA layer override with vLLM's CustomOp registry.

``on_load`` runs in every process where our platform is active, and again in each worker through
``registry.init_worker``; idempotent (``registry.once``; vLLM asserts on duplicate CustomOp names).
"""

from __future__ import annotations

from vllm_npu.interface import HookContext, register_custom_ops

#: vLLM CustomOp class name -> "module:Class" of our override (the MLA layer's name is the installed vLLM's:
#: ``MultiHeadLatentAttention`` on 0.11.0, ``MultiHeadLatentAttentionWrapper`` from 0.11.1; see ``ops/mla_base.py``).
MLA_LAYER_OVERRIDE = "vllm_npu.attention.ops.mla_layer:AscendMultiHeadLatentAttention"


def oot_layers() -> dict[str, str]:
    """The override table for the installed vLLM (imports vLLM's MLA module: call it from a hook only)."""
    from .ops.mla_base import VLLM_MLA_LAYER_NAME

    return {VLLM_MLA_LAYER_NAME: MLA_LAYER_OVERRIDE}


def on_load(ctx: HookContext) -> None:
    register_custom_ops(oot_layers(), owner="vllm_npu.attention")
