# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The decode kernels of a *compiled* decode graph (the torchair mode): every per-step input is a graph input.

Inside ``torch.compile(fullgraph=True)`` nothing may be read on the host per step: a Python int or list the trace
reads is baked into the graph and guarded on (a recompile whenever it changes), and ``.item()`` / ``.tolist()`` on a
tensor breaks the graph (torchair has no GE converter for ``aten._local_scalar_dense``). These twins therefore take
the step's metadata as fixed-shape device tensors of the padded batch ``B`` (:class:`~..metadata.GraphDecodeInputs`)
and derive everything else from shapes. Both are what vllm-ascend v0.11.0's torchair GQA path runs on hardware
(``vllm_ascend/torchair/torchair_attention.py``: ``npu_scatter_nd_update_`` for the KV write, BSH
``npu_fused_infer_attention_score`` for the decode), ops torchair ships GE converters for.

``graph_kv_write`` — the step's K/V into the paged cache; returns the lengths the decode must read after it:
    key ``[B, Nkv, Dk]``, value ``[B, Nkv, Dv]``; key_cache ``[num_blocks, block_size, Nkv, Dk]``, value_cache
    ``[num_blocks, block_size, Nkv, Dv]``, updated in place (GQA: K and V, ``Dk = Dv``; MLA: the latent ``kv_c``
    and the rotated ``k_pe`` into the nope and rope planes, ``Nkv = 1``, ``Dk = L``, ``Dv = R``);
    slots ``[B]`` int64, every entry in ``[0, num_blocks * block_size)`` (padding rows point at slot 0 of vLLM's
    null block 0, which no request reads: ``npu_scatter_nd_update_`` does not accept out-of-range indices);
    seq_lens ``[B]``: returned (NPU) or returned as a copy (reference), so that the decode depends on the write.
    NPU: ``torch_npu.npu_scatter_nd_update_(cache, indices, updates)`` with ``indices [B, 2] = (slot // block_size,
    slot % block_size)``; a declared in-place op, so the compiler keeps it before the decode that reads the cache.
    Reference: the registered op ``torch.ops.vllm_npu.graph_kv_write`` (``index_copy_`` on the flat
    ``[num_blocks * block_size, Nkv, D]`` views), opaque to Dynamo and declared *without* mutated arguments, as vLLM
    declares its own attention op, which writes the KV cache too: functionalizing an in-place write on the cache (a
    graph input) would copy the whole cache on every step (measured: 0.3 ms -> 230 ms per step for a 160 MB cache on
    this host), where GE writes in place. The returned copy of ``seq_lens`` is what orders the decode after it (the
    graph runs its nodes in trace order; the op is never dead code).

``graph_decode`` — one query token per request over its pages:
    query ``[B, N, D]``; caches as above (this step's tokens already written); block_table ``[B, W]`` int32 (W the
    table's full width; padding rows all 0); seq_lens ``[B]`` int32 on the device (tokens in the cache including the
    new one; padding rows :data:`~..metadata.GRAPH_PAD_SEQ_LEN`); seq_lens_list the same values as a host list,
    the ``SymInt[]`` the NPU kernel takes (under torchair's dynamic ints a graph input; the reference never reads
    it); out ``[B, N, D]`` written in full. ``out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b`` over the
    request's ``seq_lens[b]`` tokens (with ``sliding_window = W_s``: the last ``W_s`` of them).
    NPU: ``torch_npu.npu_fused_infer_attention_score`` in BSH with Q_S = 1, ``actual_seq_lengths_kv=seq_lens_list``,
    ``sparse_mode=0`` (a sliding window as an explicit mask ``[B, 1, W * block_size]`` made in the graph from
    ``seq_lens``: with Q_S = 1 the kernel ignores ``pre_tokens``). Reference: every one of the W pages gathered
    (a static shape), positions ``>= seq_lens[b]`` masked.

``mla_graph_decode`` — MLA's absorbed decode, one query token per request over its latent pages (returns it):
    ql_nope ``[B, N, L]`` (q_nope already multiplied by ``W_UK``), q_pe ``[B, N, R]``; nope_cache / rope_cache
    ``[num_blocks, block_size, 1, L|R]`` (this step's latents already written); block_table, seq_lens and
    seq_lens_list as for ``graph_decode``. Returns ``[B, N, L]``: ``softmax(scale * (ql_nope . kv_c + q_pe . k_pe))
    @ kv_c`` over the request's ``seq_lens[b]`` cached tokens (the caller applies ``W_UV``).
    NPU: ``torch_npu.npu_fused_infer_attention_score`` (the functional op: its GE converter is registered for
    ``.default``, not ``.out``) in its MLA mode, as vllm-ascend v0.11.0's torchair MLA decode calls it
    (``vllm_ascend/torchair/torchair_mla.py``, ``_forward_decode`` in graph mode): BNSD with ``Q_S = 1`` (query
    ``[B, N, 1, L]``, ``query_rope [B, N, 1, R]``, caches viewed ``[num_blocks, 1, block_size, L|R]``, the latent
    plane as key and value), ``key_rope`` = the rope plane, one KV head, ``sparse_mode=0``, no mask,
    ``actual_seq_lengths_kv=seq_lens_list``. Reference: every one of the W pages gathered, positions
    ``>= seq_lens[b]`` masked (:func:`~.mla_attention.latent_attention`, float32 softmax).
"""

from __future__ import annotations

from typing import cast

import torch
from vllm_npu.interface import Kernel, opaque_reference_op

from ._checks import check_heads, no_soft_cap
from ._reference import attend
from .fia import fia, gqa_paged_bsh
from .mla_attention import latent_attention, latent_decode_args


def graph_kv_write_npu(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    import torch_npu

    block_size = key_cache.shape[1]
    slot = slots.view(-1, 1)
    indices = torch.cat((slot // block_size, slot % block_size), dim=1)
    torch_npu.npu_scatter_nd_update_(key_cache, indices, key)
    torch_npu.npu_scatter_nd_update_(value_cache, indices, value)
    return seq_lens


def _write_in_place(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    # Each cache by its own row shape: MLA's latent and rope planes differ in width.
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value.to(value_cache.dtype))
    return seq_lens.clone()


_REFERENCE_WRITE = opaque_reference_op(
    "graph_kv_write",
    _write_in_place,
    lambda key, value, key_cache, value_cache, slots, seq_lens: torch.empty_like(seq_lens),
)


def graph_kv_write_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    return cast(torch.Tensor, _REFERENCE_WRITE(key, value, key_cache, value_cache, slots, seq_lens))


GRAPH_KV_WRITE = Kernel("graph_kv_write", npu=graph_kv_write_npu, reference=graph_kv_write_reference)


def _window_hidden(seq_lens: torch.Tensor, positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """``[B, S]`` True where a cache position is not visible: past the request's length, or before its window."""
    lens = seq_lens.to(torch.long)[:, None]
    hidden = positions[None, :] >= lens
    if sliding_window is not None:
        hidden = hidden | (positions[None, :] < lens - sliding_window)
    return hidden


def graph_decode_npu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_list: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    no_soft_cap(logits_soft_cap, "graph_decode")
    mask = None
    if sliding_window is not None:
        positions = torch.arange(block_table.shape[1] * key_cache.shape[1], device=query.device)
        mask = _window_hidden(seq_lens, positions, sliding_window).unsqueeze(1)
    args = gqa_paged_bsh(
        query, key_cache, value_cache, block_table, seq_lens_list, mask,
        num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale,
    )  # fmt: skip
    out.copy_(fia(args).view_as(out))


def graph_decode_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_list: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    check_heads(query, key_cache, num_heads, num_kv_heads, "graph_decode")
    batch, width = block_table.shape
    block_size = key_cache.shape[1]
    shape = (batch, width * block_size, *key_cache.shape[2:])
    pages = block_table.reshape(-1).to(torch.long)
    k = key_cache.index_select(0, pages).view(shape)
    v = value_cache.index_select(0, pages).view(shape)
    positions = torch.arange(width * block_size, device=query.device)
    masked = _window_hidden(seq_lens, positions, sliding_window).view(batch, 1, 1, 1, -1)
    o = attend(query[:, None], k, v, None, scale, logits_soft_cap, masked=masked)
    out.copy_(o.view_as(out))


GRAPH_DECODE = Kernel("graph_decode", npu=graph_decode_npu, reference=graph_decode_reference)


def mla_graph_decode_npu(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_list: list[int],
    scale: float,
) -> torch.Tensor:
    args = latent_decode_args(ql_nope, q_pe, nope_cache, rope_cache, block_table, seq_lens_list, scale)
    return fia(args).view(ql_nope.shape)


def mla_graph_decode_reference(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_list: list[int],
    scale: float,
) -> torch.Tensor:
    width, block_size = block_table.shape[1], nope_cache.shape[1]
    positions = torch.arange(width * block_size, device=ql_nope.device)
    # [B, W * block_size]: every page of the table, in order (a static shape); past the length masked
    slots = block_table.to(torch.long)[:, positions // block_size] * block_size + positions % block_size
    hidden = _window_hidden(seq_lens, positions, None)
    return latent_attention(ql_nope, q_pe, nope_cache, rope_cache, slots, ~hidden, scale)


MLA_GRAPH_DECODE = Kernel("mla_graph_decode", npu=mla_graph_decode_npu, reference=mla_graph_decode_reference)
