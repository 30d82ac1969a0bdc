# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Structured output's grammar bitmask on the NPU and the emulated device, for every logits dtype, one request at a
time when one request's row fails.

vLLM 0.11's ``apply_grammar_bitmask`` (``vllm/v1/structured_output/utils.py``) hands the logits to
``xgrammar.apply_token_bitmask_inplace`` on their own device: xgrammar 0.1.25 then runs its CPU kernel for CPU
tensors, which accepts float32 only (``ValueError: logits must be of type float32`` for a bf16/fp16 model, which
killed the engine), Triton for CUDA, and ``torch.compile`` for any other device. vllm-ascend v0.11.0
(``worker/model_runner_v1.py``, ``NPUModelRunner.apply_grammar_bitmask``) moves the whole logits tensor to the host
as float32, applies xgrammar's CPU kernel and moves it back in the model's dtype: the path that has run on hardware.

:func:`apply_grammar_bitmask` does the same with the structured rows only: it gathers the rows of the structured
requests (``1 + draft tokens`` rows each, in the runner's batch order), copies them to the host as float32, applies
xgrammar's CPU kernel and writes them back into ``logits`` in place (in the logits' dtype, on their device). The
other rows never leave the device. On the emulated device the gather is the only copy, and float32 logits (already
what the kernel takes) are masked in place without one.

When the batched kernel call raises, each request's rows are applied on their own; a request whose rows still fail
keeps its logits unmasked and is returned with the error, so that the runner fails that request and no other.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm_npu.interface.log import get_logger

logger = get_logger(__name__)


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


def _apply_on_host(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Mask ``logits[rows]`` in place with ``bitmask`` (int32, one row per entry of ``rows``) through xgrammar's
    CPU kernel: the rows go to the host as float32 and come back in ``logits``' dtype and device."""
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


def apply_grammar_bitmask(
    scheduler_output: Any, bitmask_np: np.ndarray, req_id_to_index: dict[str, int], logits: torch.Tensor
) -> dict[str, str]:
    """Apply the step's grammar bitmask ``bitmask_np`` (numpy int32 ``[structured rows, ceil(vocab / 32)]``, the
    scheduler output's ``grammar_bitmask``) to ``logits`` (``[rows, vocab]``, any float dtype, on the runner's
    device) in place: a token whose bit is 0 gets ``-inf``. Returns ``{req_id: error}`` for the requests whose rows
    could not be masked (empty when all were)."""
    requests = structured_rows(scheduler_output, req_id_to_index)
    if not requests:
        return {}
    bitmask = torch.from_numpy(np.ascontiguousarray(bitmask_np))
    all_rows = [row for _, rows, _ in requests for row in rows]
    mask_rows = [start + i for _, rows, start in requests for i in range(len(rows))]
    try:
        _apply_on_host(logits, all_rows, bitmask[mask_rows])
        return {}
    except Exception as batch_error:  # one request's rows may be at fault: retry each on its own
        logger.warning("grammar bitmask for the batch failed (%s); applying it per request", batch_error)
    failed: dict[str, str] = {}
    for req_id, rows, start in requests:
        try:
            _apply_on_host(logits, rows, bitmask[start : start + len(rows)])
        except Exception as error:
            failed[req_id] = f"structured output failed: {type(error).__name__}: {error}"
    return failed
