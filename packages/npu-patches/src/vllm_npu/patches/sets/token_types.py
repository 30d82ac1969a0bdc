# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Patches ``bert-token-types-no-shift`` and ``roberta-token-types-no-shift``: BERT's and RoBERTa's token-type
decoding without bit shifts, so that the embedding layer can be captured in an ACL graph.

vLLM 0.11.0 passes a cross-encoder's token types to the compiled ``BertModel`` inside ``input_ids``: the classifier
ORs ``token_type_ids << 30`` into the ids (``vllm/model_executor/models/bert.py::_encode_token_type_ids``, eager,
outside the graph), and the embedding layer splits them again with ``<<``, ``&``, ``>>`` and ``&=``
(``_decode_token_type_ids``, called by ``BertEmbedding.forward`` and ``RobertaEmbedding.forward``). The embedding
layer is the first piece of the piecewise graph, and pooling models run PIECEWISE graphs by default. torch_npu
2.8.0 has the shifts only as ACL ops (``op_plugin/ops/aclops/__Lshift__KernelNpu.cpp``, ``LeftShift`` /
``RightShift``; its .so says "current operator __lshift__ do not have aclnn implementation"), and an ACL graph
captures aclnn kernels only, so the capture fails on an NPU. vllm-ascend v0.11.0 replaces them with a multiply /
floor-divide for RoBERTa (``vllm_ascend/patch/worker/patch_roberta.py``); BERT has the same decode in its graph and
is patched here too.

The replacement is the same function in aclnn ops (``FloorDivide``, ``BitwiseAnd``, both with opapi kernels in
torch_npu 2.8.0): ``input_ids // 2**30`` is the type (ids are non-negative and below ``2**30``; vLLM asserts
``vocab_size < 2**30``) and ``input_ids &= 2**30 - 1`` restores the token ids, in place as vLLM does. The eager
encode side is left alone (outside any graph ACL ops run; the bit layout is the same either way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: vLLM's ``TOKEN_TYPE_SHIFT`` (bert.py): the token type sits in bit 30 of each input id.
TOKEN_TYPE_SHIFT = 30
TOKEN_TYPE_MULTIPLIER = 1 << TOKEN_TYPE_SHIFT
TOKEN_MASK = TOKEN_TYPE_MULTIPLIER - 1


def make_replacement(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Build the shift-free ``_decode_token_type_ids`` (``original`` is kept by the registry)."""
    import torch

    def _decode_token_type_ids(input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` [num_tokens] int32 with the token type (0 or 1) in bit 30: returns the types (same
        dtype and shape) and clears bit 30 of ``input_ids`` in place, as vLLM's version does."""
        token_type_ids = torch.floor_divide(input_ids, TOKEN_TYPE_MULTIPLIER)
        input_ids.bitwise_and_(TOKEN_MASK)
        return token_type_ids

    _decode_token_type_ids.__module__ = original.__module__
    _decode_token_type_ids.__wrapped__ = original  # type: ignore[attr-defined]
    return _decode_token_type_ids
