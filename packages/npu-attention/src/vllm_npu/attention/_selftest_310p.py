# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu selftest`` cases of the Ascend 310P GQA kernels (:mod:`.ops.attention_310p`), run on a 310P host.

What only a 310P can confirm: that ATB reads the ``[nb, Nkv*D/16, bs, 16]`` caches and the NZ-cast masks in the
tiling the twins read, that ``_npu_reshape_and_cache`` writes the NZ cache (the op-plugin binding picks its cache
mode from the tensors' formats), and that the 16-aligned first prefill and the splitfuse call (vllm-ascend
v0.10.0rc1's) give the twins' answers. float16 only (the chip's dtype); head size 128 with 8:1 and 4:1 grouping,
block size 128 (vllm-ascend's on 310P) and 16.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from vllm_npu.interface import KernelCall, KernelCase, MissingComponentError, is_310p, randn

from . import _selftest_kit as kit
from .masks import AttentionMaskBuilder
from .ops.attention_310p import PAGED_DECODE_310P, PAGED_SPLITFUSE_310P, PREFILL_310P, RESHAPE_AND_CACHE_NZ
from .ops.nz import aligned_16

FP16 = "float16"
SHAPES = ((32, 8, 128, 128), (16, 4, 128, 16))  # (N, Nkv, D, block size)


def _nz(cache: torch.Tensor) -> torch.Tensor:
    """``[nb, bs, Nkv, D]`` -> the NZ cache ``[nb, Nkv*D/16, bs, 16]`` holding the same tokens."""
    nb, bs, nkv, d = cache.shape
    return cache.reshape(nb, bs, nkv * d // 16, 16).permute(0, 2, 1, 3).contiguous()


def _on_this_chip(device: Any) -> None:
    """The 310P calls only mean something on a 310P (or the emulated device): an A2/A3 NPU skips the row."""
    if torch.device(device).type != "cpu" and not is_310p():
        raise MissingComponentError(
            "attention",
            "a 310P kernel row (NZ KV cache) on an A2/A3 NPU",
            fix="run vllm-npu selftest on an Atlas 300I (Ascend 310P) host to confirm this row",
        )


def _cache_write(device: Any, *, nkv: int, d: int, bs: int) -> KernelCall:
    _on_this_chip(device)
    seq_lens = [5, 130, 1]
    table, nb = kit.block_table(30, seq_lens, bs, device)
    slots = kit.slots(table, kit.new_token_positions([3, 2, 1], seq_lens), bs).to(torch.int32).to(device)
    k_cache, v_cache = randn(31, 2, nb, nkv * d // 16, bs, 16, dtype=torch.float16, device=device).unbind(0)
    k = randn(33, slots.numel(), nkv, d, dtype=torch.float16, device=device)
    v = randn(34, slots.numel(), nkv, d, dtype=torch.float16, device=device)
    return KernelCall((k, v, k_cache, v_cache, slots), {}, _caches_out)


def _caches_out(result: Any, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    return {"key_cache": args[2], "value_cache": args[3]}


def _prefill(device: Any, *, n: int, nkv: int, d: int) -> KernelCall:
    _on_this_chip(device)
    seq_lens = [3, 17, 40]
    t = sum(seq_lens)
    q, k, v = (
        aligned_16(randn(35 + i, t, h, d, dtype=torch.float16, device=device)) for i, h in enumerate((n, nkv, nkv))
    )
    mask = AttentionMaskBuilder(device).prefill_mask_nz(seq_lens, torch.float16).repeat(len(seq_lens), 1, 1, 1)
    kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, mask_nz=mask, out=torch.zeros_like(q))
    return KernelCall((q, k, v, torch.tensor(seq_lens, dtype=torch.int32)), kw, partial(_real_rows, t))


def _real_rows(t: int, result: Any, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    return {"out": kwargs["out"][:t]}  # the 16-aligned padding rows are the kernel's scratch


def _decode(device: Any, *, n: int, nkv: int, d: int, bs: int) -> KernelCall:
    _on_this_chip(device)
    context = [1, 37, 300, 129]
    table, kc, vc, q = kit.paged_inputs(
        (41, 42, 43, 44), context, len(context), n=n, nkv=nkv, d=d, bs=bs, dtype=torch.float16, device=device
    )
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, out=torch.zeros_like(q))
    return KernelCall((q, _nz(kc), _nz(vc), table, lens), kw, kit.out_kwarg)


def _splitfuse(device: Any, *, n: int, nkv: int, d: int, bs: int) -> KernelCall:
    _on_this_chip(device)
    q_lens, seq_lens = [1, 1, 7, 20], [37, 300, 7, 150]  # two decodes, a first prefill, a chunk after 130 cached
    table, kc, vc, q = kit.paged_inputs(
        (45, 46, 47, 48), seq_lens, sum(q_lens), n=n, nkv=nkv, d=d, bs=bs, dtype=torch.float16, device=device
    )
    mask = AttentionMaskBuilder(device).splitfuse_mask_nz(q_lens, seq_lens, torch.float16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, mask_nz=mask, out=torch.zeros_like(q))
    args = (q, _nz(kc), _nz(vc), table, torch.tensor(q_lens, dtype=torch.int32), lens)
    return KernelCall(args, kw, kit.out_kwarg)


def cases_310p() -> list[KernelCase]:
    """Every 310P kernel pair in float16 over :data:`SHAPES`."""
    cases = []
    for n, nkv, d, bs in SHAPES:
        heads = f"heads {n}/{nkv} x {d}"
        cases += [
            KernelCase(
                RESHAPE_AND_CACHE_NZ,
                f"k/v [6, {nkv}, {d}] -> NZ cache [nb, {nkv * d // 16}, {bs}, 16]",
                FP16,
                partial(_cache_write, nkv=nkv, d=d, bs=bs),
                note="310P NZ cache write",
            ),
            KernelCase(
                PREFILL_310P,
                f"q [64 (60 aligned), {n}, {d}] kv heads {nkv}, seqs [3, 17, 40], NZ mask",
                FP16,
                partial(_prefill, n=n, nkv=nkv, d=d),
                note="310P first prefill",
            ),
            KernelCase(
                PAGED_DECODE_310P,
                f"q [4, {n}, {d}] {heads}, NZ cache block {bs}, ctx [1, 37, 300, 129]",
                FP16,
                partial(_decode, n=n, nkv=nkv, d=d, bs=bs),
                note="310P paged decode",
            ),
            KernelCase(
                PAGED_SPLITFUSE_310P,
                f"q_lens [1, 1, 7, 20] seq_lens [37, 300, 7, 150], {heads}, NZ cache block {bs}, NZ mask",
                FP16,
                partial(_splitfuse, n=n, nkv=nkv, d=d, bs=bs),
                note="310P chunked prefill (splitfuse)",
            ),
        ]
    return cases
