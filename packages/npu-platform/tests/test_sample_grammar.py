# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The kernel pair GRAMMAR_BITMASK: its NPU side (the bitmask unpacked and applied on the logits' device) equals the
reference twin (xgrammar's CPU kernel) exactly, for every logits dtype and row layout, never moves the logits to the
host, and falls back to the twin per request when it fails; the runner's ordering through either side equals vLLM's
own float32 path."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from vllm_npu.platform.sample import GRAMMAR_BITMASK, apply_grammar_bitmask
from vllm_npu.platform.sample.grammar import grammar_mask_npu, grammar_mask_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bitmask(rows: int, words: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)


def test_the_pair_selects_the_device_side_on_the_npu_and_xgrammar_otherwise():
    assert GRAMMAR_BITMASK.select("npu") is grammar_mask_npu
    assert GRAMMAR_BITMASK.select("reference") is grammar_mask_reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "rows"),
    [(6, [0, 1, 2, 3, 4, 5]), (6, [1, 2, 3, 5]), (6, [4, 0]), (1, [0])],
    ids=["all", "some", "unordered", "one"],
)
@pytest.mark.parametrize("vocab", [100, 151936])
def test_npu_side_equals_xgrammar_exactly(dtype, n, rows, vocab):
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(1)).to(dtype)
    bitmask = _bitmask(len(rows), (vocab + 31) // 32)
    bitmask[0, 0] = -(2**31)  # only bit 31 (the sign bit) allowed in the first word
    got, want = logits.clone(), logits.clone()
    grammar_mask_npu(got, rows, bitmask)
    grammar_mask_reference(want, rows, bitmask)
    assert torch.equal(got, want)
    assert got.dtype == dtype and torch.isinf(got[rows]).any()
    untouched = [i for i in range(n) if i not in rows]
    assert torch.equal(got[untouched], logits[untouched])
    assert torch.isinf(got[rows[0], :31]).all() and got[rows[0], 31] == logits[rows[0], 31]


@pytest.mark.parametrize("mask", [grammar_mask_npu, grammar_mask_reference], ids=["npu", "reference"])
def test_a_bitmask_narrower_than_the_vocabulary_masks_its_words_only(mask):
    # xgrammar's rule: vocab_size = min(logits.shape[-1], 32 * words); the columns beyond stay as they were.
    logits = torch.randn(2, 100)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    out = logits.clone()
    mask(out, [0, 1], bitmask)
    assert torch.isinf(out[:, :64]).all() and torch.equal(out[:, 64:], logits[:, 64:])


def test_npu_side_never_reads_the_logits_on_the_host():
    # Meta tensors have no data: any .item() / .tolist() / .cpu() of a device value, or a copy of the logits to the
    # host, raises. Only the bitmask (host int32) and the row indices go to the device.
    logits = torch.empty(6, 151936, dtype=torch.bfloat16, device="meta")
    grammar_mask_npu(logits, [1, 2, 5], _bitmask(3, 4748))
    grammar_mask_npu(logits, list(range(6)), _bitmask(6, 4748))


# --- apply_grammar_bitmask: the scheduler's compacted bitmask ordered to the logit rows ---------------------------

VOCAB = 100
WORDS = (VOCAB + 31) // 32


def _step(structured: dict[str, int], spec: dict[str, list[int]]) -> tuple[Any, np.ndarray]:
    rows = sum(1 + len(spec.get(r, [])) for r in structured)
    bitmask = np.random.default_rng(3).integers(-(2**31), 2**31 - 1, size=(rows, WORDS), dtype=np.int32)
    return SimpleNamespace(structured_output_request_ids=structured, scheduled_spec_decode_tokens=spec), bitmask


def _vllm_float32(step: Any, bitmask: np.ndarray, batch: dict[str, int], logits: torch.Tensor) -> torch.Tensor:
    from vllm.v1.structured_output.utils import apply_grammar_bitmask as vllm_apply

    ref = logits.float().clone()
    vllm_apply(
        SimpleNamespace(**vars(step), grammar_bitmask=bitmask), SimpleNamespace(req_id_to_index=batch), ref, "cpu"
    )
    return ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", [grammar_mask_npu, grammar_mask_reference], ids=["npu", "reference"])
def test_apply_with_draft_rows_equals_vllm_float32(mask, dtype):
    # Batch order a, b, c, d; d and b structured (bitmask order d, b); b has 1 draft token, c 2: logit rows
    # a=0, b=1-2, c=3-5, d=6.
    batch = {"a": 0, "b": 1, "c": 2, "d": 3}
    step, bitmask = _step({"d": 0, "b": 1}, {"c": [5, 6], "b": [7]})
    logits = torch.randn(7, VOCAB).to(dtype)
    expected = _vllm_float32(step, bitmask, batch, logits)
    before = logits.clone()
    assert apply_grammar_bitmask(step, bitmask, batch, logits, mask) == {}
    assert torch.equal(torch.isinf(logits), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    assert torch.equal(logits[finite], before[finite])
    assert not torch.isinf(logits[[0, 3, 4, 5]]).any()


def test_a_failing_device_side_falls_back_to_the_reference_per_request():
    def broken(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        raise RuntimeError("op not supported for int32 on this device")

    batch = {"a": 0, "b": 1}
    step, bitmask = _step({"a": 0, "b": 1}, {})
    logits = torch.randn(2, VOCAB, dtype=torch.bfloat16)
    expected = _vllm_float32(step, bitmask, batch, logits)
    assert apply_grammar_bitmask(step, bitmask, batch, logits, broken) == {}
    assert torch.equal(torch.isinf(logits), torch.isinf(expected))


def test_under_async_scheduling_every_structured_request_fails_with_the_reason():
    from vllm_npu.platform.sample.grammar import ASYNC_SCHEDULING_ERROR, async_scheduling_faults

    step, _ = _step({"d": 0, "b": 1, "gone": 2}, {"b": [7]})
    faults = async_scheduling_faults(step, {"a": 0, "b": 1, "c": 2, "d": 3})
    assert faults == {"d": ASYNC_SCHEDULING_ERROR, "b": ASYNC_SCHEDULING_ERROR}
    assert "--async-scheduling" in ASYNC_SCHEDULING_ERROR and "vllm-project/vllm#26866" in ASYNC_SCHEDULING_ERROR
