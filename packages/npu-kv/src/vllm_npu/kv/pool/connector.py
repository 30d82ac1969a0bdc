# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``MooncakeStoreConnector``: a KV pool shared by instances, on the Mooncake store (``mooncake_master`` and the
store client of the Mooncake wheels). Also registered as ``MooncakeConnectorStoreV1``, the name vllm-ascend users
configure, and reading the same ``MOONCAKE_CONFIG_PATH`` keys (:mod:`.config`).

``--kv-transfer-config '{"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}'`` with
``MOONCAKE_CONFIG_PATH`` naming the store config (or its keys in ``kv_connector_extra_config``). Every instance
sharing a pool must set the same ``PYTHONHASHSEED``: vLLM seeds its prefix block hashes, the pool's keys, with it.

Scheduler side: vLLM's own offloading scheduler logic (``OffloadingConnectorScheduler``) over :class:`.PoolManager`:
a request's prefix blocks the pool holds (all TP ranks' parts) are loaded asynchronously before its first step; its
computed full blocks are stored as they complete; a finished request's blocks are freed once its stores are done.
A load that failed on any worker is recomputed (``failed`` in the connector stats, :class:`~vllm_npu.kv.scheduler.
PDScheduler`), and that request does not ask the pool again.
"""

from __future__ import annotations

import os
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnectorMetadata,
    OffloadingConnectorScheduler,
)
from vllm_npu.interface import ConfigError, get_logger

from ..metadata import failed_request_ids
from .config import pool_config
from .manager import PoolManager, namespace, parts
from .stats import PoolStats
from .store import PoolStore
from .worker import PoolWorker

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)


class _SpecView:
    """What ``OffloadingConnectorScheduler`` reads of an ``OffloadingSpec``: block sizes and the manager."""

    def __init__(self, block_size: int, manager: PoolManager) -> None:
        self.gpu_block_size = block_size
        self.offloaded_block_size = block_size
        self._manager = manager

    def get_manager(self) -> PoolManager:
        return self._manager


def _check_hash_seed(environ: Any = os.environ) -> None:
    if not environ.get("PYTHONHASHSEED"):
        raise ConfigError(
            "the KV pool keys blocks by vLLM's prefix block hashes, which are random per process unless "
            "PYTHONHASHSEED is set: set PYTHONHASHSEED to the same value (e.g. 0) on every instance that shares the pool"
        )


class MooncakeStoreConnector(KVConnectorBase_V1):
    """A KV pool on the Mooncake store; ``kv_role`` kv_both (load and store), kv_producer (store only) or
    kv_consumer (load only)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        extra = () if kv_cache_config is None else (kv_cache_config,)
        cast(Any, super()).__init__(vllm_config, role, *extra)
        kvc = vllm_config.kv_transfer_config
        assert kvc is not None  # vLLM builds a connector only from one
        _check_hash_seed()
        config = pool_config(kvc.kv_connector_extra_config)
        if vllm_config.cache_config.enable_prefix_caching is False:
            raise ConfigError(
                "the KV pool needs prefix caching (its keys are the prefix block hashes): drop "
                "--no-enable-prefix-caching"
            )
        self.can_load = kvc.kv_role in ("kv_both", "kv_consumer")
        self.can_store = kvc.kv_role in ("kv_both", "kv_producer")
        mc = vllm_config.model_config
        ns = namespace(vllm_config)
        block_size = vllm_config.cache_config.block_size
        self.scheduler: OffloadingConnectorScheduler | None = None
        self.worker: PoolWorker | None = None
        self._no_pool: set[str] = set()  # requests whose load failed: computed locally from now on
        self._failed: set[str] = set()
        if role == KVConnectorRole.SCHEDULER:
            store = PoolStore(config, 0, "scheduler")
            manager = PoolManager(store, ns, parts(vllm_config.parallel_config.tensor_parallel_size, mc.use_mla))
            self.scheduler = OffloadingConnectorScheduler(cast(Any, _SpecView(block_size, manager)))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            kv_lora_rank = getattr(mc.hf_text_config, "kv_lora_rank", None) if mc.use_mla else None
            factory = partial(PoolStore, config, config.global_segment_size, f"worker tp{rank}")
            self.worker = PoolWorker(factory, ns, rank, kv_lora_rank)

    def _sched(self) -> OffloadingConnectorScheduler:
        assert self.scheduler is not None, "a scheduler-side method called on the worker connector"
        return self.scheduler

    def _work(self) -> PoolWorker:
        assert self.worker is not None, "a worker-side method called on the scheduler connector"
        return self.worker

    # --- scheduler side ------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.can_load or request.request_id in self._no_pool:
            return 0, False
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self._sched().build_connector_meta(scheduler_output)
        assert isinstance(meta, OffloadingConnectorMetadata)
        if not self.can_store:
            sched = self._sched()
            for req_id in meta.reqs_to_store:
                sched._reqs_being_stored.pop(req_id, None)
            meta.reqs_to_store = {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)
        failed = set(failed_request_ids(connector_output.kv_connector_stats, type(self).__name__))
        if failed:
            self._failed |= failed
            self._no_pool |= failed
            for req_id in failed:
                # Its blocks are recomputed from token 0: store them again as they complete.
                self._sched()._next_stored_block_idx.pop(req_id, None)

    def load_failed(self, req_id: str) -> bool:
        """Scheduler side: whether ``req_id``'s pool load failed on a worker (asked once; see :mod:`..scheduler`)."""
        if req_id in self._failed:
            self._failed.discard(req_id)
            return True
        return False

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._no_pool.discard(request.request_id)
        self._failed.discard(request.request_id)
        delay, params = self._sched().request_finished(request, block_ids)
        return delay, params

    # --- worker side ---------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadingConnectorMetadata)
        self._work().start_load(meta.reqs_to_load)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a loading request runs only once its whole load finished."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Nothing per layer: whole blocks are stored after the forward (:meth:`wait_for_save`)."""

    def wait_for_save(self) -> None:
        """Start the step's stores in the background (the step does not wait for them)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadingConnectorMetadata)
        self._work().start_store(meta.reqs_to_store)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished(finished_req_ids)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._work().take_stats() if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PoolStats.from_data(data)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        elif self.scheduler is not None:
            manager = self.scheduler.manager
            if isinstance(manager, PoolManager):
                manager.store.close()
