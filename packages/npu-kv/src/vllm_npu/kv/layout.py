# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Where a request's KV blocks live in memory, and how blocks of one instance map onto another's.

A layer's paged cache is described as *planes*: runs of ``num_blocks`` equal blocks, block ``b`` of a plane at
``base + plane.offset + b * plane.block_bytes``. The npu-attention caches are:

- GQA ``(2, num_blocks, block_size, num_kv_heads, head_size)``: two planes (K, V); a block is token-major
  ``[block_size, num_kv_heads, head_size]``, so a tensor-parallel rank's heads are a strided part of it;
- MLA ``(num_blocks, block_size, kv_lora_rank + rope_dim)``, which the MLA backend reads as two planes, the nope
  latent ``[num_blocks, block_size, kv_lora_rank]`` followed by the rope keys ``[num_blocks, block_size, rope_dim]``
  (``vllm_npu.attention.ops.mla_cache.latent_cache_planes``); one latent per token, the same on every TP rank;
- any other 3-D cache ``(num_blocks, block_size, width)`` (the sparse-attention indexer's keys): one plane,
  replicated over TP ranks.

A GQA block moves as one contiguous copy when both sides hold the same heads; when the prefill and decode
tensor-parallel sizes differ, the decode rank reads each prefill rank's blocks into a staging buffer and
:func:`scatter_heads` puts that rank's heads into their place (:func:`scatter_heads_reference` is its plain-loop twin).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm_npu.interface import NPUPluginError


class LayoutError(NPUPluginError, ValueError):
    """Two instances' caches that cannot be mapped onto each other (or a cache this connector does not know)."""


@dataclass(frozen=True)
class Plane:
    """``num_blocks`` blocks of ``block_bytes`` bytes at ``offset`` bytes from the layer's base address. A block holds
    ``block_size`` tokens of ``heads`` heads of ``head_bytes`` bytes each (``heads == 1`` for latent caches)."""

    offset: int
    block_bytes: int
    heads: int
    head_bytes: int


@dataclass(frozen=True)
class LayerLayout:
    """One cache layer: its base address, block count and planes; ``replicated`` when every TP rank holds the same
    data (MLA, indexer), False when the ranks split the KV heads (GQA)."""

    name: str
    base: int
    num_blocks: int
    planes: tuple[Plane, ...]
    replicated: bool

    @property
    def nbytes(self) -> int:
        return sum(p.block_bytes for p in self.planes) * self.num_blocks

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "base": self.base,
            "num_blocks": self.num_blocks,
            "planes": [[p.offset, p.block_bytes, p.heads, p.head_bytes] for p in self.planes],
            "replicated": self.replicated,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayerLayout:
        planes = tuple(Plane(*(int(x) for x in p)) for p in data["planes"])
        return cls(str(data["name"]), int(data["base"]), int(data["num_blocks"]), planes, bool(data["replicated"]))


def describe_layer(name: str, cache: torch.Tensor, kv_lora_rank: int | None = None) -> LayerLayout:
    """The layout of one layer's cache tensor as npu-attention allocates it (see the module docstring).

    ``kv_lora_rank`` is the model's MLA latent width (None for non-MLA models): a 3-D cache whose last dimension is
    larger than it is an MLA cache with two planes.
    """
    if not cache.is_contiguous():
        raise LayoutError(
            f"KV cache {name} is not contiguous (stride {cache.stride()}); the connector needs the "
            "identity stride order the npu-attention backends allocate"
        )
    es = cache.element_size()
    planes: tuple[Plane, ...]
    if cache.dim() == 5 and cache.shape[0] == 2:
        _, nb, bs, heads, head = cache.shape
        block = bs * heads * head * es
        planes = (Plane(0, block, heads, head * es), Plane(nb * block, block, heads, head * es))
        return LayerLayout(name, cache.data_ptr(), nb, planes, replicated=False)
    if cache.dim() == 3:
        nb, bs, width = cache.shape
        if kv_lora_rank is not None and 0 < kv_lora_rank < width:
            rope = width - kv_lora_rank
            planes = (
                Plane(0, bs * kv_lora_rank * es, 1, kv_lora_rank * es),
                Plane(nb * bs * kv_lora_rank * es, bs * rope * es, 1, rope * es),
            )
        else:
            planes = (Plane(0, bs * width * es, 1, width * es),)
        return LayerLayout(name, cache.data_ptr(), nb, planes, replicated=True)
    raise LayoutError(
        f"KV cache {name} has shape {tuple(cache.shape)}; the connector knows the npu-attention caches "
        "(2, blocks, block_size, kv_heads, head_size) for GQA and (blocks, block_size, width) for MLA/indexer"
    )


@dataclass(frozen=True)
class HeadSlice:
    """Prefill rank ``src_rank`` supplies heads ``[src_start, src_start + count)`` of its own, which go to heads
    ``[dst_start, dst_start + count)`` of the decode rank."""

    src_rank: int
    src_start: int
    dst_start: int
    count: int


def head_sources(
    local_rank: int, local_tp: int, local_heads: int, remote_tp: int, remote_heads: int
) -> list[HeadSlice]:
    """Which prefill ranks hold the KV heads of decode rank ``local_rank``, when the ranks split heads evenly.

    Rank ``r`` of a TP group of size ``t`` with ``h`` heads per rank holds the global heads ``[r*h, (r+1)*h)``.
    Equal total heads on both sides are required: replicated heads (``num_kv_heads < tensor_parallel_size``) only
    map between equal TP sizes.
    """
    if local_tp == remote_tp and local_heads == remote_heads:
        return [HeadSlice(local_rank, 0, 0, local_heads)]
    if local_heads * local_tp != remote_heads * remote_tp:
        raise LayoutError(
            f"cannot map KV heads between prefill TP={remote_tp} ({remote_heads} heads per rank) and decode "
            f"TP={local_tp} ({local_heads} heads per rank): the totals differ, which happens when a model has fewer "
            "KV heads than the tensor-parallel size (replicated heads); use equal TP sizes for such a model"
        )
    lo, hi = local_rank * local_heads, (local_rank + 1) * local_heads
    out = []
    for r in range(remote_tp):
        rlo, rhi = r * remote_heads, (r + 1) * remote_heads
        start, end = max(lo, rlo), min(hi, rhi)
        if start < end:
            out.append(HeadSlice(r, start - rlo, start - lo, end - start))
    return out


def block_runs(local: Sequence[int], remote: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group paired block ids into runs ``(local_start, remote_start, length)`` that are consecutive on both sides,
    so that each run moves in one copy."""
    if len(local) != len(remote):
        raise LayoutError(f"{len(local)} local blocks for {len(remote)} remote blocks")
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local, remote):
        if runs and runs[-1][0] + runs[-1][2] == lb and runs[-1][1] + runs[-1][2] == rb:
            ls, rs, n = runs[-1]
            runs[-1] = (ls, rs, n + 1)
        else:
            runs.append((lb, rb, 1))
    return runs


def plane_view(cache: torch.Tensor, layout: LayerLayout, plane: int) -> torch.Tensor:
    """Plane ``plane`` of a layer's cache as ``[num_blocks, block_size, heads, head_elems]`` (a view)."""
    p = layout.planes[plane]
    es = cache.element_size()
    flat = cache.view(-1)
    start = p.offset // es
    count = layout.num_blocks * p.block_bytes // es
    head_elems = p.head_bytes // es
    return flat[start : start + count].view(layout.num_blocks, -1, p.heads, head_elems)


def scatter_heads(
    staged: torch.Tensor, dst_plane: torch.Tensor, block_ids: Sequence[int], src_start: int, dst_start: int, count: int
) -> None:
    """Copy heads ``[src_start, src_start+count)`` of ``staged [n, block_size, src_heads, e]`` into heads
    ``[dst_start, dst_start+count)`` of blocks ``block_ids`` (``n`` of them) of ``dst_plane [nb, block_size, heads,
    e]``, in place. One indexed copy; a plain torch op, the same on every device."""
    if staged.shape[0] != len(block_ids):
        raise LayoutError(f"{staged.shape[0]} staged blocks for {len(block_ids)} block ids")
    if not block_ids:
        return
    index = torch.tensor(list(block_ids), dtype=torch.long, device=dst_plane.device)
    heads = dst_plane[index]  # [n, bs, heads, e], a copy
    heads[:, :, dst_start : dst_start + count] = staged[:, :, src_start : src_start + count]
    dst_plane.index_copy_(0, index, heads)


def scatter_heads_reference(
    staged: torch.Tensor, dst_plane: torch.Tensor, block_ids: Sequence[int], src_start: int, dst_start: int, count: int
) -> None:
    """:func:`scatter_heads`' twin: block by block, head by head."""
    for i, b in enumerate(block_ids):
        for h in range(count):
            dst_plane[b, :, dst_start + h].copy_(staged[i, :, src_start + h])
