# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""multimodal-merge-index-put: vLLM's multimodal embedding merge reaches the device as ``masked_scatter_`` with a
broadcast mask (the op torch_npu runs on the AI CPU) without the patch, and as ``index_put_`` with the same result,
dtype cast and errors with it."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from vllm_npu.patches import PatchRegistry
from vllm_npu.patches.sets import MULTIMODAL_MERGE_INDEX_PUT

pytestmark = pytest.mark.usefixtures("vllm_unpatched")


class _Ops(TorchDispatchMode):
    """Records the aten ops dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(9, 6, generator=gen)
    ids = torch.tensor([1, 7, 7, 7, 2, 7, 7, 3, 4])
    images = [torch.randn(3, 6, generator=gen).to(dtype), torch.randn(2, 6, generator=gen).to(dtype)]
    return embeds, ids, images


def _merge(embeds, ids, images):
    from vllm.model_executor.models.utils import merge_multimodal_embeddings

    with _Ops() as ops:
        out = merge_multimodal_embeddings(ids, embeds, images, 7)
    return out, ops.names


def _expected(embeds, ids, images):
    want = embeds.clone()
    want[ids == 7] = torch.cat(images).to(embeds.dtype)
    return want


def test_unpatched_vllm_merges_with_a_broadcast_masked_scatter():
    embeds, ids, images = _inputs()
    out, ops = _merge(embeds.clone(), ids, images)
    assert any(op.startswith("masked_scatter") for op in ops), ops
    torch.testing.assert_close(out, _expected(embeds, ids, images))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patch_merges_with_index_put_and_the_same_result(dtype):
    reg = PatchRegistry([MULTIMODAL_MERGE_INDEX_PUT])
    reg.apply("worker", environ={})
    try:
        embeds, ids, images = _inputs(dtype)
        target = embeds.clone()
        out, ops = _merge(target, ids, images)
        assert out is target  # in place, like vLLM's
        assert not any(op.startswith("masked_scatter") for op in ops), ops
        assert any(op.startswith("index_put") for op in ops), ops
        torch.testing.assert_close(out, _expected(embeds, ids, images))
        # Too few or too many embeddings for the placeholders: vLLM's error, naming the counts.
        with pytest.raises(ValueError, match="Attempted to assign 3 \\+ 2 = 5 multimodal tokens to 4 placeholders"):
            _merge(embeds.clone(), torch.tensor([1, 7, 7, 7, 2, 7, 0, 3, 4]), images)
    finally:
        reg.revert()
    _, ops = _merge(*_inputs())
    assert any(op.startswith("masked_scatter") for op in ops), ops  # reverted: vLLM's merge again
