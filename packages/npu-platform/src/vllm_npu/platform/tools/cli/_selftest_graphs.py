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
(``npu_fused_infer_attention_score.out`` in its MLA mode), at shapes the NPU kernels document; npu-attention builds
them (``vllm_npu.attention.graph_task_cases``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from vllm_npu.interface import DeviceMode

from ._kernel_check import TOLERANCES

if TYPE_CHECKING:
    from vllm_npu.attention import GraphTaskCase

#: Sequence lengths at the replay (the update); the capture's come with each case.
REPLAY_LENS = [37, 200, 5, 129]


def _row(check: str, status: str, detail: str, seconds: float) -> dict[str, Any]:
    return {
        "check": check,
        "status": status,
        "detail": detail,
        "confirms": "part 2 §1-§2",
        "seconds": round(seconds, 1),
    }


def _run_case(case: GraphTaskCase) -> dict[str, Any]:
    """Capture ``case`` with its lengths, update it to :data:`REPLAY_LENS` with new query values, replay, and compare
    with the eager call (see the module docstring)."""
    from vllm_npu.interface import launch

    from ..._device import device_backend

    name, kernel, query, args, lens_key, params, out, prepare, capture_lens = case
    name = f"graph task ({name})"
    t0 = time.perf_counter()
    backend = device_backend()
    state = {"lens": list(capture_lens)}

    def step(q: torch.Tensor) -> None:
        launch(
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
    stale = eager(list(capture_lens))
    atol, rtol = TOLERANCES[str(query.dtype).removeprefix("torch.")]
    err = (got.float() - want.float()).abs().max().item()
    ok = torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol)
    updated = not torch.allclose(stale.float(), want.float(), atol=atol, rtol=rtol)
    detail = (
        f"{tuple(query.shape)} {str(query.dtype).removeprefix('torch.')}, lengths {capture_lens} at capture, "
        f"{REPLAY_LENS} after the update: max abs error vs eager {err:.2e} (atol {atol:g}, rtol {rtol:g}); "
        f"the update {'changed' if updated else 'did NOT change'} the result"
    )
    return _row(name, "pass" if ok and updated else "FAIL", detail, time.perf_counter() - t0)


def graph_rows(mode: DeviceMode) -> list[dict[str, Any]]:
    """The GQA and MLA graph-task rows on this device (skipped without npu-attention)."""
    from vllm_npu.interface import is_available

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
    from vllm_npu.attention import graph_task_cases

    try:
        cases = graph_task_cases(npu, device, dtype)
    except Exception as exc:  # building the inputs (an NPU workspace query) failed: both rows, with the cause
        detail = f"building the cases failed: {type(exc).__name__}: {exc}"
        return [_row(n, "FAIL", detail, 0.0) for n in ("graph task (gqa)", "graph task (mla)")]
    rows = []
    for case in cases:
        try:
            rows.append(_run_case(case))
        except Exception as exc:  # reported as a failed row, with the cause
            rows.append(_row(f"graph task ({case.name})", "FAIL", f"{type(exc).__name__}: {exc}", 0.0))
    return rows
