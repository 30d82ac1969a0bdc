# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Multimodal RoPE (Qwen2-VL / Qwen2.5-VL sections): ``npu_mrope`` where its contract fits, else the generic path.

``npu_mrope(positions, query, key, cos_sin_cache, head_size, *, mrope_section, rotary_mode) -> (q, k)``
(torch_npu 2.8.0 docs):

- ``positions [T]`` (plain RoPE; ``mrope_section=[0, 0, 0]``) or ``[3, T]`` (T/H/W positions), int32/int64;
- ``query [T, Nq*D]``, ``key [T, Nk*D]`` (2-D only), ``cos_sin_cache [P, R]`` (cos | sin halves);
- with sections ``(s_t, s_h, s_w)``, ``s_t + s_h + s_w == R / 2``: frequency ``j`` of cos/sin takes its position
  from row 0 for ``j < s_t``, row 1 for the next ``s_h``, row 2 for the last ``s_w``;
- ``rotary_dim`` must be a multiple of 32 for fp16/bf16 and of 16 for fp32.

The kernel is used when the layer is NeoX style, not interleaved-MRoPE, rotates the whole head and meets the
alignment above; the choice is made when the layer is built. Otherwise cos/sin (sections merged) are gathered once
per forward and applied with ``npu_rotary_mul`` like the base RoPE.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding, apply_interleaved_rope
from vllm_npu.interface import Kernel

from .rotary_embedding import _NPURopeMixin, build_partial_rotate, expand_cos_sin, rotary_mul_reference

_NO_SECTIONS = [0, 0, 0]


def mrope_npu(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    mrope_section: list[int],
    rotary_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch_npu

    return torch_npu.npu_mrope(
        positions, query, key, cos_sin_cache, head_size, mrope_section=mrope_section, rotary_mode=rotary_mode
    )


def merge_sections(cos_sin: torch.Tensor, sections: list[int]) -> torch.Tensor:
    """``[3, T, R/2]`` per-axis halves -> ``[T, R/2]``: section ``i`` of the frequencies takes axis ``i``."""
    return torch.cat([part[i] for i, part in enumerate(cos_sin.split(sections, dim=-1))], dim=-1)


def mrope_reference(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    mrope_section: list[int],
    rotary_mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    if positions.ndim == 2:
        cos, sin = merge_sections(cos, mrope_section), merge_sections(sin, mrope_section)
    cos4, sin4 = expand_cos_sin(cos, sin, rotary_mode == "half")
    rotate = build_partial_rotate(rotary_mul_reference, rotary_mode, head_size, cos_sin_cache.shape[-1])
    return rotate(query, cos4, sin4), rotate(key, cos4, sin4)


MROPE = Kernel("mrope", npu=mrope_npu, reference=mrope_reference)


class NPUMRotaryEmbedding(_NPURopeMixin, MRotaryEmbedding):
    """vLLM's MRotaryEmbedding. ``positions [T]`` or ``[3, T]``, ``query [T, Nq*D]``, ``key [T, Nk*D]``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_npu_rope()
        align = 16 if self.dtype == torch.float32 else 32
        self.uses_mrope_kernel = (
            self.is_neox_style
            and not self.mrope_interleaved
            and self.rotary_dim == self.head_size
            and self.rotary_dim % align == 0
            and (not self.mrope_section or len(self.mrope_section) == 3)
        )
        self._mrope = MROPE.select()
        self._sections = list(self.mrope_section) if self.mrope_section else None

    def _compute_cos_sin(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._match_cos_sin_cache_dtype(like)
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        if positions.ndim == 2:
            sections = self._sections
            assert sections is not None  # forward_oot rejects 3-D positions on a layer without sections
            if self.mrope_interleaved:
                cos, sin = apply_interleaved_rope(cos, sections), apply_interleaved_rope(sin, sections)
            else:
                cos, sin = merge_sections(cos, sections), merge_sections(sin, sections)
        return expand_cos_sin(cos, sin, self.is_neox_style)

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if positions.ndim not in (1, 2) or key is None:
            raise ValueError("MRotaryEmbedding needs positions [T] or [3, T] and a key tensor")
        if offsets is not None:
            positions = positions + offsets
        if positions.ndim == 2 and not self._sections:  # the one check for both paths below
            raise ValueError("3-D (T/H/W) positions need mrope_section; this MRotaryEmbedding has none")
        if self.uses_mrope_kernel:
            sections = self._sections if positions.ndim == 2 and self._sections else _NO_SECTIONS
            self._match_cos_sin_cache_dtype(query)
            q, k = self._mrope(
                positions,
                query.reshape(query.shape[0], -1),
                key.reshape(key.shape[0], -1),
                self.cos_sin_cache,
                self.head_size,
                sections,
                "half",
            )
            return q.reshape(query.shape), k.reshape(key.shape)
        return self._rope_forward(positions, query, key)
