# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The runner's no-forward step (nothing scheduled, transfers in flight) keeps the KV connectors' stats: a stand-in
connector installed as vLLM's transfer group hands out stats on an idle step. vLLM 0.11.0's own
``kv_connector_no_forward`` returns the shared empty output there and the stats are gone (seen in the suite as a
pool-hit counter short by one request's blocks)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm_npu.platform.model_runner import NPUModelRunner


class _Connector(KVConnectorBase_V1):
    """Reports the finished transfers and stats it is given, once, as a worker-side connector does."""

    def __init__(self) -> None:  # vLLM's base needs a full config; the mixin only calls the methods below
        self.finished: tuple[set[str] | None, set[str] | None] = (None, None)
        self.stats: KVConnectorStats | None = None
        self.calls: list[str] = []

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self.calls.append("bind")

    def clear_connector_metadata(self) -> None:
        self.calls.append("clear")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.calls.append("start_load")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        out, self.finished = self.finished, (None, None)
        return out

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        out, self.stats = self.stats, None
        return out

    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None: ...
    def wait_for_save(self) -> None: ...
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]: ...  # type: ignore[empty-body]
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None: ...
    def build_connector_meta(self, scheduler_output: Any) -> Any: ...


@pytest.fixture
def connector(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Connector]:
    conn = _Connector()
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", conn)
    yield conn


def _idle_step() -> Any:
    return SimpleNamespace(kv_connector_metadata=object(), finished_req_ids=set(), total_num_scheduled_tokens=0)


def test_stats_of_an_idle_step_reach_the_scheduler(connector: _Connector) -> None:
    connector.stats = KVConnectorStats(data={"loaded_blocks": 12})
    out = NPUModelRunner.kv_connector_no_forward(_idle_step(), VllmConfig())
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT  # the shared empty output must never be written to
    assert out.kv_connector_output is not None
    assert out.kv_connector_output.kv_connector_stats.data == {"loaded_blocks": 12}
    assert not out.kv_connector_output.finished_recving and not out.req_ids
    assert connector.calls == ["bind", "start_load", "clear"]


def test_why_the_override_exists(connector: _Connector) -> None:
    """The mixin's own step on the installed vLLM: 0.11.0 hands the stats over and drops them; 0.11.1 and later keep
    them (they test ``KVConnectorOutput.is_empty()``), as ours does on every release."""
    keeps = "is_empty" in KVConnectorModelRunnerMixin.kv_connector_no_forward.__code__.co_names
    connector.stats = KVConnectorStats(data={"loaded_blocks": 12})
    out = KVConnectorModelRunnerMixin.kv_connector_no_forward(_idle_step(), VllmConfig())
    assert (out is not EMPTY_MODEL_RUNNER_OUTPUT) == keeps
    assert connector.stats is None  # handed over either way


def test_finished_transfers_are_reported(connector: _Connector) -> None:
    connector.finished = ({"sent"}, {"received"})
    out = NPUModelRunner.kv_connector_no_forward(_idle_step(), VllmConfig())
    assert out.kv_connector_output.finished_sending == {"sent"}
    assert out.kv_connector_output.finished_recving == {"received"}
    assert out.kv_connector_output.kv_connector_stats is None


def test_nothing_to_report_is_the_shared_empty_output(connector: _Connector) -> None:
    assert NPUModelRunner.kv_connector_no_forward(_idle_step(), VllmConfig()) is EMPTY_MODEL_RUNNER_OUTPUT
