# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""One request's logits processing fails that request, not the step.

vLLM 0.11 runs per-request logits processors (``RequestLogitsProcessor`` callables, the ones
``AdapterLogitsProcessor`` wraps for ``--logits-processors``) inside the sampler, row by row
(``AdapterLogitsProcessor.apply``); an exception in one of them propagates out of ``execute_model`` and the engine
core dies (``EngineDeadError`` for every request). :func:`isolated_request_logitsprocs` runs each per-request
callable under a guard for the duration of one sampling step: a callable that raises leaves its row as it was and
its request is recorded with the error, for the runner to report (:func:`vllm_npu.interface.protocols.report_request_faults`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from vllm_npu.interface import get_logger

logger = get_logger(__name__)


def _run_guarded(
    fn: Callable[[torch.Tensor], torch.Tensor], req_id: str, faults: dict[str, str], row: torch.Tensor
) -> torch.Tensor:
    try:
        return fn(row)
    except Exception as error:
        logger.warning("logits processor of request %s failed: %s: %s", req_id, type(error).__name__, error)
        faults.setdefault(req_id, f"logits processor failed: {type(error).__name__}: {error}")
        return row


@contextmanager
def isolated_request_logitsprocs(input_batch: Any, faults: dict[str, str]) -> Iterator[None]:
    """For the block, every per-request logits processor of ``input_batch`` (vLLM's ``InputBatch``) runs guarded:
    a failure is written to ``faults`` (``{request id: error}``) instead of raising. The processors' own state is
    restored on exit."""
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    swapped: list[tuple[Any, dict[int, Any]]] = []
    for proc in input_batch.logitsprocs.all:
        if isinstance(proc, AdapterLogitsProcessor) and proc.req_info:
            original = proc.req_info
            proc.req_info = {
                index: partial(_run_guarded, fn, input_batch.req_ids[index], faults) for index, fn in original.items()
            }
            swapped.append((proc, original))
    try:
        yield
    finally:
        for proc, original in swapped:
            proc.req_info = original
