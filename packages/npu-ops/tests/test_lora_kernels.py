# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The LoRA shrink/expand kernel pairs against vLLM's ``vllm.lora.ops.torch_ops`` (the oracle), on random shapes.

vLLM's torch ops index the weight stack with the slot as given, so slot -1 ("no LoRA") reads the last slot. The
oracle is run on a stack with one extra all-zero slot at the end, which makes its -1 rows exactly "no delta" (the
contract of our kernels, which mask -1 rows instead). The NPU paths run here too: the decode ones are plain aten
ops; the prefill ones call ``torch_npu.npu_grouped_matmul``, replaced by a stand-in written from its docs
(``group_list_type=1`` counts, one 3-D weight, ``split_item=2``) that checks the arguments we rely on.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from vllm.lora.ops import torch_ops
from vllm_npu.ops.lora import kernels as k


def _fake_grouped_matmul(calls: list[int]) -> types.ModuleType:
    m = types.ModuleType("torch_npu")

    def npu_grouped_matmul(x, weight, *, group_list, split_item, group_type, group_list_type, **kw):
        assert len(x) == len(weight) == 1 and split_item == 2 and group_type == 0 and group_list_type == 1
        assert group_list.dtype == torch.int64 and int(group_list.sum()) == x[0].shape[0]
        assert 1 < group_list.shape[0] <= 1024, "count lists of length 1 or over 1024 groups are outside the docs"
        assert weight[0].dim() == 3 and weight[0].shape[0] == group_list.shape[0]
        calls.append(1)
        out, start = [], 0
        for g, n in enumerate(group_list.tolist()):  # one group at a time, as the docs describe it
            out.append(x[0][start : start + n] @ weight[0][g])
            start += n
        return [torch.cat(out) if out else x[0].new_empty(0, weight[0].shape[-1])]

    m.npu_grouped_matmul = npu_grouped_matmul
    return m


@pytest.fixture
def grouped_matmul_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_grouped_matmul(calls))
    return calls


def _padded(w: torch.Tensor) -> torch.Tensor:
    """The stack with a zero slot appended: vLLM's ops read slot -1 as that slot."""
    return torch.cat([w, torch.zeros_like(w[:1])])


def _segments(gen: torch.Generator, num_slots: int, num_segments: int, max_len: int, empty: bool):
    lens = torch.randint(0 if empty else 1, max_len + 1, (num_segments,), generator=gen)
    if empty:
        lens[0] = 0  # at least one empty segment
        if int(lens.sum()) == 0:
            lens[-1] = 1
    loras = torch.randint(-1, num_slots, (num_segments,), generator=gen)
    return lens.long(), loras.long()


CASES = [
    # slots, rank, in, out, segments, max segment length, empty segments
    (1, 8, 64, 48, 1, 1, False),  # a single token
    (3, 8, 64, 96, 4, 7, False),
    (4, 16, 32, 128, 6, 5, True),
    (2, 4, 80, 40, 3, 9, True),
]


@pytest.mark.parametrize("backend", ["reference", "npu"])
@pytest.mark.parametrize("case", CASES)
def test_shrink_matches_vllm_torch_ops(case, backend: str, grouped_matmul_calls: list[int]) -> None:
    slots, r, h_in, _, nseg, max_len, empty = case
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    lens, loras = _segments(gen, slots, nseg, max_len, empty)
    t = int(lens.sum())
    x = torch.randn(t, h_in, generator=gen)
    w = torch.randn(slots, 1, r, h_in, generator=gen)
    token_loras = torch.repeat_interleave(loras, lens)
    scale = 0.5

    expect = torch.full((t, r), 7.0)
    torch_ops.bgmv_shrink(x, _padded(w), expect, token_loras, scale)

    sgmv = k.SGMV_SHRINK.select(backend)
    got = torch.full((t, r), 7.0)
    sgmv(x, w, got, lens, loras, scale)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    if backend == "npu":
        # one segment is a plain matmul (a count list of length 1 is outside the op's contract)
        assert bool(grouped_matmul_calls) == (nseg > 1)

    # vLLM's segmented op on the same segments agrees too
    via_sgmv = torch.zeros(t, r)
    torch_ops.sgmv_shrink(x, _padded(w), via_sgmv, None, lens, loras, len(lens), max_len, t, scale)
    torch.testing.assert_close(got, via_sgmv, rtol=1e-5, atol=1e-5)

    got_b = torch.full((t, r), 7.0)
    k.BGMV_SHRINK.select(backend)(x, w, got_b, token_loras, scale)
    torch.testing.assert_close(got_b, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "npu"])
@pytest.mark.parametrize("add_inputs", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_expand_slice_matches_vllm_torch_ops(case, add_inputs: bool, backend: str, grouped_matmul_calls) -> None:
    slots, r, _, h_out, nseg, max_len, empty = case
    gen = torch.Generator().manual_seed(hash(case) % 2**31 + 1)
    lens, loras = _segments(gen, slots, nseg, max_len, empty)
    t = int(lens.sum())
    x = torch.randn(t, r, generator=gen)
    w = torch.randn(slots, 1, h_out, r, generator=gen)
    token_loras = torch.repeat_interleave(loras, lens)
    offset, width = 5, h_out + 11
    y0 = torch.randn(t, width, generator=gen)

    expect = y0.clone()
    torch_ops.bgmv_expand_slice(x, _padded(w), expect, token_loras, offset, h_out, add_inputs)

    got = y0.clone()
    k.SGMV_EXPAND.select(backend)(x, w, got, lens, loras, offset, h_out, add_inputs)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)

    via_sgmv = y0.clone()
    torch_ops.sgmv_expand_slice(
        x, _padded(w), via_sgmv, None, lens, loras, len(lens), max_len, t, offset, h_out, add_inputs
    )
    torch.testing.assert_close(got, via_sgmv, rtol=1e-5, atol=1e-5)

    got_b = y0.clone()
    k.BGMV_EXPAND.select(backend)(x, w, got_b, token_loras, offset, h_out, add_inputs)
    torch.testing.assert_close(got_b, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "npu"])
def test_expand_full_width_matches_bgmv_expand(backend: str) -> None:
    """The embedding/logits form: offset 0 over the whole output (vLLM's ``bgmv_expand``)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 8, generator=gen)
    w = torch.randn(3, 1, 32, 8, generator=gen)
    idx = torch.tensor([2, -1, 0, 0, 1])
    y0 = torch.randn(5, 32, generator=gen)
    expect = y0.clone()
    torch_ops.bgmv_expand(x, _padded(w), expect, idx, add_inputs=True)
    got = y0.clone()
    k.BGMV_EXPAND.select(backend)(x, w, got, idx, 0, 32, True)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("add_inputs", [True, False])
def test_more_segments_than_the_grouped_matmul_takes_use_the_gather_path(
    add_inputs: bool, grouped_matmul_calls
) -> None:
    gen = torch.Generator().manual_seed(9)
    lens = torch.ones(k.MAX_GROUPS + 3, dtype=torch.long)
    loras = torch.randint(-1, 3, (lens.shape[0],), generator=gen)
    x, w = torch.randn(lens.shape[0], 16, generator=gen), torch.randn(3, 1, 4, 16, generator=gen)
    got, expect = torch.zeros(lens.shape[0], 4), torch.zeros(lens.shape[0], 4)
    k.sgmv_shrink_npu(x, w, got, lens, loras, 1.0)
    k.sgmv_shrink_reference(x, w, expect, lens, loras, 1.0)
    torch.testing.assert_close(got, expect)
    wb, y0 = torch.randn(3, 1, 8, 4, generator=gen), torch.randn(lens.shape[0], 8, generator=gen)
    got_e, expect_e = y0.clone(), y0.clone()
    k.sgmv_expand_npu(got, wb, got_e, lens, loras, 0, 8, add_inputs)
    k.sgmv_expand_reference(got, wb, expect_e, lens, loras, 0, 8, add_inputs)
    torch.testing.assert_close(got_e, expect_e)
    assert not grouped_matmul_calls


def test_no_lora_rows_get_no_delta_even_with_every_slot_in_use() -> None:
    """Slot -1 never reads a real adapter's weight (vLLM's torch ops would read the last slot)."""
    w_a = torch.randn(2, 1, 4, 16)
    x = torch.randn(3, 16)
    idx = torch.tensor([0, -1, 1])
    for backend in ("reference", "npu"):
        y = torch.full((3, 4), 9.0)
        k.BGMV_SHRINK.select(backend)(x, w_a, y, idx, 1.0)
        assert torch.equal(y[1], torch.zeros(4))
        torch.testing.assert_close(y[2], w_a[1, 0] @ x[2])


def test_fp16_computes_in_weight_dtype_and_writes_buffer_dtype() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 32, generator=gen).half()
    w = torch.randn(2, 1, 8, 32, generator=gen).half()
    idx = torch.tensor([0, 1, 1, -1])
    y = torch.zeros(4, 8, dtype=torch.float32)
    k.BGMV_SHRINK.select("npu")(x, w, y, idx, 2.0)
    ref = torch.zeros(4, 8, dtype=torch.float32)
    k.BGMV_SHRINK.select("reference")(x, w, ref, idx, 2.0)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-3, atol=1e-3)


def test_mapping_length_mismatch_is_a_clear_error() -> None:
    x, y = torch.randn(3, 8), torch.zeros(3, 4)
    with pytest.raises(ValueError, match="the LoRA mapping 4"):
        k.sgmv_shrink_reference(x, torch.randn(1, 1, 4, 8), y, torch.tensor([4]), torch.tensor([0]), 1.0)
