# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The decode attention calls ``vllm-npu selftest``'s runtime section captures as graph tasks.

Each :class:`GraphTaskCase` is one decode kernel call as this layer's backends issue it inside a FULL_DECODE_ONLY
graph (:func:`vllm_npu.interface.graphs.launch`): the query is the graph's input, the caches, block table and
output are captured by address, the sequence lengths (a host list, keyword ``lens_key``) are the task's refreshed
parameter, and on an NPU ``prepare`` makes the kernel's scratch outside the task group. Shapes are those the NPU
kernels document (MLA: kv_lora_rank 512, rope 64, 32 heads, block size 128). npu-platform's selftest
(``cli/_selftest_graphs.py``) captures, updates, replays and compares each with an eager call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from .ops.mla_attention import MLA_DECODE, mla_decode_workspace_npu
from .ops.paged_attention import PAGED_DECODE, paged_decode_workspace_npu

#: Sequence lengths the cases are captured with: the workspace of the MLA case is queried for them.
CAPTURE_LENS = [1, 1, 1, 1]


class GraphTaskCase(NamedTuple):
    """``kernel(query, *args, **{lens_key: lens}, out=out, **params)`` (returns None, writes ``out``); ``prepare``
    (NPU only) returns the scratch keywords of a captured task; ``capture_lens``: the lengths to capture with (the
    MLA case's workspace was queried for them)."""

    name: str
    kernel: Callable[..., None]
    query: torch.Tensor
    args: tuple[torch.Tensor, ...]
    lens_key: str
    params: Mapping[str, Any]
    out: torch.Tensor
    prepare: Callable[..., Mapping[str, Any]] | None
    capture_lens: list[int]


def _block_table(batch: int, blocks_per_request: int, device: torch.device) -> torch.Tensor:
    """Request b owns blocks ``1 + b * n .. b * n + n`` (block 0 stays vLLM's null block)."""
    return (torch.arange(batch * blocks_per_request, dtype=torch.int32) + 1).view(batch, -1).to(device)


def _gqa(npu: bool, device: torch.device, dtype: torch.dtype) -> GraphTaskCase:
    batch, heads, kv_heads, head_size, block_size, blocks = len(CAPTURE_LENS), 8, 2, 128, 128, 2
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, head_size, generator=gen).to(device, dtype)
    cache_shape = (batch * blocks + 1, block_size, kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    return GraphTaskCase(
        "gqa",
        PAGED_DECODE.npu if npu else PAGED_DECODE.reference,
        query,
        (key_cache, value_cache, _block_table(batch, blocks, device)),
        "context_lens",
        {"num_heads": heads, "num_kv_heads": kv_heads, "scale": head_size**-0.5},
        torch.empty_like(query),
        paged_decode_workspace_npu if npu else None,
        list(CAPTURE_LENS),
    )


def _mla(npu: bool, device: torch.device, dtype: torch.dtype) -> GraphTaskCase:
    batch, heads, lora, rope, block_size, blocks = len(CAPTURE_LENS), 32, 512, 64, 128, 2
    gen = torch.Generator().manual_seed(1)
    ql_nope = torch.randn(batch, heads, lora, generator=gen).to(device, dtype)
    q_pe = torch.randn(batch, heads, rope, generator=gen).to(device, dtype)
    nope_cache = torch.randn(batch * blocks + 1, block_size, 1, lora, generator=gen).to(device, dtype)
    rope_cache = torch.randn(batch * blocks + 1, block_size, 1, rope, generator=gen).to(device, dtype)
    table = _block_table(batch, blocks, device)
    scale = (lora + rope) ** -0.5
    decode = MLA_DECODE.npu if npu else MLA_DECODE.reference

    def kernel(q: torch.Tensor, *rest: Any, **kw: Any) -> None:  # the query is the graph's input, q_pe a constant
        decode(q, q_pe, *rest, **kw)

    prepare = None
    if npu:
        # As the MLA backend does for a captured task: the kernel's maximum workspace (valid for every length) and
        # an LSE buffer, made once before the task group and kept across updates.
        scratch = {
            "workspace": mla_decode_workspace_npu(ql_nope, q_pe, nope_cache, rope_cache, table, CAPTURE_LENS, scale),
            "lse": ql_nope.new_empty(batch),
        }

        def prepare(*_: Any, **__: Any) -> Mapping[str, Any]:
            return scratch

    return GraphTaskCase(
        "mla", kernel, ql_nope, (nope_cache, rope_cache, table), "seq_lens", {"scale": scale},
        torch.empty_like(ql_nope), prepare, list(CAPTURE_LENS),
    )  # fmt: skip


def graph_task_cases(npu: bool, device: torch.device, dtype: torch.dtype) -> list[GraphTaskCase]:
    """The GQA paged decode and the MLA decode as graph tasks, with the NPU kernels (``npu``) or the reference twins,
    their tensors on ``device`` in ``dtype``."""
    return [_gqa(npu, device, dtype), _mla(npu, device, dtype)]
