# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The reference KV-cache write: real slots written exactly, padding slots (-1) anywhere write nothing, no host sync."""

from __future__ import annotations

import pytest
import torch
from vllm_npu.attention.ops.kv_cache import reshape_and_cache_reference

NB, BS, NKV, D = 4, 8, 2, 16


def _run(slots: list[int], dtype: torch.dtype = torch.float32) -> None:
    g = torch.Generator().manual_seed(len(slots))
    t = len(slots)
    key = torch.randn(t, NKV, D, generator=g)
    value = torch.randn(t, NKV, D, generator=g)
    key_cache = torch.randn(NB, BS, NKV, D, generator=g).to(dtype)
    value_cache = torch.randn(NB, BS, NKV, D, generator=g).to(dtype)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_reference(key, value, key_cache, value_cache, torch.tensor(slots, dtype=torch.int32))
    expect_k, expect_v = before_k.view(-1, NKV, D).clone(), before_v.view(-1, NKV, D).clone()
    for row, slot in enumerate(slots):
        if slot >= 0:
            expect_k[slot] = key[row].to(dtype)
            expect_v[slot] = value[row].to(dtype)
    assert torch.equal(key_cache.view(-1, NKV, D), expect_k)
    assert torch.equal(value_cache.view(-1, NKV, D), expect_v)


@pytest.mark.parametrize(
    "slots",
    [
        [5, 0, 31, 9],  # no padding
        [5, 9, -1, -1],  # trailing padding (vLLM's layout)
        [-1, 0, -1, 17, -1],  # interleaved padding, a real token in slot 0
        [-1, -1, -1],  # nothing real: the cache must not change at all
        [0],
        [],
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_write_skips_padding(slots: list[int], dtype: torch.dtype) -> None:
    _run(slots, dtype)


def test_reference_write_preserves_nan_in_anchor_slot() -> None:
    # With no real row, slot 0 is rewritten with its own bits: a NaN there must survive unchanged (bit-exact copy).
    key_cache = torch.zeros(NB, BS, NKV, D)
    key_cache[0, 0] = float("nan")
    value_cache = torch.zeros(NB, BS, NKV, D)
    reshape_and_cache_reference(
        torch.ones(2, NKV, D), torch.ones(2, NKV, D), key_cache, value_cache, torch.tensor([-1, -1])
    )
    assert torch.isnan(key_cache[0, 0]).all() and key_cache.view(-1)[NKV * D :].eq(0).all()
    assert value_cache.eq(0).all()


def test_reference_write_never_reads_device_values_on_host(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*_a: object, **_k: object) -> None:
        raise AssertionError("host sync in the reference KV write")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "nonzero", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    key_cache, value_cache = torch.zeros(NB, BS, NKV, D), torch.zeros(NB, BS, NKV, D)
    reshape_and_cache_reference(
        torch.ones(3, NKV, D), torch.ones(3, NKV, D), key_cache, value_cache, torch.tensor([4, -1, 7])
    )
    monkeypatch.undo()
    assert key_cache.view(-1, NKV, D)[[4, 7]].eq(1).all() and key_cache.sum() == 2 * NKV * D
