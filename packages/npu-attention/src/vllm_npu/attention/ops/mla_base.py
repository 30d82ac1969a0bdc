# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vLLM's MLA layer CustomOp across the 0.11 line: ``MultiHeadLatentAttention`` in 0.11.0, renamed
``MultiHeadLatentAttentionWrapper`` in 0.11.1 (same constructor, same ``forward_native``; its ``mla_attn`` became an
``MLAAttention`` layer that calls the same backend ``impl``). The override subclasses whichever the installed vLLM
has, and registers under that class's name (``CustomOp.register_oot`` keys on it).

The type checker sees 0.11.0's name (the default environment's vLLM)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import vllm.model_executor.layers.mla as _mla

if TYPE_CHECKING:
    from vllm.model_executor.layers.mla import MultiHeadLatentAttention as VllmMLALayer
else:
    VllmMLALayer = getattr(_mla, "MultiHeadLatentAttentionWrapper", None) or _mla.MultiHeadLatentAttention

#: The CustomOp name our override registers under (the class name of the installed vLLM's MLA layer).
VLLM_MLA_LAYER_NAME: str = VllmMLALayer.__name__
