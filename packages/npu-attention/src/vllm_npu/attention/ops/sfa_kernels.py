# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""DeepSeek-V3.2 sparse attention (SFA) kernels: the indexer key cache write, the lightning-indexer top-k, and
sparse MLA attention over the selected tokens.

The NPU twins call ``torch.ops.custom.npu_lightning_indexer`` and ``torch.ops.custom.npu_sparse_flash_attention``:
these are **not torch_npu ops**; they come from the separate Ascend ``custom_ops`` package (imported with
``import custom_ops``, which registers the ``torch.ops.custom`` namespace), so torch_npu's documentation does not
cover them and the contract checker does not see them. Their call shapes follow the published vllm-ascend usage:
TND queries (``actual_seq_lengths_query`` = cumulative query ends), ``PA_BSND`` paged keys
(``actual_seq_lengths_kv`` = per-request lengths) and right-down causal masking (``sparse_mode=3``).

Indices are request-local token positions (``0 <= idx <= position of the query token``), ``-1`` = no token; this is
vLLM 0.11's ``topk_indices_buffer`` convention (``vllm/model_executor/models/deepseek_v2.py::sparse_attn_indexer``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from vllm_npu.interface import Kernel, KernelContractError, MissingComponentError

from .mla_attention import latent_attention


def _custom_ops():
    """``torch.ops.custom`` after importing the external ``custom_ops`` package; a clear error when it is missing."""
    try:
        import custom_ops  # noqa: F401  (registers torch.ops.custom.*)
    except ImportError as e:
        raise MissingComponentError(
            "attention",
            "DeepSeek-V3.2 sparse attention on the NPU needs the Ascend 'custom_ops' package "
            "(torch.ops.custom.npu_lightning_indexer / npu_sparse_flash_attention)",
            fix="install the custom_ops wheel shipped with CANN's vllm-ascend kernels, or run with "
            "additional_config npu.kernels='reference'",
        ) from e
    return torch.ops.custom


def token_request_positions(query_start_loc: Sequence[int], seq_lens: Sequence[int], device: torch.device):
    """Per packed query token: its request index and its position within the request, as int64 ``[T]`` tensors.
    ``query_start_loc`` has B + 1 entries (cumulative), ``seq_lens`` B (tokens including this step's)."""
    qsl = torch.as_tensor(list(query_start_loc), dtype=torch.int64)
    lens = torch.as_tensor(list(seq_lens), dtype=torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
    within = torch.arange(int(qsl[-1])) - qsl[:-1][req]
    pos = (lens - q_lens)[req] + within
    return req.to(device), pos.to(device)


# --- indexer key cache write ------------------------------------------------------------------------------------


def indexer_cache_write_reference(k: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``k [T, D]`` into ``cache [nb, bs, D]`` at ``slot_mapping [T]``, in place; slots < 0 skipped."""
    if k.dim() != 2 or cache.dim() != 3 or k.shape[1] != cache.shape[2]:
        raise KernelContractError(
            f"indexer cache write: k [T, D] into [nb, bs, D]; got {tuple(k.shape)}, {tuple(cache.shape)}"
        )
    valid = slot_mapping >= 0
    cache.view(-1, cache.shape[-1])[slot_mapping[valid].long()] = k[valid].to(cache.dtype)


def indexer_cache_write_npu(k: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """NPU twin (``npu_scatter_nd_update_``); padding slots go to vLLM's null block 0, which no request reads."""
    import torch_npu

    idx = slot_mapping.clamp(min=0).to(torch.int64).view(-1, 1)
    torch_npu.npu_scatter_nd_update_(cache.view(-1, cache.shape[-1]), idx, k.to(cache.dtype))


INDEXER_CACHE_WRITE = Kernel(
    "indexer_cache_write", npu=indexer_cache_write_npu, reference=indexer_cache_write_reference
)


# --- lightning indexer ------------------------------------------------------------------------------------------


def lightning_indexer_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    topk: int,
) -> torch.Tensor:
    """Top-``topk`` cached tokens per query token by the lightning-indexer score.

    ``q [T, H, D]`` index queries, ``weights [T, H]`` per-head weights (scales folded in), ``key_cache [nb, bs, D]``,
    ``block_table [B, max_blocks]``. For query token t (request b, position p) and cached token s <= p:
    ``score(t, s) = sum_h weights[t, h] * relu(q[t, h] . k_b[s])``. Returns int32 ``[T, topk]`` request-local
    positions ordered by descending score; slots beyond the ``p + 1`` candidates are ``-1``.
    """
    T = q.shape[0]
    bs = key_cache.shape[1]
    dev = q.device
    req, pos = token_request_positions(query_start_loc, seq_lens, dev)
    if req.numel() != T:
        raise KernelContractError(f"lightning_indexer: query_start_loc covers {req.numel()} tokens, q has {T}")
    out = torch.full((T, topk), -1, dtype=torch.int32, device=dev)
    if T == 0:
        return out
    S = int(max(seq_lens))
    cand = torch.arange(S, device=dev)
    slots = block_table[req][:, cand // bs].long() * bs + cand % bs  # [T, S]
    keys = key_cache.view(-1, key_cache.shape[-1])[slots].float()  # [T, S, D]
    score = torch.einsum("thd,tsd->ths", q.float(), keys).relu()
    score = (score * weights.float().unsqueeze(-1)).sum(1)  # [T, S]
    valid = cand[None, :] <= pos[:, None]
    score = score.masked_fill(~valid, float("-inf"))
    k = min(topk, S)
    top = torch.topk(score, k, dim=-1)
    idx = top.indices.to(torch.int32)
    idx[~torch.isfinite(top.values)] = -1
    out[:, :k] = idx
    return out


def lightning_indexer_npu(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    topk: int,
) -> torch.Tensor:
    """NPU twin of :func:`lightning_indexer_reference` (``torch.ops.custom.npu_lightning_indexer``; see module doc)."""
    _custom_ops()  # spelled torch.ops.custom.<op> below, so the provenance table's scan sees it
    nb, bs, d = key_cache.shape
    dev = q.device
    idx = torch.ops.custom.npu_lightning_indexer(
        query=q,
        key=key_cache.view(nb, bs, 1, d),
        weights=weights,
        actual_seq_lengths_query=torch.as_tensor(list(query_start_loc)[1:], dtype=torch.int32, device=dev),
        actual_seq_lengths_key=torch.as_tensor(list(seq_lens), dtype=torch.int32, device=dev),
        block_table=block_table.to(torch.int32),
        layout_query="TND",
        layout_key="PA_BSND",
        sparse_count=topk,
        sparse_mode=3,
    )
    return idx.view(q.shape[0], topk).to(torch.int32)


LIGHTNING_INDEXER = Kernel("lightning_indexer", npu=lightning_indexer_npu, reference=lightning_indexer_reference)


# --- sparse MLA attention ---------------------------------------------------------------------------------------


def sparse_mla_attention_reference(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    topk_indices: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Absorbed (latent-space) MQA of each query token over its selected cached tokens only.

    ``ql_nope [T, N, L]`` (q_nope @ W_UK), ``q_pe [T, N, R]``, caches ``[nb, bs, 1, L|R]``, ``topk_indices [T, K]``
    request-local positions (``-1`` and positions after the token's own are ignored). Returns ``[T, N, L]``
    (``softmax(scale * (ql_nope . kv_c + q_pe . k_pe)) @ kv_c`` over the selection); the caller applies ``W_UV``.
    """
    T = ql_nope.shape[0]
    bs = nope_cache.shape[1]
    req, pos = token_request_positions(query_start_loc, seq_lens, ql_nope.device)
    idx = topk_indices[:T].long()
    valid = (idx >= 0) & (idx <= pos[:, None])  # a token with no selection attends to nothing
    safe = idx.clamp(min=0)
    slots = torch.gather(block_table[req].long(), 1, safe // bs) * bs + safe % bs  # [T, K]
    return latent_attention(ql_nope, q_pe, nope_cache, rope_cache, slots, valid, scale)


def sparse_mla_attention_npu(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    topk_indices: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """NPU twin of :func:`sparse_mla_attention_reference` (``torch.ops.custom.npu_sparse_flash_attention``, the
    latent cache serving as both key and value; see module doc)."""
    _custom_ops()
    T, N, L = ql_nope.shape
    dev = ql_nope.device
    return torch.ops.custom.npu_sparse_flash_attention(
        query=ql_nope.contiguous(),
        key=nope_cache,
        value=nope_cache,
        sparse_indices=topk_indices[:T].view(T, 1, -1).to(torch.int32),
        scale_value=scale,
        sparse_block_size=1,
        block_table=block_table.to(torch.int32),
        actual_seq_lengths_query=torch.as_tensor(list(query_start_loc)[1:], dtype=torch.int32, device=dev),
        actual_seq_lengths_kv=torch.as_tensor(list(seq_lens), dtype=torch.int32, device=dev),
        query_rope=q_pe.contiguous(),
        key_rope=rope_cache,
        layout_query="TND",
        layout_kv="PA_BSND",
        sparse_mode=3,
    ).view(T, N, L)


SPARSE_MLA_ATTENTION = Kernel(
    "sparse_mla_attention", npu=sparse_mla_attention_npu, reference=sparse_mla_attention_reference
)
