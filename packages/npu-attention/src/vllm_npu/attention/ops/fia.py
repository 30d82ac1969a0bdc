# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``torch_npu.npu_fused_infer_attention_score`` (FIA): the one place npu-attention calls it.

torch_npu 2.8.0 registers the kernel in three forms that take one parameter list: the functional op (returns
``(attention_out, softmax_lse)``; the form torchair converts), ``.out`` (writes ``out=[attention_out, softmax_lse]``
and takes ``workspace=``: the form a captured ACL graph task holds, torch_npu ``npu/graphs.py:137-160``) and
``_npu_fused_infer_attention_score_get_max_workspace`` (the largest workspace over every sequence length, queried
before a task). vllm-ascend v0.11.0 builds one keyword set for the three as well (``attention/mla_v1.py:1016-1075``,
re-issued by the task update ``compilation/acl_graph.py:337-359``), and so does torch_npu's own graph dispatch,
which passes the functional call's arguments to the workspace query and to ``.out`` (``npu/graphs.py:138-153``).

:class:`FIAArgs` is that keyword set. Each variant is a constructor that lays its inputs out for one layout:

- :func:`gqa_paged_bsh` -- GQA decode, one query token per request, BSH over the paged cache viewed
  ``[num_blocks, block_size, Nkv * D]`` (the window decode and the compiled graph decode);
- :func:`gqa_paged_tnd` -- GQA paged prefill (chunked prefill, prefix hits, spec decode), packed TND, right-down
  causal (``sparse_mode=3``) or a band for a sliding window (``sparse_mode=4``);
- :func:`latent_paged_bnsd` -- MLA's absorbed decode in the kernel's MLA mode (BNSD, ``query_rope`` / ``key_rope``,
  one KV head), one or up to 16 query tokens per request (the decode, the compiled graph decode, the
  speculative-decoding verification).

:func:`antiquant` turns a GQA variant into its int8-KV-cache (C8) form: per-channel ``antiquant_scale``,
``antiquant_mode=0`` (:mod:`.c8_cache`). Float caches pass ``antiquant_scale=None, antiquant_mode=0``, the
documented defaults, as vllm-ascend v0.11.0 passes them in its MLA decode (``attention/mla_v1.py:1025-1026``).

:func:`fia`, :func:`fia_out` and :func:`fia_max_workspace` are the three calls, each spelled with every keyword of
:class:`FIAArgs` (the contract test reads the keywords from the source). Keywords a variant leaves at the
documented default (``atten_mask=None``, ``actual_seq_lengths=None``, ``sparse_mode=0``, ``pre_tokens`` /
``next_tokens`` ``2147483647``, ``query_rope`` / ``key_rope`` None) are passed with that default value, as
vllm-ascend passes ``atten_mask=None, sparse_mode=0, actual_seq_lengths=None`` in its MLA decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch
from vllm_npu.interface import KernelContractError

#: ``pre_tokens`` / ``next_tokens`` when unused: the kernel's documented default (no band).
NO_BAND = 2147483647
#: Query tokens per request the MLA mode takes (torch_npu 2.8.0 docs: query_rope needs Q_S in 1..16).
MAX_LATENT_QUERY_LEN = 16


@dataclass(frozen=True)
class FIAArgs:
    """One ``npu_fused_infer_attention_score`` call's arguments (every field is the kernel keyword of that name;
    ``query`` / ``key`` / ``value`` are the three positional inputs, already viewed in ``input_layout``)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    input_layout: str
    num_heads: int
    num_key_value_heads: int
    scale: float
    block_table: torch.Tensor
    block_size: int
    actual_seq_lengths_kv: Sequence[int]
    actual_seq_lengths: Sequence[int] | None = None
    atten_mask: torch.Tensor | None = None
    sparse_mode: int = 0
    pre_tokens: int = NO_BAND
    next_tokens: int = NO_BAND
    query_rope: torch.Tensor | None = None
    key_rope: torch.Tensor | None = None
    antiquant_scale: torch.Tensor | None = None
    antiquant_mode: int = 0


# --- the variants ----------------------------------------------------------------------------------------------------


def gqa_paged_bsh(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: Sequence[int],
    mask: torch.Tensor | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
) -> FIAArgs:
    """One query token per request: ``query [B, N, D]`` viewed BSH ``[B, 1, N * D]``, caches ``[nb, bs, Nkv, D]``
    viewed ``[nb, bs, Nkv * D]`` (all views), ``actual_seq_lengths = [1] * B`` (a constant inside a compiled graph),
    ``context_lens`` the per-request cache lengths (``SymInt[]``), ``sparse_mode=0`` with an optional ``[B, 1, KV_S]``
    bool mask (True = hidden): with Q_S = 1 the kernel ignores ``pre_tokens`` and ``sparse_mode``, so a sliding
    window is that mask. The output ``[B, 1, N * D]`` is ``[B, N, D]`` viewed."""
    num_blocks, block_size = key_cache.shape[:2]
    batch = query.shape[0]
    return FIAArgs(
        query=query.reshape(batch, 1, -1),
        key=key_cache.view(num_blocks, block_size, -1),
        value=value_cache.view(num_blocks, block_size, -1),
        input_layout="BSH",
        num_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        scale=scale,
        block_table=block_table,
        block_size=block_size,
        actual_seq_lengths=[1] * batch,
        actual_seq_lengths_kv=context_lens,
        atten_mask=mask,
    )


def gqa_paged_tnd(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    mask: torch.Tensor,
    *,
    sliding_window: int | None,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
) -> FIAArgs:
    """Packed queries ``[T, N, D]`` (TND, ``actual_seq_lengths`` the cumulative ends ``query_start_loc[1:]``) over the
    paged cache viewed ``[nb, bs, Nkv * D]``, with the 2048 splitfuse ``mask``: right-down causal (``sparse_mode=3``)
    or, for a sliding window ``W``, the band ``sparse_mode=4, pre_tokens=W - 1, next_tokens=0``."""
    num_blocks, block_size = key_cache.shape[:2]
    if sliding_window is None:
        sparse_mode, pre_tokens, next_tokens = 3, NO_BAND, NO_BAND
    else:
        sparse_mode, pre_tokens, next_tokens = 4, sliding_window - 1, 0
    return FIAArgs(
        query=query,
        key=key_cache.view(num_blocks, block_size, -1),
        value=value_cache.view(num_blocks, block_size, -1),
        input_layout="TND",
        num_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        scale=scale,
        block_table=block_table,
        block_size=block_size,
        actual_seq_lengths=query_start_loc[1:],
        actual_seq_lengths_kv=seq_lens,
        atten_mask=mask,
        sparse_mode=sparse_mode,
        pre_tokens=pre_tokens,
        next_tokens=next_tokens,
    )


def latent_paged_bnsd(
    query: torch.Tensor,
    query_rope: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
    *,
    query_lens: Sequence[int] | None = None,
    mask: torch.Tensor | None = None,
) -> FIAArgs:
    """The MLA mode: ``query [B, N, Q_S, L]`` and ``query_rope [B, N, Q_S, R]`` (BNSD, contiguous), the latent
    plane ``[nb, bs, 1, L]`` viewed ``[nb, 1, bs, L]`` as key and value, the rope plane likewise as ``key_rope``, one
    KV head, ``seq_lens`` the per-request cache lengths. Q_S = 1 (the decode): no mask, ``sparse_mode=0``. Several
    query tokens per request (``query_lens``, each request's rows right-padded to Q_S): the 2048 splitfuse ``mask``
    with ``sparse_mode=3``. Documented limits: L = 512, R = 64, N in {32, 64, 128}, block size 16/128, Q_S <= 16.
    With a contiguous query every input is a view: nothing is allocated, as a captured task requires."""
    B, N, q_s, L = query.shape
    nb, bs, _, _ = nope_cache.shape
    R = rope_cache.shape[-1]
    if L != 512 or R != 64 or N not in (32, 64, 128) or bs not in (16, 128) or q_s > MAX_LATENT_QUERY_LEN:
        raise KernelContractError(
            f"npu_fused_infer_attention_score (MLA mode) needs kv_lora_rank 512, rope dim 64, 32/64/128 local heads, "
            f"block size 16 or 128 and at most {MAX_LATENT_QUERY_LEN} query tokens per request; got L={L}, R={R}, "
            f"N={N}, block_size={bs}, query tokens per request {q_s if query_lens is None else list(query_lens)}. "
            "Use the reference kernels (additional_config npu.kernels='reference') for other shapes"
        )
    kv = nope_cache.view(nb, 1, bs, L)
    return FIAArgs(
        query=query.contiguous(),
        key=kv,
        value=kv,
        input_layout="BNSD",
        num_heads=N,
        num_key_value_heads=1,
        scale=scale,
        block_table=block_table.to(torch.int32),
        block_size=bs,
        actual_seq_lengths=None if query_lens is None else list(query_lens),
        actual_seq_lengths_kv=list(seq_lens),
        atten_mask=mask,
        sparse_mode=0 if query_lens is None else 3,
        query_rope=query_rope.contiguous(),
        key_rope=rope_cache.view(nb, 1, bs, R),
    )


def antiquant(a: FIAArgs, scale: torch.Tensor) -> FIAArgs:
    """``a`` over an int8 KV cache (C8, :mod:`.c8_cache`): the kernel dequantizes K and V with the per-channel
    ``antiquant_scale`` (``[2, H]`` for BSH, K row then V row; ``antiquant_mode=0``, symmetric: no offset). The
    caches stay the int8 views the layout variant made."""
    return replace(a, antiquant_scale=scale, antiquant_mode=0)


# --- the three calls -------------------------------------------------------------------------------------------------


def fia(a: FIAArgs) -> torch.Tensor:
    """The functional op; returns ``attention_out`` (the query's shape; the softmax LSE is not requested)."""
    import torch_npu

    attention_out, _ = torch_npu.npu_fused_infer_attention_score(
        a.query,
        a.key,
        a.value,
        query_rope=a.query_rope,
        key_rope=a.key_rope,
        antiquant_scale=a.antiquant_scale,
        antiquant_mode=a.antiquant_mode,
        atten_mask=a.atten_mask,
        block_table=a.block_table,
        input_layout=a.input_layout,
        block_size=a.block_size,
        actual_seq_lengths=a.actual_seq_lengths,
        actual_seq_lengths_kv=a.actual_seq_lengths_kv,
        num_key_value_heads=a.num_key_value_heads,
        num_heads=a.num_heads,
        scale=a.scale,
        sparse_mode=a.sparse_mode,
        pre_tokens=a.pre_tokens,
        next_tokens=a.next_tokens,
    )
    return cast(torch.Tensor, attention_out)


def fia_out(a: FIAArgs, *, out: torch.Tensor, lse: torch.Tensor, workspace: torch.Tensor | None) -> None:
    """``.out``: ``out`` (contiguous, the query's element count) viewed as the query receives ``attention_out``;
    ``lse`` is the ``softmax_lse`` buffer (reserved: ``softmax_lse_flag`` is off). The registered 2.8.0 schema ends
    in ``Tensor? workspace=None, Tensor[] out``. Inside a captured task ``workspace`` is :func:`fia_max_workspace`'s
    and ``out`` / ``lse`` were allocated before the task, so the task group holds this kernel alone; eagerly
    ``workspace`` may be None (the kernel sizes its own)."""
    import torch_npu

    torch_npu.npu_fused_infer_attention_score.out(
        a.query,
        a.key,
        a.value,
        query_rope=a.query_rope,
        key_rope=a.key_rope,
        antiquant_scale=a.antiquant_scale,
        antiquant_mode=a.antiquant_mode,
        atten_mask=a.atten_mask,
        block_table=a.block_table,
        input_layout=a.input_layout,
        block_size=a.block_size,
        actual_seq_lengths=a.actual_seq_lengths,
        actual_seq_lengths_kv=a.actual_seq_lengths_kv,
        num_key_value_heads=a.num_key_value_heads,
        num_heads=a.num_heads,
        scale=a.scale,
        sparse_mode=a.sparse_mode,
        pre_tokens=a.pre_tokens,
        next_tokens=a.next_tokens,
        workspace=workspace,
        out=[out.view(a.query.shape), lse],
    )


def fia_max_workspace(a: FIAArgs) -> torch.Tensor:
    """The largest workspace :func:`fia_out` can need for these arguments over every sequence length
    (``_npu_fused_infer_attention_score_get_max_workspace``; its registered schema takes ``query_rope`` /
    ``key_rope`` like the op, although the prose docs list them only for the op): queried once per captured task,
    whose updates change only the sequence lengths."""
    import torch_npu

    workspace: torch.Tensor = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
        a.query,
        a.key,
        a.value,
        query_rope=a.query_rope,
        key_rope=a.key_rope,
        antiquant_scale=a.antiquant_scale,
        antiquant_mode=a.antiquant_mode,
        atten_mask=a.atten_mask,
        block_table=a.block_table,
        input_layout=a.input_layout,
        block_size=a.block_size,
        actual_seq_lengths=a.actual_seq_lengths,
        actual_seq_lengths_kv=a.actual_seq_lengths_kv,
        num_key_value_heads=a.num_key_value_heads,
        num_heads=a.num_heads,
        scale=a.scale,
        sparse_mode=a.sparse_mode,
        pre_tokens=a.pre_tokens,
        next_tokens=a.next_tokens,
    )
    return workspace
