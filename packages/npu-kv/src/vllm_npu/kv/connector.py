# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``MooncakeConnector``: vLLM's KV connector interface (V1) on the Mooncake transfer engine.

Use it with ``--kv-transfer-config '{"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}'`` on the
prefill instance and ``"kv_role": "kv_consumer"`` on the decode instance (``kv_ip``/``kv_port``: the prefill side's
side-channel address; each TP rank listens on ``kv_port + rank``), and the proxy (``vllm-npu pd-proxy``) in front.
The decode side pulls (Mooncake reads) the prompt's blocks before the request's first decode step; see
:mod:`._scheduler_side` and :mod:`._worker_side` for the two halves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ._scheduler_side import SchedulerSide
from ._worker_side import WorkerSide
from .metadata import MooncakeConnectorMetadata, MooncakeTransferStats, failed_request_ids
from .settings import connector_settings

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class MooncakeConnector(KVConnectorBase_V1):
    """Prefill-decode KV transfer over Mooncake; ``kv_role`` kv_producer (prefill), kv_consumer (decode) or kv_both."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        # vLLM 0.11.1 builds registered connectors with the KV-cache config as a third argument (0.11.0: two);
        # the base class takes it where vLLM passes it.
        extra = () if kv_cache_config is None else (kv_cache_config,)
        cast(Any, super()).__init__(vllm_config, role, *extra)
        settings = connector_settings(vllm_config)
        assert vllm_config.kv_transfer_config is not None  # vLLM builds a connector only from one
        engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(
                settings,
                engine_id,
                vllm_config.parallel_config.tensor_parallel_size,
                vllm_config.cache_config.block_size,
            )
        else:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            mc = vllm_config.model_config
            kv_lora_rank = getattr(mc.hf_text_config, "kv_lora_rank", None) if mc.use_mla else None
            self.worker = WorkerSide(
                settings,
                engine_id,
                get_tensor_model_parallel_rank(),
                get_tensor_model_parallel_world_size(),
                vllm_config.cache_config.block_size,
                kv_lora_rank,
            )

    def _sched(self) -> SchedulerSide:
        assert self.scheduler is not None, "a scheduler-side method called on the worker connector"
        return self.scheduler

    def _work(self) -> WorkerSide:
        assert self.worker is not None, "a worker-side method called on the scheduler connector"
        return self.worker

    # --- scheduler side ------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        failed = failed_request_ids(connector_output.kv_connector_stats, type(self).__name__)
        if failed:
            self._sched().record_failures(failed)

    def load_failed(self, req_id: str) -> bool:
        """Scheduler side: whether ``req_id``'s KV pull failed on a worker (asked once; see :mod:`.scheduler`)."""
        return self._sched().take_failure(req_id)

    # --- worker side ---------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeConnectorMetadata)
        self._work().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: the scheduler runs a pulled request only once its whole pull finished."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Nothing to save: the decode side pulls from the prefill side's own cache, which stays held."""

    def wait_for_save(self) -> None:
        """Nothing to wait for (see :meth:`save_kv_layer`)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._work().take_stats() if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return MooncakeTransferStats.from_data(data)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
