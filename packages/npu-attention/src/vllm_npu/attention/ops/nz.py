# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""FRACTAL_NZ tiles of 16, the layout the Ascend 310P (Atlas 300I) attention kernels read, as plain tensors.

NZ stores a matrix ``[M, N]`` as column tiles of 16: ``nz[c, m, i] = nd[m, 16 * c + i]`` (``M`` and ``N`` padded to
multiples of 16 with zeros), i.e. the 4-D ND tensor ``[1, N16 / 16, M16, 16]``. Its bytes are the NZ format's
bytes, so the same tensor is what the NPU kernels get (after ``npu_format_cast(..., 29)`` tags it) and what the
reference twins read back tile by tile: a tile or transpose error in the layout shows on the emulated device.

- :func:`nd_to_nz`: ``[M, N]`` -> ``[1, N16 / 16, M16, 16]`` (vllm-ascend v0.11.0 ``utils.py`` ``nd_to_nz_2d`` for the
  first-prefill mask and ``nd_to_nz_spec`` for the chunked-prefill mask: both pad, tile and transpose the same way).
- :func:`nz_to_nd`: the inverse, ``[..., N16 / 16, M16, 16]`` -> ``[..., M16, N16]`` (the twins' reading).
- The KV cache: ``[num_blocks, Nkv * D / 16, block_size, 16]`` per K and V (vllm-ascend v0.11.0
  ``attention/attention_v1.py:72-74``; torch_npu 2.8.0 ATB docs, ``_npu_paged_attention_v2``: "Atlas 推理系列产品：
  [num_blocks, head_size * num_heads / 16, block_size, 16], 支持NZ格式"): block ``b``'s ``[block_size, Nkv * D]``
  matrix in NZ. Token ``s`` of block ``b``, hidden index ``h = n * D + d``, lives at ``cache[b, h // 16, s, h % 16]``.
  :func:`nz_cache_tokens` reads tokens back as ``[..., Nkv, D]``.
- :func:`aligned_16`: dim 0 zero-padded to a multiple of 16 (vllm-ascend ``utils.py`` ``aligned_16``; the 310P flash
  kernel's token count is the batch's total rounded up to 16: ATB docs, ``_npu_flash_attention_v2``, constraint 4).
"""

from __future__ import annotations

import torch

NZ_TILE = 16
#: ``torch_npu.npu_format_cast`` format id of FRACTAL_NZ (ACL ``aclFormat``; vllm-ascend ``ACL_FORMAT_FRACTAL_NZ``).
ACL_FORMAT_FRACTAL_NZ = 29


def round_up_16(n: int) -> int:
    return -(-n // NZ_TILE) * NZ_TILE


def nd_to_nz(matrix: torch.Tensor) -> torch.Tensor:
    """``[M, N]`` -> contiguous ``[1, ceil(N / 16), M16, 16]`` (zero padding)."""
    if matrix.dim() != 2:
        raise ValueError(f"nd_to_nz takes a 2-D matrix, got shape {tuple(matrix.shape)}")
    m, n = matrix.shape
    m16, n16 = round_up_16(m), round_up_16(n)
    padded = torch.nn.functional.pad(matrix, (0, n16 - n, 0, m16 - m))
    return padded.reshape(1, m16, n16 // NZ_TILE, NZ_TILE).transpose(1, 2).contiguous()


def nz_to_nd(nz: torch.Tensor) -> torch.Tensor:
    """``[..., N16 / 16, M16, 16]`` -> ``[..., M16, N16]`` (the padded matrix back)."""
    *lead, c, m16, tile = nz.shape
    if tile != NZ_TILE:
        raise ValueError(f"an NZ tensor ends in tiles of {NZ_TILE}, got shape {tuple(nz.shape)}")
    return nz.transpose(-3, -2).reshape(*lead, m16, c * NZ_TILE)


def nz_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """The 310P GQA KV cache: ``(2, num_blocks, Nkv * D / 16, block_size, 16)``."""
    hidden = num_kv_heads * head_size
    if hidden % NZ_TILE:
        raise ValueError(
            f"num_kv_heads * head_size = {hidden} is not a multiple of {NZ_TILE}: the Ascend 310P KV cache is stored "
            "in NZ tiles of 16"
        )
    return (2, num_blocks, hidden // NZ_TILE, block_size, NZ_TILE)


def nz_cache_tokens(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, head_size: int) -> torch.Tensor:
    """The cached tokens at ``(blocks[i], offsets[i])`` of an NZ cache ``[nb, H / 16, bs, 16]``: ``[T, H / D, D]``."""
    tiles = cache[blocks.long(), :, offsets.long()]  # [T, H / 16, 16]
    return tiles.reshape(tiles.shape[0], -1, head_size)


def nz_cache_sequence(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int, head_size: int) -> torch.Tensor:
    """One request's first ``seq_len`` cached tokens of an NZ cache: ``[seq_len, Nkv, D]``."""
    block_size = cache.shape[2]
    pos = torch.arange(seq_len, device=cache.device)
    return nz_cache_tokens(cache, block_row[pos // block_size], pos % block_size, head_size)


def aligned_16(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with dim 0 zero-padded to a multiple of 16 (``tensor`` itself when already aligned)."""
    n = tensor.shape[0]
    if n % NZ_TILE == 0:
        return tensor
    padded = tensor.new_zeros(round_up_16(n), *tensor.shape[1:])
    padded[:n] = tensor
    return padded
