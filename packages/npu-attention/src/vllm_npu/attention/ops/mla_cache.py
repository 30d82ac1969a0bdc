# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The MLA latent KV cache: its layout, the per-token write, the fused k-norm + rope + write, and the paged load.

Layout. vLLM allocates one buffer per MLA layer and views it as ``[num_blocks, block_size, L + R]``
(``L`` = kv_lora_rank, ``R`` = qk_rope_head_dim; :meth:`AscendMLABackend.get_kv_cache_shape`). We store the two parts
of the latent vector in two *planes* of that buffer, each contiguous:

- nope plane ``[num_blocks, block_size, 1, L]``: the normalised latent ``kv_c`` (first ``nb*bs*L`` elements);
- rope plane ``[num_blocks, block_size, 1, R]``: the rotated ``k_pe`` (the remaining ``nb*bs*R`` elements).

The NPU kernels (``npu_fused_infer_attention_score`` with ``key_rope``, ``npu_kv_rmsnorm_rope_cache``,
``npu_paged_cache_load``) take the two caches as separate, contiguous tensors ("non-contiguous tensors are not
supported"), which an interleaved ``[.., L + R]`` row layout cannot give. :func:`latent_cache_planes` is the only place
that knows the layout. A cache slot ``s`` is block ``s // block_size``, offset ``s % block_size``.

Padding slots (``slot < 0``, vLLM's ``PAD_SLOT_ID``) are skipped by the references. The NPU scatter does not accept
out-of-range indices, so the NPU paths redirect them to slot 0: block 0 is vLLM's reserved null block
(``BlockPool.null_block``), never handed to a request, so nothing ever reads what lands there.
"""

from __future__ import annotations

import torch
from vllm_npu.interface import Kernel, KernelContractError


def latent_cache_planes(kv_cache: torch.Tensor, kv_lora_rank: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one layer's MLA cache ``[nb, bs, L + R]`` into its nope plane ``[nb, bs, 1, L]`` and rope plane
    ``[nb, bs, 1, R]`` (views sharing the buffer, both contiguous)."""
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != kv_lora_rank + rope_dim:
        raise KernelContractError(
            f"MLA KV cache must be [num_blocks, block_size, kv_lora_rank + rope_dim = {kv_lora_rank + rope_dim}], "
            f"got {tuple(kv_cache.shape)}; the cache was not allocated by AscendMLABackend.get_kv_cache_shape"
        )
    if not kv_cache.is_contiguous():
        raise KernelContractError("MLA KV cache must be contiguous (no stride order other than the identity)")
    nb, bs, _ = kv_cache.shape
    flat = kv_cache.view(-1)
    nope = flat[: nb * bs * kv_lora_rank].view(nb, bs, 1, kv_lora_rank)
    rope = flat[nb * bs * kv_lora_rank :].view(nb, bs, 1, rope_dim)
    return nope, rope


def _check_write(
    kv_c: torch.Tensor, k_pe: torch.Tensor, nope: torch.Tensor, rope: torch.Tensor, slots: torch.Tensor
) -> None:
    t = kv_c.shape[0]
    if kv_c.dim() != 2 or k_pe.dim() != 2 or k_pe.shape[0] != t or slots.shape != (t,):
        raise KernelContractError(
            f"mla_cache_write expects kv_c [T, L], k_pe [T, R], slot_mapping [T]; got {tuple(kv_c.shape)}, "
            f"{tuple(k_pe.shape)}, {tuple(slots.shape)}"
        )
    if kv_c.shape[1] != nope.shape[-1] or k_pe.shape[1] != rope.shape[-1]:
        raise KernelContractError(
            f"mla_cache_write: kv_c width {kv_c.shape[1]} / k_pe width {k_pe.shape[1]} do not match the cache planes "
            f"({nope.shape[-1]}, {rope.shape[-1]})"
        )


# --- plain write: the latent (already normalised) and the rotated k_pe go to their slots ---------------------------


def mla_cache_write_reference(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``kv_c [T, L]`` and ``k_pe [T, R]`` to ``nope_cache [nb, bs, 1, L]`` / ``rope_cache [nb, bs, 1, R]`` at
    ``slot_mapping [T]`` (int), in place. Slots < 0 are padding and skipped."""
    _check_write(kv_c, k_pe, nope_cache, rope_cache, slot_mapping)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    nope_cache.view(-1, nope_cache.shape[-1])[slots] = kv_c[valid].to(nope_cache.dtype)
    rope_cache.view(-1, rope_cache.shape[-1])[slots] = k_pe[valid].to(rope_cache.dtype)


def mla_cache_write_npu(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """NPU twin of :func:`mla_cache_write_reference` (``npu_scatter_nd_update_`` per plane)."""
    import torch_npu

    _check_write(kv_c, k_pe, nope_cache, rope_cache, slot_mapping)
    idx = slot_mapping.clamp(min=0).to(torch.int64).view(-1, 1)  # padding -> null block 0 (see module doc)
    torch_npu.npu_scatter_nd_update_(nope_cache.view(-1, nope_cache.shape[-1]), idx, kv_c.to(nope_cache.dtype))
    torch_npu.npu_scatter_nd_update_(rope_cache.view(-1, rope_cache.shape[-1]), idx, k_pe.to(rope_cache.dtype))


MLA_CACHE_WRITE = Kernel("mla_cache_write", npu=mla_cache_write_npu, reference=mla_cache_write_reference)


# --- fused: RMSNorm of the latent, interleaved RoPE of k_pe, and the write (npu_kv_rmsnorm_rope_cache) ------------


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[..., x0, x1, x2, x3, ...] -> [..., x0, x2, ..., x1, x3, ...]``: GPT-J (interleaved) pairs to NeoX halves."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def interleave_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``npu_interleave_rope`` semantics: de-interleave the last dim, then rotate NeoX style with the full-width
    ``cos``/``sin`` (``cos = cat(c, c)`` over the ``R/2`` frequencies; broadcastable to ``x``). The result is in the
    NeoX (de-interleaved) channel order; q and k must both go through it, dot products equal the GPT-J rotation's."""
    xd = deinterleave(x.float())
    x1, x2 = xd.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return (xd * cos.float() + rot * sin.float()).to(x.dtype)


def kv_rmsnorm_rope_cache_reference(
    kv: torch.Tensor,
    gamma: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``npu_kv_rmsnorm_rope_cache`` in ``cache_mode="PA"``.

    ``kv [T, L + R]`` is the ``kv_a_proj_with_mqa`` output (latent first, rope part last); ``gamma [L]`` the
    ``kv_a_layernorm`` weight; ``cos``/``sin`` ``[T, R]`` full-width per-token tables (see
    :func:`interleave_rope_reference`). Computes ``kv_c = rmsnorm(kv[:, :L]) * gamma`` (float32 statistics) and
    ``k_pe = interleave_rope(kv[:, L:])``, writes them to the cache planes at ``slot_mapping`` (slots < 0 skipped)
    and returns ``(k_pe [T, R], kv_c [T, L])`` in ``kv.dtype``.
    """
    L = gamma.shape[0]
    if kv.dim() != 2 or kv.shape[1] != L + rope_cache.shape[-1] or nope_cache.shape[-1] != L:
        raise KernelContractError(
            f"kv_rmsnorm_rope_cache: kv must be [T, L + R] with L={L} (gamma) and R={rope_cache.shape[-1]} "
            f"(rope cache), got {tuple(kv.shape)}"
        )
    c = kv[:, :L].float()
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + epsilon) * gamma.float()
    kv_c = c.to(kv.dtype)
    k_pe = interleave_rope_reference(kv[:, L:], cos, sin)
    mla_cache_write_reference(kv_c, k_pe, nope_cache, rope_cache, slot_mapping)
    return k_pe, kv_c


def kv_rmsnorm_rope_cache_npu(
    kv: torch.Tensor,
    gamma: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NPU twin of :func:`kv_rmsnorm_rope_cache_reference`: one ``torch_npu.npu_kv_rmsnorm_rope_cache`` call
    (4-D ``[T, 1, 1, D]`` inputs, int64 slots; documented only by its meta registration in torch_npu 2.8.0)."""
    import torch_npu

    t = kv.shape[0]
    slots = slot_mapping.clamp(min=0).to(torch.int64)  # padding -> null block 0 (see module doc)
    _, _, k_pe, kv_c = torch_npu.npu_kv_rmsnorm_rope_cache(
        kv.view(t, 1, 1, -1),
        gamma,
        cos.view(t, 1, 1, -1),
        sin.view(t, 1, 1, -1),
        slots,
        rope_cache,
        nope_cache,
        epsilon=epsilon,
        cache_mode="PA",
        is_output_kv=True,
    )
    return k_pe.view(t, -1), kv_c.view(t, -1)


KV_RMSNORM_ROPE_CACHE = Kernel(
    "kv_rmsnorm_rope_cache", npu=kv_rmsnorm_rope_cache_npu, reference=kv_rmsnorm_rope_cache_reference
)


# --- paged load: a slice of each request's cached context, made contiguous -----------------------------------------


def paged_cache_load_reference(
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    seq_starts: torch.Tensor,
    total: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather, for each request ``b``, cached tokens ``[seq_starts[b], seq_starts[b] + context_lens[b])`` (positions
    within the request, in tokens) and concatenate them over the batch.

    ``block_table [B, max_blocks]`` int32, ``context_lens``/``seq_starts`` ``[B]`` int (CPU or device); ``total`` is
    ``sum(context_lens)`` when the caller knows it on the host (it saves the NPU twin a device-to-host read).
    Returns ``kv_c [S, L]`` and ``k_pe [S, R]`` with ``S = sum(context_lens)``, in request order.
    """
    bs = nope_cache.shape[1]
    lens = context_lens.to(device="cpu", dtype=torch.int64)
    if total is not None and total != int(lens.sum()):
        raise KernelContractError(f"paged_cache_load: total={total} but context_lens sum to {int(lens.sum())}")
    total = int(lens.sum())
    if total == 0:
        return nope_cache.new_empty(0, nope_cache.shape[-1]), rope_cache.new_empty(0, rope_cache.shape[-1])
    device = block_table.device
    req = torch.repeat_interleave(torch.arange(lens.numel()), lens).to(device)
    cu = torch.cumsum(lens, 0) - lens
    pos = (torch.arange(total) - torch.repeat_interleave(cu, lens)).to(device)
    pos = pos + seq_starts.to(device=device, dtype=torch.int64)[req]
    slots = block_table[req, pos // bs].long() * bs + pos % bs
    kv_c = nope_cache.view(-1, nope_cache.shape[-1])[slots]
    k_pe = rope_cache.view(-1, rope_cache.shape[-1])[slots]
    return kv_c, k_pe


def paged_cache_load_npu(
    nope_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    seq_starts: torch.Tensor,
    total: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NPU twin of :func:`paged_cache_load_reference` (``torch_npu.atb.npu_paged_cache_load``; the latent plane
    is passed as its "key" cache, the rope plane as its "value" cache).

    The outputs are allocated here from ``total`` and passed as ``key=``/``value=``: without them the 2.8.0 binding
    sizes its outputs itself with one ``context_lens[i].item()`` per request (op-plugin 7.2.0
    ``PagedCacheLoadAtb.cpp``), a host sync per request, chunk and layer. vllm-ascend v0.11.0 passes them too."""
    import torch_npu

    dev = nope_cache.device
    lens = context_lens.to(device=dev, dtype=torch.int32)
    if total is None:
        total = int(lens.sum())  # one sync; callers that know the total pass it
    key = nope_cache.new_empty(total, *nope_cache.shape[2:])
    value = rope_cache.new_empty(total, *rope_cache.shape[2:])
    if total == 0:  # nothing to load (the kernel's docs give no zero-token case)
        return key.view(0, -1), value.view(0, -1)
    torch_npu.atb.npu_paged_cache_load(
        nope_cache,
        rope_cache,
        block_table.to(torch.int32),
        lens,
        seq_starts=seq_starts.to(device=dev, dtype=torch.int32),
        key=key,
        value=value,
    )
    return key.view(total, -1), value.view(total, -1)


PAGED_CACHE_LOAD = Kernel("paged_cache_load", npu=paged_cache_load_npu, reference=paged_cache_load_reference)
