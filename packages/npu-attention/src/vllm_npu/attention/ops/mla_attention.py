# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""MLA attention kernels: absorbed decode over the paged latent cache (one query token per request, or several:
speculative-decoding verification), and ring prefill with a running LSE.

Notation: ``N`` heads, ``L`` kv_lora_rank, ``R`` rope dim, ``P`` qk_nope_head_dim, ``V`` v_head_dim, ``bs`` block size.
All references compute the softmax in float32 and return the input dtype; LSEs are float32 natural logs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from vllm_npu.interface import Kernel, KernelContractError

from ..masks import masked_value
from .fia import FIAArgs, fia, fia_max_workspace, fia_out, latent_paged_bnsd

# --- absorbed decode --------------------------------------------------------------------------------------------


def mla_decode_reference(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
    *,
    out: torch.Tensor,
    workspace: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> None:
    """Multi-query attention of one token per request over its whole cached sequence, in latent space, written
    into ``out``.

    ``ql_nope [B, N, L]`` (q_nope already multiplied by ``W_UK``), ``q_pe [B, N, R]``; caches ``[nb, bs, 1, L|R]``;
    ``block_table [B, max_blocks]`` int; ``seq_lens`` B ints (tokens in the cache, including the current one).
    ``score[b, n, s] = scale * (ql_nope[b, n] . kv_c[b, s] + q_pe[b, n] . k_pe[b, s])`` for ``s < seq_lens[b]``;
    writes ``softmax(score) @ kv_c`` into ``out [B, N, L]`` (the caller applies ``W_UV``) and returns nothing, so a
    captured graph can hold the call as an updatable task (:func:`vllm_npu.interface.graphs.launch`).
    ``workspace`` and ``lse`` are the NPU kernel's scratch (:func:`mla_decode_npu`); the reference ignores them.
    """
    B = ql_nope.shape[0]
    bs = nope_cache.shape[1]
    lens = torch.as_tensor(list(seq_lens), dtype=torch.int64)
    if lens.numel() != B or (lens <= 0).any():
        raise KernelContractError(f"mla_decode: need {B} positive seq_lens, got {lens.tolist()}")
    if out.shape != ql_nope.shape:
        raise KernelContractError(f"mla_decode: out must be {tuple(ql_nope.shape)}, got {tuple(out.shape)}")
    dev = ql_nope.device
    pos = torch.arange(int(lens.max()), device=dev)
    slots = block_table[:, pos // bs].long() * bs + pos % bs  # [B, S]; entries past seq_len are masked
    valid = pos[None, :] < lens.to(dev)[:, None]
    out.copy_(latent_attention(ql_nope, q_pe, nope_cache, rope_cache, slots, valid, scale))


def latent_attention(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The absorbed MQA both latent references share (dense decode here, sparse in :mod:`.sfa_kernels`).

    ``ql_nope [T, N, L]``, ``q_pe [T, N, R]``, caches ``[nb, bs, 1, L|R]``; query ``t`` attends to the cache slots
    ``slots[t] [K]`` where ``valid[t] [K]`` is True. ``softmax(scale * (ql_nope . kv_c + q_pe . k_pe)) @ kv_c`` in
    float32, returned as ``[T, N, L]`` in ``ql_nope.dtype``; a query with no valid slot gets zeros.
    """
    k_c = nope_cache.view(-1, nope_cache.shape[-1])[slots].float()  # [T, K, L]
    k_r = rope_cache.view(-1, rope_cache.shape[-1])[slots].float()  # [T, K, R]
    score = torch.einsum("tnl,tkl->tnk", ql_nope.float(), k_c) + torch.einsum("tnr,tkr->tnk", q_pe.float(), k_r)
    score = (score * scale).masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(score, dim=-1).nan_to_num(0.0)
    return torch.einsum("tnk,tkl->tnl", p, k_c).to(ql_nope.dtype)


def latent_decode_args(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
) -> FIAArgs:
    """The FIA arguments of the one-token MLA decode (:func:`.fia.latent_paged_bnsd` with Q_S = 1): ``ql_nope
    [B, N, L]`` and ``q_pe [B, N, R]`` viewed ``[B, N, 1, L|R]``. With contiguous ``ql_nope`` / ``q_pe`` (what the
    backend passes) every argument is a view: nothing is allocated, as a captured task requires (its kernel alone
    runs inside the task group). Shared by the eager / ACL-graph decode and the compiled graph decode."""
    B, N, L = ql_nope.shape
    return latent_paged_bnsd(
        ql_nope.reshape(B, N, 1, L), q_pe.reshape(B, N, 1, q_pe.shape[-1]), nope_cache, rope_cache, block_table,
        seq_lens, scale,
    )  # fmt: skip


def mla_decode_npu(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
    *,
    out: torch.Tensor,
    workspace: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> None:
    """NPU twin of :func:`mla_decode_reference`: ``npu_fused_infer_attention_score.out`` in its MLA mode
    (query_rope / key_rope, one KV head, BNSD, paged).

    The registered 2.8.0 schema of ``.out`` (``libtorch_npu.so``) ends in ``Tensor? workspace=None, Tensor[] out``:
    the outputs go as ``out=[attention_out, softmax_lse]`` (the prose docs name the two outputs; their own example,
    torch_npu's ``npu/graphs.py`` and vllm-ascend v0.11.0's graph path pass ``out=[...]``). Inside a captured graph
    ``workspace`` is the kernel's maximum workspace (:func:`mla_decode_workspace_npu`) and ``lse`` a ``[B]`` buffer,
    both allocated before the capture's task so that every task update re-issues the kernel on the same addresses;
    eagerly both may be None (the kernel then sizes its own workspace; ``softmax_lse`` is reserved, "暂不支持", and
    discarded)."""
    args = latent_decode_args(ql_nope, q_pe, nope_cache, rope_cache, block_table, seq_lens, scale)
    fia_out(args, out=out, lse=ql_nope.new_empty(ql_nope.shape[0]) if lse is None else lse, workspace=workspace)


def mla_decode_workspace_npu(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """The largest workspace :func:`mla_decode_npu` can need at these shapes, for every sequence length
    (``torch_npu._npu_fused_infer_attention_score_get_max_workspace``, same arguments as the call; its registered
    schema takes query_rope / key_rope like the op, although the prose docs list them only for the op). Queried once
    per captured task; the graph's task updates change only the sequence lengths. NPU only: the reference
    (:func:`mla_decode_reference`) needs no workspace."""
    return fia_max_workspace(latent_decode_args(ql_nope, q_pe, nope_cache, rope_cache, block_table, seq_lens, scale))


MLA_DECODE = Kernel("mla_decode", npu=mla_decode_npu, reference=mla_decode_reference)


# --- multi-token decode (speculative-decoding verification: 1 + k query tokens per request) ----------------------


def _check_spec_lens(t: int, query_lens: Sequence[int], seq_lens: Sequence[int]) -> None:
    if len(query_lens) != len(seq_lens) or sum(query_lens) != t:
        raise KernelContractError(
            f"mla_spec_decode: query_lens {list(query_lens)} / seq_lens {list(seq_lens)} do not describe {t} tokens"
        )
    if any(q < 1 or q > s for q, s in zip(query_lens, seq_lens, strict=True)):
        raise KernelContractError(
            f"mla_spec_decode: every request needs 1 <= query_len <= seq_len, got query_lens {list(query_lens)}, "
            f"seq_lens {list(seq_lens)}"
        )


def mla_spec_decode_reference(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MQA of several query tokens per request over the latent cache, causal inside the draft window.

    ``ql_nope [T, N, L]``, ``q_pe [T, N, R]``: the requests' tokens packed in order, ``query_lens[b]`` of request
    ``b`` (``T = sum(query_lens)``, mixed lengths allowed), its new tokens already in the cache; ``seq_lens[b]``
    cached tokens including them; caches ``[nb, bs, 1, L|R]``, ``block_table [B, max_blocks]``. Token ``i``
    (0-based) of request ``b`` sees cache positions ``s < seq_lens[b] - query_lens[b] + i + 1`` (bottom-right
    aligned: the last token sees the whole sequence, the draft tokens after it are hidden). Returns ``[T, N, L]``
    (``softmax(score) @ kv_c``; the caller applies ``W_UV``). ``attn_mask`` is the NPU kernel's, unused here."""
    t = ql_nope.shape[0]
    _check_spec_lens(t, query_lens, seq_lens)
    dev = ql_nope.device
    bs = nope_cache.shape[1]
    q_lens = torch.as_tensor(list(query_lens), dtype=torch.int64)
    req = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)  # [T] request of each token
    first = torch.cumsum(q_lens, 0) - q_lens
    offset = torch.arange(t) - first[req]  # token's index inside its request
    visible = (torch.as_tensor(list(seq_lens), dtype=torch.int64) - q_lens)[req] + offset + 1  # [T]
    pos = torch.arange(int(max(seq_lens)), device=dev)
    rows = block_table[req.to(dev)].long()  # [T, max_blocks]
    slots = rows[:, pos // bs] * bs + pos % bs  # [T, S]; entries past the visible length are masked
    return latent_attention(
        ql_nope, q_pe, nope_cache, rope_cache, slots, pos[None, :] < visible.to(dev)[:, None], scale
    )


def mla_spec_decode_npu(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """NPU twin of :func:`mla_spec_decode_reference`: ``npu_fused_infer_attention_score`` in its MLA mode with
    ``Q_S = max(query_lens)`` query tokens per request: BNSD, each request's tokens right-padded to ``Q_S``,
    ``actual_seq_lengths`` = the per-request query lengths, right-down causal ``sparse_mode=3`` with the 2048
    splitfuse mask (:meth:`~vllm_npu.attention.masks.AttentionMaskBuilder.splitfuse_mask`). The padded rows are
    dropped. torch_npu 2.8.0 documents the rope inputs for BSH/BSND/BNSD with Q_S 1..16 (not TND); limits as for
    :func:`mla_decode_npu`, plus ``max(query_lens) <= 16``."""
    t, N, _ = ql_nope.shape
    _check_spec_lens(t, query_lens, seq_lens)
    if attn_mask is None:
        raise KernelContractError("mla_spec_decode on the NPU needs the 2048 splitfuse mask (sparse_mode=3)")
    B, q_max = len(query_lens), max(query_lens)
    q_lens = torch.as_tensor(list(query_lens), dtype=torch.int64)
    req = torch.repeat_interleave(torch.arange(B), q_lens)
    rows = (torch.arange(t) - (torch.cumsum(q_lens, 0) - q_lens)[req] + req * q_max).to(ql_nope.device)

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, N, D] -> right-padded BNSD [B, N, Q_S, D]
        out = x.new_zeros(B * q_max, N, x.shape[-1])
        out[rows] = x
        return out.view(B, q_max, N, -1).transpose(1, 2).contiguous()

    args = latent_paged_bnsd(
        padded(ql_nope), padded(q_pe), nope_cache, rope_cache, block_table, seq_lens, scale,
        query_lens=query_lens, mask=attn_mask,
    )  # fmt: skip
    return fia(args).transpose(1, 2).reshape(B * q_max, N, -1)[rows]


MLA_SPEC_DECODE = Kernel("mla_spec_decode", npu=mla_spec_decode_npu, reference=mla_spec_decode_reference)


# --- ring prefill (one ring step: attention of new queries over one KV segment, merged into a running result) ------


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax attentions over disjoint key sets.

    ``out_* [T, N, V]``, ``lse_* [N, T]`` float32. Rows whose both LSEs are ``-inf`` (no keys at all) give 0.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).transpose(0, 1).unsqueeze(-1)  # [T, N, 1]
    w_b = torch.exp(lse_b - safe).transpose(0, 1).unsqueeze(-1)
    out = out_a.float() * w_a + out_b.float() * w_b
    return out.to(out_a.dtype), lse


def ring_mla_reference(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    value: torch.Tensor,
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    scale: float,
    causal: bool,
    prev_out: torch.Tensor | None = None,
    prev_lse: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of packed queries over packed keys, request by request, optionally merged with a previous result.

    ``q_nope [T, N, P]``, ``q_rope [T, N, R]``, ``k_nope [S, N, P]``, ``k_rope [S, N or 1, R]``, ``value [S, N, V]``;
    request ``b`` owns ``q_lens[b]`` queries and ``kv_lens[b]`` keys (in order). ``causal``: query ``i`` sees key
    ``j`` iff ``j <= kv_len - q_len + i`` (bottom-right aligned, used for the new tokens themselves). Requests with
    no keys yield ``out = 0``, ``lse = -inf``. With ``prev_out [T, N, V]`` / ``prev_lse [N, T]`` the result is merged
    (:func:`merge_attention_states`). ``mask`` is the NPU kernel's triangular mask, unused here. Returns
    ``(out [T, N, V], lse [N, T] float32)``.
    """
    T, N, _ = q_nope.shape
    V = value.shape[-1]
    if len(q_lens) != len(kv_lens) or sum(q_lens) != T or sum(kv_lens) != k_nope.shape[0]:
        raise KernelContractError(
            f"ring_mla: q_lens {list(q_lens)} / kv_lens {list(kv_lens)} do not add up to T={T} / S={k_nope.shape[0]}"
        )
    out = torch.zeros(T, N, V, dtype=torch.float32, device=q_nope.device)
    lse = torch.full((N, T), float("-inf"), dtype=torch.float32, device=q_nope.device)
    k_rope = k_rope.expand(-1, N, -1) if k_rope.shape[1] == 1 else k_rope
    q0 = k0 = 0
    for ql, kl in zip(q_lens, kv_lens, strict=True):
        if ql > 0 and kl > 0:
            score = torch.einsum("qnp,knp->nqk", q_nope[q0 : q0 + ql].float(), k_nope[k0 : k0 + kl].float())
            score += torch.einsum("qnr,knr->nqk", q_rope[q0 : q0 + ql].float(), k_rope[k0 : k0 + kl].float())
            score *= scale
            if causal:
                qi = torch.arange(ql, device=score.device)[:, None]
                kj = torch.arange(kl, device=score.device)[None, :]
                score = score.masked_fill(kj > kl - ql + qi, float("-inf"))
            seg_lse = torch.logsumexp(score, dim=-1)  # [N, ql]
            p = torch.exp(score - seg_lse.unsqueeze(-1).clamp(min=-1e30))
            out[q0 : q0 + ql] = torch.einsum("nqk,knv->qnv", p, value[k0 : k0 + kl].float())
            lse[:, q0 : q0 + ql] = seg_lse
        q0 += ql
        k0 += kl
    result = out.to(q_nope.dtype)
    if prev_out is not None:
        if prev_lse is None:
            raise KernelContractError("ring_mla: prev_out given without prev_lse")
        return merge_attention_states(prev_out, prev_lse, result, lse)
    return result, lse


_RING_MASK_SIZE = 512


def ring_mla_mask(dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """The ``[512, 512]`` upper-triangular mask ``npu_ring_mla`` takes with ``mask_type_triu``: 0 on and below the
    diagonal, :func:`~vllm_npu.attention.masks.masked_value` above it (``-inf`` for float16, ``1`` for bfloat16).

    The kernel adds a float16 mask to the scores as given but treats a bfloat16 mask as a flag it scales by a large
    negative factor (op-plugin 7.2.0 ``test/test_custom_ops/test_atb_ring_mla.py``, "kernel中mask的系数"), so a ``1``
    in an fp16 mask would bias future tokens by +1 instead of hiding them. vllm-ascend v0.11.0 builds the same values
    (``attention/mla_v1.py``, ``finfo(float32).min`` for fp16, which is ``-inf`` in fp16). Built once per impl; the
    reference ignores it."""
    above = torch.ones(_RING_MASK_SIZE, _RING_MASK_SIZE, dtype=torch.bool, device=device).triu_(1)
    mask = torch.zeros(_RING_MASK_SIZE, _RING_MASK_SIZE, dtype=dtype, device=device)
    return mask.masked_fill_(above, masked_value(dtype))


def ring_mla_npu(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    value: torch.Tensor,
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    scale: float,
    causal: bool,
    prev_out: torch.Tensor | None = None,
    prev_lse: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NPU twin of :func:`ring_mla_reference`: ``torch_npu.atb.npu_ring_mla`` (``calc_type_first_ring`` without a
    previous result, ``calc_type_default`` merging ``prev_out``/``prev_lse``). Documented limits: P = V = 128,
    R = 64, BSND, every request with ``kv_len >= q_len`` or ``kv_len == 0``."""
    T, N, P = q_nope.shape
    if P != 128 or value.shape[-1] != 128 or q_rope.shape[-1] != 64:
        raise KernelContractError(
            f"npu_ring_mla needs qk_nope_head_dim 128, v_head_dim 128 and rope dim 64; got {P}, {value.shape[-1]}, "
            f"{q_rope.shape[-1]}. Use the reference kernels (additional_config npu.kernels='reference')"
        )
    if causal and mask is None:
        raise KernelContractError("npu_ring_mla with a causal segment needs the triangular mask (ring_mla_mask)")
    import torch_npu

    k_rope = k_rope.expand(-1, N, -1).contiguous() if k_rope.shape[1] == 1 else k_rope
    seqlen = torch.tensor([list(q_lens), list(kv_lens)], dtype=torch.int32)
    first = prev_out is None
    out, lse = torch_npu.atb.npu_ring_mla(
        q_nope.contiguous(),
        q_rope.contiguous(),
        k_nope.contiguous(),
        k_rope,
        value.contiguous(),
        mask,
        seqlen,
        head_num=N,
        kv_head_num=N,
        pre_out=prev_out,
        prev_lse=prev_lse,
        qk_scale=scale,
        kernel_type="kernel_type_high_precision",
        mask_type="mask_type_triu" if causal else "no_mask",
        input_layout="type_bsnd",
        calc_type="calc_type_first_ring" if first else "calc_type_default",
    )
    return out, lse


RING_MLA = Kernel("ring_mla", npu=ring_mla_npu, reference=ring_mla_reference)
