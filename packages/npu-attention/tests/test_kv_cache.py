# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The reference KV-cache write: real slots written exactly; padding redirected by the builder to the null block.

The lean twin (one ``index_copy_`` per cache) is pinned bit-for-bit to the previous twin, kept here as the oracle
(``_skip_padding_oracle``: the NPU kernel's "negative slots skipped" semantics, written without a host sync): on every
slot outside the null block 0 the two caches are identical, for the slot mappings vLLM makes and the builder's
redirect of them.
"""

from __future__ import annotations

import pytest
import torch
from vllm_npu.attention.ops.kv_cache import reshape_and_cache_reference
from vllm_npu.interface import KernelContractError

NB, BS, NKV, D = 4, 8, 2, 16


def _skip_padding_oracle(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The previous reference twin (until the lean rewrite): every negative slot skipped, wherever it is."""
    nkv, d = key_cache.shape[-2:]
    slots = slot_mapping.long()
    if slots.numel() == 0:
        return
    keep = slots >= 0
    anchor = keep.to(torch.uint8).argmax(dim=0, keepdim=True)
    anchor_is_real = keep.index_select(0, anchor)
    anchor_slot = slots.index_select(0, anchor).clamp_min(0)
    idx = torch.where(keep, slots, anchor_slot)
    row_keep = keep.view(-1, 1, 1)
    for src, cache in ((key, key_cache), (value, value_cache)):
        flat = cache.view(-1, nkv, d)
        src = src.to(cache.dtype)
        anchor_row = torch.where(
            anchor_is_real.view(1, 1, 1), src.index_select(0, anchor), flat.index_select(0, anchor_slot)
        )
        flat.index_copy_(0, idx, torch.where(row_keep, src, anchor_row))


def _inputs(t: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(t, NKV, D, generator=g)
    value = torch.randn(t, NKV, D, generator=g)
    key_cache = torch.randn(NB, BS, NKV, D, generator=g).to(dtype)
    value_cache = torch.randn(NB, BS, NKV, D, generator=g).to(dtype)
    return key, value, key_cache, value_cache


@pytest.mark.parametrize("slots", [[5, 0, 31, 9], [8, 9, 10], [0], [31, 30, 16, 17, 24]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_reference_write_is_exact(slots: list[int], dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    key, value, key_cache, value_cache = _inputs(len(slots), dtype, len(slots))
    expect_k, expect_v = key_cache.view(-1, NKV, D).clone(), value_cache.view(-1, NKV, D).clone()
    for row, slot in enumerate(slots):
        expect_k[slot] = key[row].to(dtype)
        expect_v[slot] = value[row].to(dtype)
    reshape_and_cache_reference(key, value, key_cache, value_cache, torch.tensor(slots, dtype=slot_dtype))
    assert torch.equal(key_cache.view(-1, NKV, D), expect_k)
    assert torch.equal(value_cache.view(-1, NKV, D), expect_v)


@pytest.mark.parametrize(
    "slots",
    [
        [5, 0, 31, 9],  # no padding (a real token may sit in slot 0 only in these unit inputs, never in vLLM)
        [13, 9, -1, -1],  # trailing padding (vLLM's layout; padded rows reach the kernel inside captured graphs)
        [-1, 12, -1, 17, -1],  # interleaved padding
        [-1, -1, -1],  # nothing real
        [],
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_write_matches_previous_twin_outside_null_block(slots: list[int], dtype: torch.dtype) -> None:
    key, value, key_cache, value_cache = _inputs(len(slots), dtype, 7 + len(slots))
    old_k, old_v = key_cache.clone(), value_cache.clone()
    _skip_padding_oracle(key, value, old_k, old_v, torch.tensor(slots, dtype=torch.int32))
    # what the GQA builder hands the reference twin: every negative slot redirected to slot 0 (null block 0)
    redirected = torch.tensor(slots, dtype=torch.long).clamp(min=0)
    reshape_and_cache_reference(key, value, key_cache, value_cache, redirected)
    if -1 not in slots:
        assert torch.equal(key_cache, old_k) and torch.equal(value_cache, old_v)
    assert torch.equal(key_cache[1:], old_k[1:]) and torch.equal(value_cache[1:], old_v[1:])
    assert torch.equal(key_cache[0, 1:], old_k[0, 1:]) and torch.equal(value_cache[0, 1:], old_v[0, 1:])


def test_negative_slot_is_a_contract_error() -> None:
    key, value, key_cache, value_cache = _inputs(2, torch.float32, 0)
    with pytest.raises(KernelContractError, match="null block"):
        reshape_and_cache_reference(key, value, key_cache, value_cache, torch.tensor([4, -1]))


def test_reference_write_never_reads_device_values_on_host(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*_a: object, **_k: object) -> None:
        raise AssertionError("host sync in the reference KV write")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "nonzero", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    key_cache, value_cache = torch.zeros(NB, BS, NKV, D), torch.zeros(NB, BS, NKV, D)
    reshape_and_cache_reference(
        torch.ones(3, NKV, D), torch.ones(3, NKV, D), key_cache, value_cache, torch.tensor([4, 0, 7])
    )
    monkeypatch.undo()
    assert key_cache.view(-1, NKV, D)[[0, 4, 7]].eq(1).all() and key_cache.sum() == 3 * NKV * D
