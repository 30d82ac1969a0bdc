# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Patch ``request-fault-isolation``: a request whose own logits processing failed is finished with an error; the
engine keeps serving every other request.

vLLM 0.11.0 has no per-request failure between the model runner and the scheduler: ``ModelRunnerOutput`` carries
tokens only, and any exception in ``execute_model`` ends the engine core (``EngineDeadError`` for every request, and
``vllm serve`` exits). npu-platform's model runner catches the failures that belong to one request (its grammar
bitmask row, its per-request logits processor) and reports them on the step's output
(``vllm_npu.interface.protocols.RequestFaultReport``). The replacement of ``Scheduler.update_from_output`` (which
``AsyncScheduler`` and npu-kv's scheduler inherit) finishes those requests first, as aborted (vLLM's
``FINISHED_ABORTED``: blocks freed, grammar dropped, the worker told), then runs vLLM's method, whose loop skips
requests that are already finished, and adds one final output per failed request: ``finish_reason`` ``abort`` and
the error as ``stop_reason``, which reaches the client (``RequestOutput.outputs[i].stop_reason``, the OpenAI
``choices[i].stop_reason``). Their sampled tokens of the step are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def make_replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    """Build ``Scheduler.update_from_output`` that fails the requests the runner reports (``original`` is kept)."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.request import RequestStatus
    from vllm_npu.interface import get_logger, request_faults_of

    logger = get_logger("vllm_npu.patches.request_faults")

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        failed: list[tuple[Any, str]] = []
        for req_id, message in request_faults_of(model_runner_output).items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            logger.error("request %s failed and is aborted: %s", req_id, message)
            request.stop_reason = message
            failed.append((request, message))
        if failed:
            self.finish_requests([request.request_id for request, _ in failed], RequestStatus.FINISHED_ABORTED)
        outputs: dict[int, Any] = original(self, scheduler_output, model_runner_output)
        for request, message in failed:
            final = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ABORT,
                stop_reason=message,
                events=request.take_events(),
                trace_headers=request.trace_headers,
                num_cached_tokens=request.num_cached_tokens,
            )
            outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(final)
        return outputs

    update_from_output.__module__ = original.__module__
    update_from_output.__qualname__ = original.__qualname__
    update_from_output.__doc__ = original.__doc__
    update_from_output.__wrapped__ = original  # type: ignore[attr-defined]
    return update_from_output
