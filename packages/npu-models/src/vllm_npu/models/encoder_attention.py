# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The one NPU seam of the multimodal encoders beyond the Qwen-VL towers: their attention on npu-attention's
``vision_attention`` kernel (``torch_npu._npu_flash_attention_unpad``; reference twin on the emulated device).

The encoders of the families npu-models serves fall in two kinds, and both end in the same kernel call:

* **vLLM-built ViTs** (SigLIP of Gemma-3, Idefics2/SigLIP of MiniCPM-V, InternViT of InternVL): every block's
  attention is vLLM's ``MultiHeadAttention`` (``vllm/attention/layer.py``), which picks FLASH_ATTN / XFORMERS /
  TORCH_SDPA / PALLAS / ROCM_AITER_FA in ``__init__`` with no platform seam for another kernel. Each instance is
  re-classed in place to :class:`AscendMultiHeadAttention` (same module, same state; only ``forward`` differs): the
  ``B`` images of a call are ``B`` sequences of ``S`` tokens, so the kernel's host-side ``seq_len`` is built from
  Python ints (no device read) and its packed ``[B * S, N, D]`` layout is a view of vLLM's ``[B, S, N * D]``.
* **transformers-built audio encoders** (``Qwen2AudioEncoder`` of Qwen2-Audio, ``Qwen2_5OmniAudioEncoder`` of the
  Qwen2.5-Omni thinker; vLLM instantiates transformers' classes): their attention asks transformers'
  ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``. :func:`npu_encoder_attention` is registered there as
  :data:`HF_ATTENTION` and the tower's config points at it: Qwen2.5-Omni passes ``cu_seq_lens_q`` (packed chunks,
  the kernel's native layout); Qwen2-Audio passes a key-padding mask (``-inf`` from each audio's length on), read
  back as per-row lengths. A mask of any other shape is not guessed at: that call runs transformers' SDPA.

Head dims: vllm-ascend v0.11.0 calls ``_npu_flash_attention_unpad`` unpadded at the tower's own head dim
(``qwen2_5_vl_without_padding.py``: Qwen3-VL's 72, Qwen2.5-VL's 80), so the encoders here run unpadded too (SigLIP
so400m 72, InternViT-300M 64, Whisper-style audio 64/80); padding them would need per-family weight surgery.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from vllm.attention.layer import MultiHeadAttention
from vllm_npu.attention import VISION_ATTENTION
from vllm_npu.interface import get_logger, once

from .vision import TensorMemo

logger = get_logger(__name__)

#: The name :func:`npu_encoder_attention` is registered under in transformers' ``AttentionInterface``.
HF_ATTENTION = "npu_encoder"

#: Host-side sequence lengths per ``cu_seq_lens_q`` / mask tensor: every layer of an encoder forward gets the very
#: same tensor, so the device read happens once per forward, not once per layer.
SEQ_LENS_MEMO = TensorMemo(slots=2)


def _kernel() -> Callable[..., None]:
    kernel: Callable[..., None] = VISION_ATTENTION.select()
    return kernel


def attend_packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: list[int],
    *,
    scale: float,
    kernel: Callable[..., None] | None = None,
) -> torch.Tensor:
    """Bidirectional attention within each of the packed sequences: ``query [T, N, D]``, ``key/value [T, Nkv, D]``,
    ``seq_lens`` the per-sequence token counts (host ints summing to T) -> ``[T, N, D]`` in query's dtype."""
    q, k, v = (t.contiguous() for t in (query, key, value))
    out = torch.empty_like(q)
    lens = torch.tensor(seq_lens, dtype=torch.int32)  # host tensor from host ints: no device read
    (kernel or _kernel())(q, k, v, lens, num_heads=q.shape[1], num_kv_heads=k.shape[1], scale=scale, out=out)
    return out


class AscendMultiHeadAttention(MultiHeadAttention):
    """vLLM's encoder ``MultiHeadAttention`` on the NPU kernel (see the module doc); instances are vLLM's, re-classed
    by :func:`adopt_encoder_attention`.

    ``forward(query [B, S, N * D] or [B, S, N, D], key/value [B, S, Nkv * D] or [B, S, Nkv, D]) -> [B, S, N * D]``,
    vLLM's contract. Key and value shorter or longer than the query (cross attention, which none of the served
    encoders does through this class) run vLLM's own forward."""

    npu_calls: int
    _vision_attention: Callable[..., None]
    #: Valid (prefix) length of each batch row for the calls inside :func:`key_padding`; None: every row is full.
    row_lens: list[int] | None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        bsz, q_len = query.shape[:2]
        if key.shape[1] != q_len:
            out: torch.Tensor = super().forward(query, key, value)
            return out
        n, nkv, d = self.num_heads, self.num_kv_heads, self.head_size
        lens = self.row_lens
        self.npu_calls += 1
        if lens is not None and len(lens) == bsz and any(m != q_len for m in lens):
            # Padded rows: attend each row's valid prefix only (packed); padded query positions get zeros.
            q4, k4, v4 = query.view(bsz, q_len, n, d), key.view(bsz, q_len, nkv, d), value.view(bsz, q_len, nkv, d)
            pq, pk, pv = (torch.cat([t[b, :m] for b, m in enumerate(lens)]) for t in (q4, k4, v4))
            packed = attend_packed(pq, pk, pv, lens, scale=self.scale, kernel=self._vision_attention)
            padded = query.new_zeros(bsz, q_len, n, d)
            offset = 0
            for b, m in enumerate(lens):
                padded[b, :m] = packed[offset : offset + m]
                offset += m
            return padded.view(bsz, q_len, n * d)
        q = query.reshape(bsz * q_len, n, d)
        k = key.reshape(bsz * q_len, nkv, d)
        v = value.reshape(bsz * q_len, nkv, d)
        out = attend_packed(q, k, v, [q_len] * bsz, scale=self.scale, kernel=self._vision_attention)
        return out.view(bsz, q_len, n * d)


def prefix_lengths(mask: torch.Tensor) -> list[int] | None:
    """Per-row valid lengths of a boolean key-padding ``mask [B, S]`` whose rows are True on a prefix (and False
    after), else None. One device-to-host copy of the mask."""
    host = mask.to("cpu", torch.bool)
    lens = host.sum(-1)
    expected = torch.arange(host.shape[-1])[None, :] < lens[:, None]
    if not bool((host == expected).all()):
        return None
    return [int(m) for m in lens.tolist()]


@contextlib.contextmanager
def key_padding(module: nn.Module, row_lens: list[int] | None) -> Iterator[None]:
    """Within the block, every :class:`AscendMultiHeadAttention` under ``module`` attends, in batch row ``b``, the
    first ``row_lens[b]`` tokens only (as queries and keys; padded query rows give zeros). None: rows are full."""
    attns = [m for m in module.modules() if isinstance(m, AscendMultiHeadAttention)]
    for attn in attns:
        attn.row_lens = row_lens
    try:
        yield
    finally:
        for attn in attns:
            attn.row_lens = None


def _padding_lengths(mask: torch.Tensor, batch: int, length: int) -> list[int] | None:
    """Per-row valid lengths if ``mask`` ``[B, 1, S, S]`` is a key-padding mask (every query row of batch row ``b``
    is 0 on keys ``< len_b`` and ``-inf`` from there on), else None."""
    if mask.dim() != 4 or tuple(mask.shape) != (batch, 1, length, length):
        return None
    keep = mask[:, 0] == 0  # [B, S, S]
    lens = keep[:, 0].sum(-1)  # [B]
    expected = torch.arange(length, device=mask.device)[None, :] < lens[:, None]
    if not bool((keep == expected[:, None, :]).all()):
        return None
    return [int(n) for n in lens.tolist()]


def npu_encoder_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract for a bidirectional encoder: ``query [B, N, S, D]``,
    ``key/value [B, Nkv, S, D]`` -> ``([B, S, N, D], None)``. Sequences come from ``cu_seq_lens_q`` (packed, B = 1),
    else from a key-padding ``attention_mask`` (positions past a row's length get zeros: the encoders' callers drop
    them), else each batch row is one sequence. Any other mask runs transformers' SDPA."""
    if dropout:
        raise ValueError("npu_encoder_attention: dropout is a training feature; the NPU encoder path is inference only")
    bsz, n, length, d = query.shape
    scale = d**-0.5 if scaling is None else scaling
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    lens: list[int] | None
    if cu_seqlens is not None and bsz == 1:
        lens = SEQ_LENS_MEMO.get(cu_seqlens, lambda t: [int(x) for x in t.diff().tolist()])
    elif attention_mask is None:
        lens = [length] * bsz
    else:
        lens = SEQ_LENS_MEMO.get(attention_mask, lambda m: _padding_lengths(m, bsz, length))
        if lens is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            once(
                "vllm_npu.models.encoder_attention:sdpa_fallback",
                lambda: logger.warning(
                    "npu_encoder_attention: a mask that is no key-padding mask runs transformers' SDPA"
                ),
            )
            out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
            return out, None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, N, D]
    if attention_mask is not None and cu_seqlens is None and lens != [length] * bsz:
        # Pack each row's valid prefix; padded query positions get zeros.
        pick = [(b, m) for b, m in enumerate(lens)]
        pq, pk, pv = (torch.cat([t[b, :m] for b, m in pick]) for t in (q, k, v))
        out_packed = attend_packed(pq, pk, pv, lens, scale=scale)
        out = q.new_zeros(q.shape)
        offset = 0
        for b, m in pick:
            out[b, :m] = out_packed[offset : offset + m]
            offset += m
        return out, None
    fq, fk, fv = (t.reshape(bsz * length, -1, d) for t in (q, k, v))
    out = attend_packed(fq, fk, fv, lens, scale=scale)
    return out.view(bsz, length, n, d), None


def register_hf_attention() -> None:
    """Register :func:`npu_encoder_attention` as :data:`HF_ATTENTION` in transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION, npu_encoder_attention)


def adopt_encoder_attention(model: nn.Module, *, hf_towers: tuple[str, ...] = ()) -> int:
    """Put the encoders of ``model`` on the NPU kernel, in place; returns how many attentions were converted.

    Every vLLM ``MultiHeadAttention`` under ``model`` becomes an :class:`AscendMultiHeadAttention`; each attribute
    named in ``hf_towers`` (a transformers-built encoder, e.g. ``"audio_tower"``; absent or None: skipped) gets its
    config's attention implementation set to :data:`HF_ATTENTION` (each of its ``*Attention`` modules counted)."""
    kernel = _kernel()
    count = 0
    for module in model.modules():
        if type(module) is MultiHeadAttention:
            module.__class__ = AscendMultiHeadAttention
            attn: Any = module
            attn.npu_calls, attn._vision_attention, attn.row_lens = 0, kernel, None
            count += 1
    for name in hf_towers:
        tower = getattr(model, name, None)
        if tower is None:
            continue
        register_hf_attention()
        tower.config._attn_implementation = HF_ATTENTION
        count += sum(1 for m in tower.modules() if type(m).__name__.endswith("Attention"))
    return count
