# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""bert-token-types-no-shift / roberta-token-types-no-shift: the token-type decode that BERT's and RoBERTa's
embedding layers call (inside the captured graph) runs no shift op once patched, and gives vLLM's exact result.

An ACL graph captures aclnn kernels only and torch_npu 2.8.0 has ``__lshift__`` / ``__rshift__`` only as ACL ops,
so the test records the aten ops the decode dispatches (what torch_npu would bind) instead of running an NPU.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from vllm_npu.patches import PatchRegistry
from vllm_npu.patches.sets import BERT_TOKEN_TYPES_NO_SHIFT, ROBERTA_TOKEN_TYPES_NO_SHIFT

pytestmark = pytest.mark.usefixtures("vllm_unpatched")

SHIFT_OPS = ("lshift", "rshift", "left_shift", "right_shift")


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def _encoded_ids(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int32 ids (as vLLM's input buffer holds them) with token types 0/1 encoded by vLLM's own encoder."""
    from vllm.model_executor.models.bert import _encode_token_type_ids

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250_002, (37,), generator=g, dtype=torch.int32)  # XLM-R's vocabulary size
    types = torch.randint(0, 2, (30,), generator=g, dtype=torch.int32)  # padded tail: no types
    plain = ids.clone()
    _encode_token_type_ids(ids, types)
    return ids, plain, torch.cat([types, torch.zeros(7, dtype=torch.int32)])


def _embedding_decoders():
    """The decode functions BertEmbedding.forward and RobertaEmbedding.forward call (their module globals)."""
    from vllm.model_executor.models.bert import BertEmbedding
    from vllm.model_executor.models.roberta import RobertaEmbedding

    return {
        "bert": BertEmbedding.forward.__globals__["_decode_token_type_ids"],
        "roberta": RobertaEmbedding.forward.__globals__["_decode_token_type_ids"],
    }


def _ops(decode, ids: torch.Tensor) -> list[str]:
    with _OpLog() as log:
        decode(ids)
    return log.ops


def test_vllm_decode_shifts_in_the_embedding_layer():
    """Without the patches both embedding layers' decode dispatches shift ops (so the check below is live)."""
    for name, decode in _embedding_decoders().items():
        ids, _, _ = _encoded_ids()
        assert any(s in op for op in _ops(decode, ids) for s in SHIFT_OPS), name


def test_patched_decode_has_no_shift_and_matches_vllm():
    from vllm.model_executor.models.bert import _decode_token_type_ids as vllm_decode

    reg = PatchRegistry([BERT_TOKEN_TYPES_NO_SHIFT, ROBERTA_TOKEN_TYPES_NO_SHIFT])
    reg.apply("worker", environ={})
    try:
        for name, decode in _embedding_decoders().items():
            assert decode is not vllm_decode, name
            for seed in range(3):
                ids, plain, types = _encoded_ids(seed)
                ref_ids = ids.clone()
                ref_types = vllm_decode(ref_ids)
                ops = _ops(decode, ids)
                assert not [op for op in ops if any(s in op for s in SHIFT_OPS)], (name, ops)
                got = decode(_encoded_ids(seed)[0])
                assert got.dtype == ref_types.dtype == torch.int32
                assert torch.equal(got, ref_types) and torch.equal(got, types), name
                assert torch.equal(ids, ref_ids) and torch.equal(ids, plain), name  # ids restored in place
    finally:
        reg.revert()
    assert _embedding_decoders()["roberta"] is vllm_decode  # reverted: vLLM's function again
