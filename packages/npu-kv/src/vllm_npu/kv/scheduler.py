# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``PDScheduler``: vLLM's V1 scheduler, plus recomputing a request whose KV pull (PD) or pool load failed.

vLLM 0.11's scheduler has no path for a failed asynchronous load: once the connector reports a request as received,
it takes every allocated block as computed. With this scheduler (``--scheduler-cls
vllm_npu.kv.scheduler.PDScheduler``; the NPU platform selects it when the Mooncake connector is configured) a
request whose pull the connector reports as failed gives its blocks back and is scheduled again from token 0, now
without remote prefill: the decode instance computes the prompt itself, so a dead or unreachable prefill instance
costs time, never wrong tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.core.sched.scheduler import Scheduler
from vllm_npu.interface import get_logger

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = get_logger(__name__)


class PDScheduler(Scheduler):
    def _update_waiting_for_remote_kv(self, request: Request) -> bool:
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

        from .connector import MooncakeConnector
        from .pool.connector import MooncakeStoreConnector

        req_id = request.request_id
        # Ours alone, or inside vLLM's MultiConnector (e.g. PD + pool): ask each of ours (each forgets on asking).
        connector = self.connector
        connectors = connector._connectors if isinstance(connector, MultiConnector) else [connector]
        ours = [c for c in connectors if isinstance(c, (MooncakeConnector, MooncakeStoreConnector))]
        if req_id in self.finished_recving_kv_req_ids and any([c.load_failed(req_id) for c in ours]):
            self.finished_recving_kv_req_ids.remove(req_id)
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            logger.warning("npu-kv: request %s: remote KV unavailable; computing its prompt on this instance", req_id)
            return True
        ready: bool = super()._update_waiting_for_remote_kv(request)
        return ready
