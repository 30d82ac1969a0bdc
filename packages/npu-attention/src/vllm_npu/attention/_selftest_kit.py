# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Builders shared by the attention layer's selftest cases (:mod:`.selftest`, :mod:`._selftest_mla`): block tables,
slots, paged inputs and latent-cache planes laid out as the metadata builders and the MLA backend lay them out."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch
from vllm_npu.interface import Kernel, KernelCall, KernelCase, randn, randperm

from .ops.mla_cache import latent_cache_planes

HALVES = ("bfloat16", "float16")
L, R, P, V = 512, 64, 128, 128  # DeepSeek MLA: kv_lora_rank, rope, qk_nope_head_dim, v_head_dim


class Spec(NamedTuple):
    """One kernel's cases over a parameter table: ``build(device, **row, dt=dtype)`` builds a call and ``label``,
    formatted with the row's keywords (and ``L``, ``R``, ``P``, ``V``), names its shape."""

    kernel: Kernel
    label: str
    build: Callable[..., KernelCall]
    note: str = ""


def grid(rows: Sequence[Mapping[str, Any]], *specs: Spec, dtypes: Sequence[str] = HALVES) -> list[KernelCase]:
    """The cases of ``specs`` at every row of a parameter table, in the order row, dtype, spec."""
    return [
        KernelCase(
            spec.kernel,
            spec.label.format(**row, L=L, R=R, P=P, V=V),
            dt,
            partial(spec.build, **row, dt=dt),
            note=spec.note,
        )
        for row in rows
        for dt in dtypes
        for spec in specs
    ]


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def block_table(seed: int, seq_lens: list[int], block_size: int, device: Any) -> tuple[torch.Tensor, int]:
    """``(block_table [B, max_blocks] int32, num_blocks)``: distinct shuffled blocks >= 1 per request, 0-padded."""
    need = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(need) + 2  # the null block 0 and one never used
    blocks = (randperm(seed, num_blocks - 1, "cpu") + 1).tolist()
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(blocks[start : start + n], dtype=torch.int32)
        start += n
    return table.to(device), num_blocks


def slots(table: torch.Tensor, positions: list[tuple[int, int]], block_size: int) -> torch.Tensor:
    """Slots ``[T]`` int64 of ``(request, position)`` pairs through ``table``."""
    cpu = table.cpu()
    return torch.tensor([int(cpu[b, p // block_size]) * block_size + p % block_size for b, p in positions])


def paged_inputs(
    seeds: tuple[int, int, int, int],
    seq_lens: list[int],
    num_tokens: int,
    *,
    n: int,
    nkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    device: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(block_table, key_cache, value_cache, query)`` for a paged case: caches ``[nb, bs, nkv, d]`` and query
    ``[num_tokens, n, d]``, drawn from ``seeds`` (table, K, V, query) in that order."""
    table, nb = block_table(seeds[0], seq_lens, bs, device)
    kc = randn(seeds[1], nb, bs, nkv, d, dtype=dtype, device=device)
    vc = randn(seeds[2], nb, bs, nkv, d, dtype=dtype, device=device)
    q = randn(seeds[3], num_tokens, n, d, dtype=dtype, device=device)
    return table, kc, vc, q


def new_token_positions(q_lens: list[int], seq_lens: list[int]) -> list[tuple[int, int]]:
    return [(b, s - q + i) for b, (q, s) in enumerate(zip(q_lens, seq_lens)) for i in range(q)]


def out_kwarg(result: Any, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    return {"out": kwargs["out"]}


# --- GQA ------------------------------------------------------------------------------------------------------------


def latent_planes(seed: int, nb: int, bs: int, dtype: torch.dtype, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The nope/rope planes of one random ``[nb, bs, L + R]`` buffer (the layout the MLA backend allocates)."""
    return latent_cache_planes(randn(seed, nb, bs, L + R, dtype=dtype, device=device), L, R)
