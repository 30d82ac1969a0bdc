# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The scheduler half of :class:`~vllm_npu.kv.connector.MooncakeConnector` (runs in the engine-core process).

Decode side: a request whose ``kv_transfer_params`` say ``do_remote_prefill`` reports its uncomputed prompt tokens
as external and asynchronously loaded; once vLLM has allocated their blocks the request becomes a receive task for
the workers. Prefill side: a request that finishes by length (the proxy sends ``max_tokens=1``) with
``do_remote_decode`` keeps its blocks (``request_finished`` returns True) and answers with the params that tell the
decode side where to pull from; the workers free them when the decode side says it is done, or at the timeout.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus
from vllm_npu.interface import get_logger

from .metadata import MooncakeConnectorMetadata, RecvTask
from .params import RemotePrefill, TransferParamsError
from .settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, engine_id: str, tp_size: int, block_size: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self.engine_id = engine_id
        self.tp_size = tp_size
        self._recv: dict[str, RecvTask] = {}
        self._send: dict[str, float] = {}
        # Requests whose load failed on some worker (reported through the connector stats); the scheduler
        # (vllm_npu.kv.scheduler.PDScheduler) recomputes their prompt locally.
        self._failed: set[str] = set()
        self._lock = threading.Lock()

    @staticmethod
    def _remote(request: Request) -> RemotePrefill | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            return RemotePrefill.parse(params)
        except TransferParamsError as exc:
            logger.warning("request %s: %s; its prompt is computed locally", request.request_id, exc)
            return None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self._remote(request) is None:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        remote = self._remote(request)
        if remote is not None:
            # With no external tokens (a full local prefix hit) the task still goes to the workers: the prefill
            # side holds the blocks until it hears from every decode rank.
            local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
            self._recv[request.request_id] = RecvTask(tuple(local), remote)
        params["do_remote_prefill"] = False  # load once; a preempted request recomputes

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MooncakeConnectorMetadata:
        meta = MooncakeConnectorMetadata(reqs_to_recv=self._recv, reqs_to_send=self._send)
        self._recv, self._send = {}, {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids:
            # Aborted, stopped on EOS, or nothing cached: there is nothing for a decode instance to pull.
            return False, None
        self._send[request.request_id] = time.monotonic() + self.settings.abort_timeout_s
        # Only the prompt's blocks carry KV the decode side needs (all are held until it is done).
        prompt_blocks = -(-len(request.prompt_token_ids or ()) // self.block_size)
        remote = RemotePrefill(
            tuple(block_ids[:prompt_blocks]),
            self.engine_id,
            self.settings.host,
            self.settings.base_port,
            self.tp_size,
            request.request_id,
        )
        return True, remote.to_params()

    def record_failures(self, req_ids: list[str]) -> None:
        with self._lock:
            self._failed.update(req_ids)

    def take_failure(self, req_id: str) -> bool:
        """Whether ``req_id``'s load failed (and forget it)."""
        with self._lock:
            if req_id in self._failed:
                self._failed.discard(req_id)
                return True
            return False
