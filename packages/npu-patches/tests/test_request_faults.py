# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""request-fault-isolation: the scheduler finishes exactly the requests the model runner reports as failed, with
finish reason abort and the error as stop_reason, and leaves every other request to vLLM's own method.

The engine-level proof (a failing request among others on a real server, the engine alive afterwards) is
tests/e2e/test_bad_input_http.py; this checks the replacement on stand-ins of the scheduler and its requests."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm_npu.interface import report_request_faults
from vllm_npu.patches.sets.request_faults import make_replacement

pytestmark = pytest.mark.usefixtures("vllm_unpatched")


class _Request(SimpleNamespace):
    def is_finished(self) -> bool:
        return self.finished

    def take_events(self) -> None:
        return None


class _Scheduler:
    def __init__(self, ids: list[str]) -> None:
        self.requests = {
            i: _Request(
                request_id=i, client_index=0, finished=False, stop_reason=None, trace_headers=None, num_cached_tokens=0
            )
            for i in ids
        }
        self.finished: list[tuple[list[str], Any]] = []
        self.seen_by_vllm: list[str] = []

    def finish_requests(self, ids: list[str], status: Any) -> None:
        self.finished.append((list(ids), status))
        for i in ids:
            self.requests.pop(i)

    def original(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

        self.seen_by_vllm = [i for i in scheduler_output if i in self.requests]  # vLLM skips finished requests
        return {
            0: EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=i, new_token_ids=[1]) for i in self.seen_by_vllm])
        }


def _run(faults: dict[str, str]) -> tuple[_Scheduler, dict[int, Any]]:
    sched = _Scheduler(["a", "b", "c"])
    output = SimpleNamespace()
    report_request_faults(output, faults)
    update = make_replacement(_Scheduler.original)
    return sched, update(sched, ["a", "b", "c"], output)


def test_reported_request_is_finished_with_its_error():
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus

    sched, outputs = _run({"b": "logits processor failed: ValueError: x"})
    assert sched.finished == [(["b"], RequestStatus.FINISHED_ABORTED)]
    assert sched.seen_by_vllm == ["a", "c"]
    by_id = {o.request_id: o for o in outputs[0].outputs}
    assert by_id["b"].finish_reason is FinishReason.ABORT and by_id["b"].new_token_ids == []
    assert by_id["b"].stop_reason == "logits processor failed: ValueError: x"
    assert by_id["a"].new_token_ids == [1] and by_id["a"].finish_reason is None


def test_no_report_is_vllm_unchanged():
    sched, outputs = _run({})
    assert sched.finished == [] and sched.seen_by_vllm == ["a", "b", "c"]
    assert [o.request_id for o in outputs[0].outputs] == ["a", "b", "c"]


def test_report_for_an_unknown_request_is_ignored():
    sched, outputs = _run({"zz": "gone"})
    assert sched.finished == [] and len(outputs[0].outputs) == 3
