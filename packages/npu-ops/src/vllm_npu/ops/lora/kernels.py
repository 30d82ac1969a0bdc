# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Punica shrink/expand kernels for multi-LoRA: each an NPU path and a pure-PyTorch reference twin.

Shapes (``L`` = LoRA slots, ``T`` = tokens, ``r`` = max LoRA rank, ``S`` = segments)::

    shrink: x [T, in], w [L, 1, r, in] (or [L, r, in]), y [T, >= r] float32
            y[t, :r] = scale * x[t] @ w[lora(t)]^T             (in place; 0 where lora(t) == -1)
    expand: x [T, r], w [L, 1, n, r] (or [L, n, r]), y [T, >= offset + size]
            y[t, offset:offset+size] (+)= x[t] @ w[lora(t)][:size]^T   (add_inputs; nothing added where lora(t) == -1)

``lora(t)`` comes from a per-token index tensor ``[T]`` (decode, "bgmv": a batched gather of one weight per
token) or from segments (prefill, "sgmv": ``seg_lens [S]`` int64 summing to ``T`` and ``seg_loras [S]``, one slot
per run of consecutive tokens; empty segments are allowed). Slot ``-1`` means "no LoRA": its rows get no delta.
vLLM's own torch ops index ``w[-1]`` (the last slot) there, which is another adapter's weight once every slot is
in use; these kernels mask instead.

Compute dtype: the weights' (``x`` is cast to ``w.dtype``), the result is cast to ``y.dtype``.

NPU paths: prefill runs one ``torch_npu.npu_grouped_matmul`` over the segments (the MoE experts' grouped matmul,
:func:`vllm_npu.ops.moe.experts.grouped_matmul_npu`, with the segments' weights gathered by ``index_select``);
decode gathers one weight per token (``index_select``) and runs ``torch.bmm``; masking is ``masked_fill_``. All but
the grouped matmul are aten ops that torch_npu serves on the NPU. Neither path synchronises with the host.
torch_npu 2.8.0 documents two limits of the grouped matmul in count mode (``group_list_type=1``): the count list
may not have length 1, and at most 1024 groups. One segment is therefore a plain ``torch.matmul``, and more than
1024 segments take the per-token gather path.
"""

from __future__ import annotations

import torch
from vllm_npu.interface import Kernel

from ..moe.experts import grouped_matmul_npu


def _slots(w: torch.Tensor) -> torch.Tensor:
    """vLLM's stacked LoRA weights ``[L, 1, a, b]`` as ``[L, a, b]``."""
    return w.squeeze(1) if w.dim() == 4 else w


def _check_rows(x: torch.Tensor, y: torch.Tensor, n: int, what: str) -> None:
    if x.shape[0] != y.shape[0] or x.shape[0] != n:
        raise ValueError(f"{what}: x has {x.shape[0]} rows, y {y.shape[0]}, the LoRA mapping {n}; they must agree")


#: npu_grouped_matmul's documented maximum number of groups (one 3-D weight, groups along M).
MAX_GROUPS = 1024


def _grouped(x: torch.Tensor, weights: torch.Tensor, seg_lens: torch.Tensor) -> torch.Tensor:
    """``x [T, k]`` times ``weights [S, k, n]`` per segment; one segment is a plain matmul (count lists of length 1
    are outside npu_grouped_matmul's contract)."""
    if weights.shape[0] == 1:
        return x @ weights[0]
    return grouped_matmul_npu(x, weights, seg_lens)


def _token_mask(seg_lens: torch.Tensor, seg_loras: torch.Tensor, num_tokens: int) -> torch.Tensor:
    # output_size keeps repeat_interleave from reading the total back to the host
    return torch.repeat_interleave(seg_loras >= 0, seg_lens, output_size=num_tokens).unsqueeze(-1)


# --- shrink -----------------------------------------------------------------------------------------------------


def sgmv_shrink_npu(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, seg_lens: torch.Tensor, seg_loras: torch.Tensor, scale: float
) -> None:
    """Prefill shrink: one grouped matmul over the segments (each segment's ``A^T`` gathered once)."""
    if seg_lens.shape[0] > MAX_GROUPS:
        tokens = torch.repeat_interleave(seg_loras, seg_lens, output_size=x.shape[0])
        return bgmv_shrink_npu(x, w, y, tokens, scale)
    w3 = _slots(w)
    r = w3.shape[1]
    weights = w3.index_select(0, seg_loras.clamp(min=0)).transpose(1, 2)  # [S, in, r]
    out = _grouped(x.to(w3.dtype), weights, seg_lens)
    out = out.masked_fill_(~_token_mask(seg_lens, seg_loras, x.shape[0]), 0)
    y[:, :r].copy_(out.mul_(scale))


def bgmv_shrink_npu(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, token_loras: torch.Tensor, scale: float) -> None:
    """Decode shrink: one ``A`` gathered per token, one batched matmul."""
    w3 = _slots(w)
    r = w3.shape[1]
    weights = w3.index_select(0, token_loras.clamp(min=0))  # [T, r, in]
    out = torch.bmm(weights, x.to(w3.dtype).unsqueeze(-1)).squeeze(-1)
    out = out.masked_fill_((token_loras < 0).unsqueeze(-1), 0)
    y[:, :r].copy_(out.mul_(scale))


def _shrink_rows_reference(
    x: torch.Tensor, w3: torch.Tensor, y: torch.Tensor, rows: torch.Tensor | slice, slot: int, scale: float
) -> None:
    r = w3.shape[1]
    y[rows, :r] = (scale * (x[rows].to(w3.dtype) @ w3[slot].t())).to(y.dtype) if slot >= 0 else 0


def sgmv_shrink_reference(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, seg_lens: torch.Tensor, seg_loras: torch.Tensor, scale: float
) -> None:
    """Reference twin of :func:`sgmv_shrink_npu`: a loop over the segments."""
    w3 = _slots(w)
    lens, slots = seg_lens.tolist(), seg_loras.tolist()
    _check_rows(x, y, sum(lens), "sgmv_shrink")
    start = 0
    for n, slot in zip(lens, slots):
        if n:
            _shrink_rows_reference(x, w3, y, slice(start, start + n), slot, scale)
        start += n


def bgmv_shrink_reference(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, token_loras: torch.Tensor, scale: float
) -> None:
    """Reference twin of :func:`bgmv_shrink_npu`: a loop over the slots in use."""
    w3 = _slots(w)
    _check_rows(x, y, token_loras.shape[0], "bgmv_shrink")
    for slot in torch.unique(token_loras).tolist():
        _shrink_rows_reference(x, w3, y, token_loras == slot, slot, scale)


# --- expand -----------------------------------------------------------------------------------------------------


def _add_or_set(y: torch.Tensor, out: torch.Tensor, offset: int, add_inputs: bool) -> None:
    dst = y[:, offset : offset + out.shape[1]]
    if add_inputs:
        dst.add_(out.to(y.dtype))
    else:
        dst.copy_(out)


def sgmv_expand_npu(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_loras: torch.Tensor,
    offset: int,
    size: int,
    add_inputs: bool,
) -> None:
    """Prefill expand: one grouped matmul over the segments into ``y[:, offset:offset+size]``."""
    if seg_lens.shape[0] > MAX_GROUPS:
        tokens = torch.repeat_interleave(seg_loras, seg_lens, output_size=x.shape[0])
        return bgmv_expand_npu(x, w, y, tokens, offset, size, add_inputs)
    w3 = _slots(w)[:, :size]
    weights = w3.index_select(0, seg_loras.clamp(min=0)).transpose(1, 2)  # [S, r, size]
    out = _grouped(x[:, : w3.shape[2]].to(w3.dtype), weights, seg_lens)
    out = out.masked_fill_(~_token_mask(seg_lens, seg_loras, x.shape[0]), 0)
    _add_or_set(y, out, offset, add_inputs)


def bgmv_expand_npu(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    token_loras: torch.Tensor,
    offset: int,
    size: int,
    add_inputs: bool,
) -> None:
    """Decode expand: one ``B`` gathered per token, one batched matmul."""
    w3 = _slots(w)[:, :size]
    weights = w3.index_select(0, token_loras.clamp(min=0))  # [T, size, r]
    out = torch.bmm(weights, x[:, : w3.shape[2]].to(w3.dtype).unsqueeze(-1)).squeeze(-1)
    out = out.masked_fill_((token_loras < 0).unsqueeze(-1), 0)
    _add_or_set(y, out, offset, add_inputs)


def _expand_rows_reference(
    x: torch.Tensor,
    w3: torch.Tensor,
    y: torch.Tensor,
    rows: torch.Tensor | slice,
    slot: int,
    offset: int,
    add_inputs: bool,
) -> None:
    size = w3.shape[1]
    if slot < 0:
        if not add_inputs:
            y[rows, offset : offset + size] = 0
        return
    delta = (x[rows, : w3.shape[2]].to(w3.dtype) @ w3[slot].t()).to(y.dtype)
    if add_inputs:
        y[rows, offset : offset + size] += delta
    else:
        y[rows, offset : offset + size] = delta


def sgmv_expand_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_loras: torch.Tensor,
    offset: int,
    size: int,
    add_inputs: bool,
) -> None:
    """Reference twin of :func:`sgmv_expand_npu`: a loop over the segments."""
    w3 = _slots(w)[:, :size]
    lens, slots = seg_lens.tolist(), seg_loras.tolist()
    _check_rows(x, y, sum(lens), "sgmv_expand")
    start = 0
    for n, slot in zip(lens, slots):
        if n:
            _expand_rows_reference(x, w3, y, slice(start, start + n), slot, offset, add_inputs)
        start += n


def bgmv_expand_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    token_loras: torch.Tensor,
    offset: int,
    size: int,
    add_inputs: bool,
) -> None:
    """Reference twin of :func:`bgmv_expand_npu`: a loop over the slots in use."""
    w3 = _slots(w)[:, :size]
    _check_rows(x, y, token_loras.shape[0], "bgmv_expand")
    for slot in torch.unique(token_loras).tolist():
        _expand_rows_reference(x, w3, y, token_loras == slot, slot, offset, add_inputs)


SGMV_SHRINK = Kernel("lora_sgmv_shrink", npu=sgmv_shrink_npu, reference=sgmv_shrink_reference)
BGMV_SHRINK = Kernel("lora_bgmv_shrink", npu=bgmv_shrink_npu, reference=bgmv_shrink_reference)
SGMV_EXPAND = Kernel("lora_sgmv_expand", npu=sgmv_expand_npu, reference=sgmv_expand_reference)
BGMV_EXPAND = Kernel("lora_bgmv_expand", npu=bgmv_expand_npu, reference=bgmv_expand_reference)
