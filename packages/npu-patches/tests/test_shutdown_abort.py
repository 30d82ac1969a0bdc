# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``shutdown-ends-requests``: the replacement ends every tracked request before vLLM's shutdown runs (the streaming
client's view, through a real ``vllm serve`` and SIGTERM, is tests/e2e/test_process_lifecycle.py)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_npu.patches.sets.shutdown_abort import end_in_flight_requests, make_replacement


class FakeProcessor:
    def __init__(self, ids: list[str], calls: list[str]) -> None:
        self.request_states = dict.fromkeys(ids)
        self.calls = calls

    def abort_requests(self, ids: list[str]) -> list[str]:
        self.calls.append(f"abort {sorted(ids)}")
        self.request_states.clear()
        return ids


def test_requests_end_before_the_engine_stops() -> None:
    calls: list[str] = []
    llm = SimpleNamespace(output_processor=FakeProcessor(["a", "b"], calls))
    shutdown = make_replacement(lambda self: calls.append("vllm shutdown"))
    shutdown(llm)
    assert calls == ["abort ['a', 'b']", "vllm shutdown"]


def test_nothing_in_flight_or_never_started() -> None:
    calls: list[str] = []
    assert end_in_flight_requests(SimpleNamespace(output_processor=FakeProcessor([], calls))) == []
    assert end_in_flight_requests(SimpleNamespace()) == []  # shut down before its output processor was built
    assert calls == []
