# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The graph-task rows of ``vllm-npu selftest``'s runtime section: capture, task update and replay of one decode
attention kernel, against the same kernel called eagerly.

Each case captures a static graph (an ACL graph on an NPU, the static-graph twin on the emulated device) whose only
work is one decode attention kernel issued through :func:`vllm_npu.interface.graphs.launch`, as npu-attention's
backends issue it inside a FULL_DECODE_ONLY graph: an updatable task whose sequence lengths (a host list) are
refreshed before every replay, with its scratch (the NPU kernel's workspace) made outside the task group. It is
captured with one set of lengths and new query values, then replayed with others; the graph's output must equal
the kernel called eagerly with the replay's lengths, and differ from the capture-time lengths' result (so the row
shows the update took effect). Cases: GQA paged decode (``_npu_paged_attention_v2`` on an NPU) and MLA decode
(``npu_fused_infer_attention_score.out`` in its MLA mode), at shapes the NPU kernels document.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from vllm_npu.interface.device import DeviceMode

from ._kernel_check import TOLERANCES

#: Sequence lengths at capture, and at the replay (the update), per request.
CAPTURE_LENS = [1, 1, 1, 1]
REPLAY_LENS = [37, 200, 5, 129]


def _row(check: str, status: str, detail: str, seconds: float) -> dict[str, Any]:
    return {
        "check": check,
        "status": status,
        "detail": detail,
        "confirms": "part 2 §1-§2",
        "seconds": round(seconds, 1),
    }


def _block_table(batch: int, blocks_per_request: int, device: torch.device) -> torch.Tensor:
    """Request b owns blocks ``b * n .. b * n + n - 1`` (block 0 stays vLLM's null block: +1)."""
    return (torch.arange(batch * blocks_per_request, dtype=torch.int32) + 1).view(batch, -1).to(device)


def _run_case(
    name: str,
    kernel: Callable[..., None],
    query: torch.Tensor,
    args: tuple[torch.Tensor, ...],
    lens_key: str,
    params: Mapping[str, Any],
    out: torch.Tensor,
    prepare: Callable[..., Mapping[str, Any]] | None,
) -> dict[str, Any]:
    from vllm_npu.interface import graphs

    from ..model_runner import device_backend

    t0 = time.perf_counter()
    backend = device_backend()
    state = {"lens": list(CAPTURE_LENS)}

    def step(q: torch.Tensor) -> None:
        graphs.launch(
            kernel, q, *args, refresh=lambda: {lens_key: list(state["lens"])}, prepare=prepare,
            **{lens_key: list(state["lens"])}, out=out, **params,
        )  # fmt: skip

    def eager(lens: list[int]) -> torch.Tensor:
        kernel(query, *args, **{lens_key: lens}, out=out, **params)
        backend.synchronize()
        return out.clone()

    step(query)  # the eager warm-up a capture is preceded by
    graph = backend.capture_graph(step, (query,), {}, backend.graph_pool_handle(), None)
    try:
        query.copy_(torch.randn_like(query))
        state["lens"] = list(REPLAY_LENS)
        graph.refresh_tasks()
        graph.replay((query,), {})
        backend.synchronize()
        got = out.clone()
    finally:
        graph.reset()
    want = eager(list(REPLAY_LENS))
    stale = eager(list(CAPTURE_LENS))
    atol, rtol = TOLERANCES[str(query.dtype).removeprefix("torch.")]
    err = (got.float() - want.float()).abs().max().item()
    ok = torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol)
    updated = not torch.allclose(stale.float(), want.float(), atol=atol, rtol=rtol)
    detail = (
        f"{tuple(query.shape)} {str(query.dtype).removeprefix('torch.')}, lengths {CAPTURE_LENS} at capture, "
        f"{REPLAY_LENS} after the update: max abs error vs eager {err:.2e} (atol {atol:g}, rtol {rtol:g}); "
        f"the update {'changed' if updated else 'did NOT change'} the result"
    )
    return _row(name, "pass" if ok and updated else "FAIL", detail, time.perf_counter() - t0)


def _gqa_case(npu: bool, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    from vllm_npu.attention.ops.paged_attention import PAGED_DECODE, paged_decode_workspace_npu

    batch, heads, kv_heads, head_size, block_size, blocks = 4, 8, 2, 128, 128, 2
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, head_size, generator=gen).to(device, dtype)
    cache_shape = (batch * blocks + 1, block_size, kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    table = _block_table(batch, blocks, device)
    params = {"num_heads": heads, "num_kv_heads": kv_heads, "scale": head_size**-0.5}
    return _run_case(
        "graph task (gqa)",
        PAGED_DECODE.npu if npu else PAGED_DECODE.reference,
        query,
        (key_cache, value_cache, table),
        "context_lens",
        params,
        torch.empty_like(query),
        paged_decode_workspace_npu if npu else None,
    )


def _mla_case(npu: bool, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    from vllm_npu.attention.ops.mla_attention import MLA_DECODE, mla_decode_workspace_npu

    # The NPU kernel's documented MLA mode: kv_lora_rank 512, rope 64, 32/64/128 heads, block size 16 or 128.
    batch, heads, lora, rope, block_size, blocks = 4, 32, 512, 64, 128, 2
    gen = torch.Generator().manual_seed(1)
    ql_nope = torch.randn(batch, heads, lora, generator=gen).to(device, dtype)
    q_pe = torch.randn(batch, heads, rope, generator=gen).to(device, dtype)
    nope_cache = torch.randn(batch * blocks + 1, block_size, 1, lora, generator=gen).to(device, dtype)
    rope_cache = torch.randn(batch * blocks + 1, block_size, 1, rope, generator=gen).to(device, dtype)
    table = _block_table(batch, blocks, device)
    scale = (lora + rope) ** -0.5
    prepare = None
    if npu:
        # The backend's scratch for a captured MLA task: the kernel's maximum workspace and an LSE buffer, made
        # before the task group; both stay fixed across updates.
        workspace = mla_decode_workspace_npu(ql_nope, q_pe, nope_cache, rope_cache, table, CAPTURE_LENS, scale)
        lse = ql_nope.new_empty(batch)

        def prepare(*_: Any, **__: Any) -> Mapping[str, Any]:
            return {"workspace": workspace, "lse": lse}

    def kernel(q: torch.Tensor, *rest: Any, **kw: Any) -> None:  # the query is the graph's input
        (MLA_DECODE.npu if npu else MLA_DECODE.reference)(q, q_pe, *rest, **kw)

    return _run_case(
        "graph task (mla)",
        kernel,
        ql_nope,
        (nope_cache, rope_cache, table),
        "seq_lens",
        {"scale": scale},
        torch.empty_like(ql_nope),
        prepare,
    )


def graph_rows(mode: DeviceMode) -> list[dict[str, Any]]:
    """The GQA and MLA graph-task rows on this device (skipped without npu-attention)."""
    from vllm_npu.interface.registry import is_available

    if not is_available("attention"):
        return [
            _row(n, "skip", "npu-attention is not installed", 0.0) for n in ("graph task (gqa)", "graph task (mla)")
        ]
    npu = mode is DeviceMode.NPU
    if npu:
        from .selftest import npu_device

        device, dtype = npu_device(), torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
    rows = []
    for case in (_gqa_case, _mla_case):
        try:
            rows.append(case(npu, device, dtype))
        except Exception as exc:  # reported as a failed row, with the cause
            name = "graph task (gqa)" if case is _gqa_case else "graph task (mla)"
            rows.append(_row(name, "FAIL", f"{type(exc).__name__}: {exc}", 0.0))
    return rows
