# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Structured output's grammar bitmask on the NPU and the emulated device, for every logits dtype, one request at a
time when one request's rows fail.

vLLM 0.11's ``apply_grammar_bitmask`` (``vllm/v1/structured_output/utils.py``) hands the logits to
``xgrammar.apply_token_bitmask_inplace`` on their own device: xgrammar 0.1.25 then runs its CPU kernel for CPU
tensors, which accepts float32 only (``ValueError: logits must be of type float32`` for a bf16/fp16 model, which
killed the engine), Triton for CUDA, and ``torch.compile`` for any other device. vllm-ascend v0.11.0
(``worker/model_runner_v1.py:1721-1783``, ``NPUModelRunner.apply_grammar_bitmask``) moves the whole logits tensor to
the host as float32, applies xgrammar's CPU kernel and moves it back in the model's dtype.

The kernel pair :data:`GRAMMAR_BITMASK`, ``mask(logits, rows, bitmask) -> None``: ``logits [N, V]`` (float32,
float16 or bfloat16, on the runner's device), ``rows`` the logit rows to mask (distinct ints, ascending or not),
``bitmask [len(rows), W]`` int32 on the host, one row per entry of ``rows``, bit ``j % 32`` of word ``j // 32`` set
when token ``j`` is allowed (xgrammar's layout). In place: ``logits[rows[i], j] = -inf`` for every ``j < min(V, 32 W)``
whose bit is 0; every other value is left exactly as it was.

- :func:`grammar_mask_npu`, the NPU's: the bitmask goes to the device (``B x W x 4`` bytes, non-blocking, as
  vllm-ascend v0.11.0 copies its per-step index arrays, ``model_runner_v1.py:1449-1450,1697-1704``), is unpacked
  there with ``bitwise_and`` against the 32 bit values and ``eq(0)``, and ``masked_fill_`` writes ``-inf``: plain aten
  ops that torch_npu 2.8.0 registers for the NPU (``csrc/aten/npu_native_functions_by_codegen.yaml``, ``supported``:
  ``bitwise_and.Tensor``, ``eq.Scalar``, ``masked_fill_.Scalar``, ``index_select``, ``index_copy_``). No host sync
  and no logits on the host. vllm-ascend's model runner v2 (after v0.11.0) masks on the device as well, with a
  Triton-Ascend kernel; torch_npu 2.8.0 documents no op for it (``_op_plugin_docs.py``).
- :func:`grammar_mask_reference`, the twin and vllm-ascend v0.11.0's path: the rows go to the host as float32,
  through xgrammar's CPU kernel, and back in the logits' dtype. It is the faster of the two on a CPU (xgrammar's C++
  loop against torch's unpacking: ``benchmarks/grammar_bitmask.py``), so the emulated device runs it, and it is what
  ``npu.kernels=reference`` gives on an NPU.

:func:`apply_grammar_bitmask` orders the scheduler's compacted bitmask to the runner's logit rows (``1 + draft
tokens`` rows per structured request) and applies the selected mask to all of them at once. When that raises, each
request's rows are masked on their own with the reference twin (the path that has run on hardware); a request whose
rows still fail keeps its logits unmasked and is returned with the error, so that the runner fails that request and
no other.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from vllm_npu.interface import Kernel, get_logger

logger = get_logger(__name__)

#: ``mask(logits, rows, bitmask) -> None``: the contract of :data:`GRAMMAR_BITMASK` (module docstring).
GrammarMask = Callable[[torch.Tensor, list[int], torch.Tensor], None]


def structured_rows(scheduler_output: Any, req_id_to_index: dict[str, int]) -> list[tuple[str, list[int], int]]:
    """``(req_id, logit rows, first bitmask row)`` of every structured request this step, in bitmask order.

    The scheduler compacts the bitmask to the structured requests in ``structured_output_request_ids`` order, each
    with ``1 + len(scheduled draft tokens)`` rows; the logits hold ``1 + draft tokens`` rows per request in the
    runner's batch order (``req_id_to_index``). vLLM's own ordering rule (``apply_grammar_bitmask``), kept here."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    logit_start: dict[str, int] = {}
    offset = 0
    for req_id, batch_index in sorted(req_id_to_index.items(), key=lambda item: item[1]):
        logit_start[req_id] = batch_index + offset
        offset += len(spec.get(req_id, ()))
    rows: list[tuple[str, list[int], int]] = []
    mask_row = 0
    for req_id, _ in sorted(scheduler_output.structured_output_request_ids.items(), key=lambda item: item[1]):
        n = 1 + len(spec.get(req_id, ()))
        if req_id in logit_start:  # a request the runner no longer holds keeps its bitmask rows unused (as vLLM)
            rows.append((req_id, list(range(logit_start[req_id], logit_start[req_id] + n)), mask_row))
        mask_row += n
    return rows


@lru_cache(maxsize=8)
def _bit_values(device: torch.device) -> torch.Tensor:
    """``[32]`` int32 on ``device``: ``1 << i`` for bit ``i`` (bit 31 is the int32 sign bit), copied once per device."""
    values = np.left_shift(np.uint32(1), np.arange(32, dtype=np.uint32)).view(np.int32)
    return torch.from_numpy(values).to(device)


def _blocked(bitmask: torch.Tensor, device: torch.device, width: int) -> torch.Tensor:
    """``[rows, width]`` bool on ``device``: True where the token's bit in ``bitmask`` (host int32) is 0."""
    bits = bitmask.to(device, non_blocking=True)
    unpacked = torch.bitwise_and(bits.unsqueeze(-1), _bit_values(device)).eq(0)
    return unpacked.view(bits.shape[0], -1)[:, :width]


def grammar_mask_npu(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """:data:`GRAMMAR_BITMASK` on the logits' device (module docstring): the bitmask is unpacked there and
    ``masked_fill_`` writes ``-inf``; only ``bitmask`` and, unless every row is masked, the row indices cross to the
    device, and nothing comes back. Plain aten: on the emulated device it runs on the CPU as it is."""
    width = min(logits.shape[1], 32 * bitmask.shape[1])
    blocked = _blocked(bitmask, logits.device, width)
    if rows == list(range(logits.shape[0])):
        logits[:, :width].masked_fill_(blocked, float("-inf"))
        return
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    selected = logits.index_select(0, index)
    selected[:, :width].masked_fill_(blocked, float("-inf"))
    logits.index_copy_(0, index, selected)


def grammar_mask_reference(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """:data:`GRAMMAR_BITMASK` through xgrammar's CPU kernel (module docstring): the rows go to the host as float32
    and come back in the logits' dtype and device (vllm-ascend v0.11.0's round trip, limited to ``rows``)."""
    import xgrammar as xgr

    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # Already what xgrammar's CPU kernel takes: mask in place, no copy (vLLM's own path for this case).
        aligned = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=bitmask.dtype)
        aligned[rows] = bitmask
        xgr.apply_token_bitmask_inplace(logits, aligned, indices=rows)
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    host = logits.index_select(0, index).to(device="cpu", dtype=torch.float32)
    xgr.apply_token_bitmask_inplace(host, bitmask)
    logits.index_copy_(0, index, host.to(device=logits.device, dtype=logits.dtype))


GRAMMAR_BITMASK: Kernel[GrammarMask] = Kernel("grammar_bitmask", npu=grammar_mask_npu, reference=grammar_mask_reference)

#: Why a structured request fails under async scheduling (:func:`async_scheduling_faults`).
ASYNC_SCHEDULING_ERROR = (
    "structured output does not work with async scheduling on vLLM 0.11.0: the scheduler computes a step's grammar "
    "bitmask before the previous step's token is known, so the constraint lags one token behind "
    "(vllm-project/vllm#26866 makes them compatible upstream); start the engine without async scheduling "
    "(no --async-scheduling, async_scheduling=False)"
)


def async_scheduling_faults(scheduler_output: Any, req_id_to_index: dict[str, int]) -> dict[str, str]:
    """``{req_id: ASYNC_SCHEDULING_ERROR}`` for every structured request of the step: under vLLM 0.11.0's async
    scheduling their bitmask is one token stale (every character came out twice on the emulated device), so they
    are failed with the reason instead of answered with text that breaks their constraint."""
    return {req_id: ASYNC_SCHEDULING_ERROR for req_id, _, _ in structured_rows(scheduler_output, req_id_to_index)}


def apply_grammar_bitmask(
    scheduler_output: Any,
    bitmask_np: np.ndarray,
    req_id_to_index: dict[str, int],
    logits: torch.Tensor,
    mask: GrammarMask = grammar_mask_reference,
) -> dict[str, str]:
    """Apply the step's grammar bitmask ``bitmask_np`` (numpy int32 ``[structured rows, ceil(vocab / 32)]``, the
    scheduler output's ``grammar_bitmask``) to ``logits`` (``[rows, vocab]``, any float dtype, on the runner's
    device) in place with ``mask`` (a side of :data:`GRAMMAR_BITMASK`, selected once by the caller): a token whose
    bit is 0 gets ``-inf``. Returns ``{req_id: error}`` for the requests whose rows could not be masked (empty when
    all were)."""
    requests = structured_rows(scheduler_output, req_id_to_index)
    if not requests:
        return {}
    bitmask = torch.from_numpy(np.ascontiguousarray(bitmask_np))
    all_rows = [row for _, rows, _ in requests for row in rows]
    mask_rows = [start + i for _, rows, start in requests for i in range(len(rows))]
    try:
        mask(logits, all_rows, bitmask[mask_rows])
        return {}
    except Exception as batch_error:  # one request's rows may be at fault: retry each on its own
        logger.warning("grammar bitmask for the batch failed (%s); applying it per request", batch_error)
    failed: dict[str, str] = {}
    for req_id, rows, start in requests:
        try:
            grammar_mask_reference(logits, rows, bitmask[start : start + len(rows)])
        except Exception as error:
            failed[req_id] = f"structured output failed: {type(error).__name__}: {error}"
    return failed
