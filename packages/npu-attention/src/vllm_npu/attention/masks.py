# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Attention masks in the forms the Ascend attention kernels take, built once and cached per device.

Three kinds (the NPU kernels read them; the reference kernels compute masks from positions and never need them):

- the **splitfuse mask**: ``int8 [2048, 2048]``, ``1`` = masked, ``triu(ones, diagonal=1)``. The compressed causal
  mask of ``npu_fused_infer_attention_score`` for ``sparse_mode=3`` (right-down causal) and ``sparse_mode=4`` (band);
  the kernel shifts it per request, so one fixed 2048 mask serves every query/key length.
- the **float causal mask** for flash prefill without cache: ``[S, S]`` in the model dtype, ``0`` where a query may
  attend and the dtype's masked value elsewhere (``-inf`` for fp16/fp32; ``1`` for bf16, which the ATB flash kernel
  takes as a mask flag and scales itself). Cached and grown on demand to the longest sequence seen; callers get a
  ``[:S, :S]`` view.
- the **Ascend 310P masks** (NZ tiles of 16, :mod:`.ops.nz`): the first-prefill causal mask of the batch's longest
  sequence, and the chunked-prefill mask (row ``t``: the causal row at token ``t``'s position). Built on both
  backends on a 310P: the NPU kernels take them, the reference twins read them back through their NZ layout.
- the **pooling mask**: ``bool [2048, 2048]`` ``triu(diagonal=1)`` for ``npu_fusion_attention`` band mode used by
  encoder-only (bidirectional) attention; the band width passed with it decides what is attended.
"""

from __future__ import annotations

import torch

from .ops.nz import nd_to_nz

COMPRESSED_MASK_SIZE = 2048


def masked_value(dtype: torch.dtype) -> float:
    """The value that marks a masked position in a float causal mask of ``dtype``."""
    if dtype == torch.bfloat16:
        return 1.0
    if dtype in (torch.float16, torch.float32):
        return float("-inf")
    raise ValueError(f"no float attention mask for dtype {dtype}; use float16, bfloat16 or float32")


class AttentionMaskBuilder:
    """Builds and caches the attention masks of one device. Not thread-safe; one per metadata builder."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._splitfuse: torch.Tensor | None = None
        self._pooling: torch.Tensor | None = None
        self._causal: dict[torch.dtype, torch.Tensor] = {}

    def splitfuse_mask(self) -> torch.Tensor:
        """``int8 [2048, 2048]``, 1 above the diagonal (masked), 0 on and below it."""
        if self._splitfuse is None:
            ones = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.int8, device=self.device)
            self._splitfuse = torch.triu(ones, diagonal=1)
        return self._splitfuse

    def pooling_mask(self) -> torch.Tensor:
        """``bool [2048, 2048]``, True above the diagonal."""
        if self._pooling is None:
            ones = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=self.device)
            self._pooling = torch.triu(ones, diagonal=1)
        return self._pooling

    def causal_mask(self, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
        """``[seq_len, seq_len]`` float causal mask of ``dtype`` (0 allowed, :func:`masked_value` above the diagonal).

        The cached tensor grows (to at least double) when a longer sequence is asked for, so a run that sees
        increasing lengths rebuilds O(log n) times.
        """
        if seq_len <= 0:
            raise ValueError(f"causal mask length must be positive, got {seq_len}")
        cached = self._causal.get(dtype)
        if cached is None or cached.shape[0] < seq_len:
            size = max(seq_len, 2 * cached.shape[0] if cached is not None else 128)
            allowed = torch.ones(size, size, dtype=torch.bool, device=self.device).tril_()
            mask = torch.zeros(size, size, dtype=dtype, device=self.device)
            mask.masked_fill_(~allowed, masked_value(dtype))
            self._causal[dtype] = cached = mask
        return cached[:seq_len, :seq_len]

    def prefill_mask_nz(self, seq_lens: list[int], dtype: torch.dtype) -> torch.Tensor:
        """310P first prefill: the ``[S, S]`` causal mask (S = ``max(seq_lens)``) in NZ, ``[1, S16 / 16, S16, 16]``
        (vllm-ascend v0.11.0 ``attention/attention_v1.py:253-256``: ``nd_to_nz_2d`` of the runner's mask of the
        longest sequence, ``worker/model_runner_v1.py:910-913``)."""
        return nd_to_nz(self.causal_mask(max(seq_lens), dtype))

    def splitfuse_mask_nz(self, query_lens: list[int], seq_lens: list[int], dtype: torch.dtype) -> torch.Tensor:
        """310P chunked prefill: row ``t`` is the causal mask's row at new token ``t``'s position (request ``b``'s
        new tokens sit at ``seq_lens[b] - query_lens[b]`` onwards), columns up to ``S = max(seq_lens)``, in NZ:
        ``[1, S16 / 16, T16, 16]`` (vllm-ascend v0.10.0rc1 ``attention/attention_mask.py``
        ``get_splitfuse_attn_mask`` + ``utils.py`` ``nd_to_nz_spec``)."""
        causal = self.causal_mask(max(seq_lens), dtype)
        positions = torch.cat([torch.arange(n - q, n, device=self.device) for q, n in zip(query_lens, seq_lens)])
        return nd_to_nz(causal[positions])
