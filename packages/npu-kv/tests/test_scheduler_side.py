# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The scheduler half: which tokens are external, the receive and send tasks, and the params both sides exchange."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.request import RequestStatus
from vllm_npu.interface import ConfigError
from vllm_npu.kv._scheduler_side import SchedulerSide
from vllm_npu.kv.params import RemotePrefill, TransferParamsError
from vllm_npu.kv.settings import ConnectorSettings, connector_settings

SETTINGS = ConnectorSettings("127.0.0.1", 20000, 30.0, 5.0, "kv_both")


def request(rid: str, n: int, params: dict[str, Any] | None, status=RequestStatus.WAITING) -> Any:
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(n)), kv_transfer_params=params, status=status)


def blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_unhashed_block_ids=lambda: ids)


REMOTE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [7, 8, 9],
    "remote_engine_id": "p",
    "remote_host": "127.0.0.1",
    "remote_port": 20000,
    "tp_size": 2,
    "remote_request_id": "p-req",
}


def test_decode_side_loads_the_uncomputed_prompt_once() -> None:
    s = SchedulerSide(SETTINGS, "d", 1, 16)
    req = request("r", 40, dict(REMOTE))
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)
    assert s.get_num_new_matched_tokens(req, 16) == (24, True)  # a local prefix hit of one block
    assert s.get_num_new_matched_tokens(req, 40) == (0, False)
    s.update_state_after_alloc(req, blocks([3, 4]), 24)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    meta = s.build_connector_meta(None)
    task = meta.reqs_to_recv["r"]
    assert task.local_block_ids == (3, 4) and task.remote == RemotePrefill.parse(REMOTE)
    assert task.remote.request_id == "p-req" and task.remote.tp_size == 2
    assert s.build_connector_meta(None).reqs_to_recv == {}  # reset per step
    # Loaded once: the params now say no remote prefill.
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)


def test_full_local_hit_still_releases_the_prefill_side() -> None:
    s = SchedulerSide(SETTINGS, "d", 1, 16)
    req = request("r", 32, dict(REMOTE))
    s.update_state_after_alloc(req, blocks([]), 0)
    assert s.build_connector_meta(None).reqs_to_recv["r"].local_block_ids == ()


def test_bad_params_mean_a_local_prefill() -> None:
    s = SchedulerSide(SETTINGS, "d", 1, 16)
    bad = {**REMOTE, "remote_port": "x"}
    req = request("r", 10, bad)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, blocks([1]), 0)
    assert s.build_connector_meta(None).reqs_to_recv == {}
    with pytest.raises(TransferParamsError, match="lacks \\['remote_block_ids'"):
        RemotePrefill.parse({"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "h", "remote_port": 1})


def test_prefill_side_holds_blocks_of_a_length_capped_request() -> None:
    s = SchedulerSide(SETTINGS, "p", 2, 16)
    req = request("r", 20, {"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED)
    before = time.monotonic()
    delay, params = s.request_finished(req, [4, 5, 6])  # 20 prompt tokens: 2 blocks (+ the sampled token's)
    assert delay is True
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [4, 5],
        "remote_engine_id": "p",
        "remote_host": "127.0.0.1",
        "remote_port": 20000,
        "tp_size": 2,
        "remote_request_id": "r",
    }
    expiry = s.build_connector_meta(None).reqs_to_send["r"]
    assert before + 30 <= expiry <= time.monotonic() + 30


@pytest.mark.parametrize(
    ("params", "status", "ids"),
    [
        ({"do_remote_decode": True}, RequestStatus.FINISHED_ABORTED, [1]),  # aborted: nothing to pull
        ({"do_remote_decode": True}, RequestStatus.FINISHED_STOPPED, [1]),  # EOS on the first token
        ({"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED, []),
        (None, RequestStatus.FINISHED_LENGTH_CAPPED, [1]),
        (dict(REMOTE), RequestStatus.FINISHED_ABORTED, [1]),  # a decode request aborted before its load
    ],
)
def test_requests_that_free_at_once(params, status, ids) -> None:
    s = SchedulerSide(SETTINGS, "p", 1, 16)
    assert s.request_finished(request("r", 5, params, status), ids) == (False, None)
    assert s.build_connector_meta(None).reqs_to_send == {}


def test_failures_are_asked_once() -> None:
    s = SchedulerSide(SETTINGS, "d", 1, 16)
    s.record_failures(["a"])
    assert s.take_failure("a") and not s.take_failure("a") and not s.take_failure("b")


def _config(extra: dict[str, Any], role: str = "kv_producer", dp_rank: int = 0, tp: int = 2) -> Any:
    kvc = SimpleNamespace(kv_ip="127.0.0.1", kv_port=14579, kv_role=role, kv_connector_extra_config=extra)
    par = SimpleNamespace(data_parallel_rank=dp_rank, tensor_parallel_size=tp)
    return SimpleNamespace(kv_transfer_config=kvc, parallel_config=par)


def test_settings() -> None:
    s = connector_settings(_config({"abort_timeout_s": 5}, dp_rank=1))
    assert (s.base_port, s.abort_timeout_s, s.handshake_timeout_s, s.is_producer, s.is_consumer) == (
        14581,
        5.0,
        10.0,
        True,
        False,
    )
    with pytest.raises(ConfigError, match="unknown keys \\['abort_timeout'\\]"):
        connector_settings(_config({"abort_timeout": 5}))
    with pytest.raises(ConfigError, match="positive number of seconds"):
        connector_settings(_config({"handshake_timeout_s": 0}))
