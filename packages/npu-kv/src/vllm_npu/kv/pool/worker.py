# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The pool connector's worker half (one per TP rank): zero-copy puts and gets between the registered KV cache and
the Mooncake store, on a background thread.

A block's pool object is the concatenation of its bytes in every cache plane of every layer (layers sharing a cache
counted once), in :attr:`PoolWorker.layers` order. Stores run after the step's forward (``wait_for_save``) and never
block it; the scheduler keeps a finished request's blocks until its stores are done (vLLM's delayed free). A store
skips blocks the pool already holds; a failed store is logged and dropped. Loads run before the request's first step
(vLLM's asynchronous load: the request waits in ``WAITING_FOR_REMOTE_KVS``); a load whose object is missing, of
another size (a corrupt or foreign object) or unreadable is reported as failed, and the scheduler recomputes the
prompt (:class:`vllm_npu.kv.scheduler.PDScheduler`).

Device memory on an NPU: the cache is registered with the store as it is (``register_buffer``), as vllm-ascend's
pool does; that Mooncake's NPU build moves device memory registered this way is confirmable only on an Ascend host.
Before a background store reads device memory, it waits for an event recorded on the compute stream at
``wait_for_save`` (the forward's kernels may still run); the emulated device computes synchronously.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from vllm_npu.interface import current_mode, get_logger

from ..layout import LayerLayout, describe_layer
from .manager import PoolLoadStoreSpec, block_key, part_of
from .stats import PoolStats
from .store import PoolStore

logger = get_logger(__name__)


def _record_compute_event() -> Any:
    """An event on the NPU's current stream (None on the emulated device, whose ops finish when they return)."""
    mode = current_mode()
    if mode is None or mode.value != "npu":
        return None
    event = torch.npu.Event()  # type: ignore[attr-defined]
    event.record()
    return event


class PoolWorker:
    def __init__(self, store_factory: Any, ns: str, tp_rank: int, kv_lora_rank: int | None) -> None:
        self._store_factory = store_factory
        self.store: PoolStore | None = None
        self.ns = ns
        self.tp_rank = tp_rank
        self.kv_lora_rank = kv_lora_rank
        self.layers: list[LayerLayout] = []
        self.replicated = False
        self.block_bytes = 0
        self._lock = threading.Lock()
        # Loads and stores on threads of their own: a load (a request waiting to start) never queues behind stores.
        self._loads = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"npu-kv-pool-load-{tp_rank}")
        self._stores = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"npu-kv-pool-store-{tp_rank}")
        self._jobs = 0
        self._store_jobs: dict[str, int] = defaultdict(int)  # req_id -> store jobs still running
        self._waiting_for_store: set[str] = set()  # finished requests whose stores still run
        self._tracked: set[str] = set()  # requests with a store submitted (their free waits for us)
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._stats = PoolStats()

    # --- setup ---------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        seen: set[int] = set()
        for name, cache in kv_caches.items():
            layout = describe_layer(name, cache, self.kv_lora_rank)
            if layout.base in seen:
                continue  # a layer sharing another layer's cache
            seen.add(layout.base)
            self.layers.append(layout)
        self.replicated = all(layout.replicated for layout in self.layers)
        self.block_bytes = sum(p.block_bytes for layout in self.layers for p in layout.planes)
        self.store = self._store_factory()
        if not self.store.available:
            return
        regions = {(c.untyped_storage().data_ptr(), c.untyped_storage().nbytes()) for c in kv_caches.values()}
        for ptr, nbytes in sorted(regions):
            if not self.store.register(ptr, nbytes):
                logger.error("npu-kv pool: the KV cache could not be registered; serving without the pool")
                self.store.close()
                return
        logger.info(
            "npu-kv pool: %d cache layers registered, %d bytes per block, key part %s",
            len(self.layers),
            self.block_bytes,
            part_of(self.tp_rank, self.replicated),
        )

    def _buffers(self, block_id: int) -> tuple[list[int], list[int]]:
        addrs, sizes = [], []
        for layout in self.layers:
            for p in layout.planes:
                addrs.append(layout.base + p.offset + block_id * p.block_bytes)
                sizes.append(p.block_bytes)
        return addrs, sizes

    def _keys(self, hashes: list[bytes]) -> list[str]:
        part = part_of(self.tp_rank, self.replicated)
        return [block_key(self.ns, h, part) for h in hashes]

    # --- per step ------------------------------------------------------------------------------------------

    def start_load(self, reqs_to_load: dict[str, tuple[Any, Any]]) -> None:
        for req_id, (src, dst) in reqs_to_load.items():
            assert isinstance(src, PoolLoadStoreSpec)
            self._loads.submit(self._load, req_id, src.block_hashes, [int(b) for b in dst.block_ids])

    def start_store(self, reqs_to_store: dict[str, tuple[Any, Any]]) -> None:
        if not reqs_to_store:
            return
        event = _record_compute_event()
        for req_id, (src, dst) in reqs_to_store.items():
            assert isinstance(dst, PoolLoadStoreSpec)
            with self._lock:
                self._store_jobs[req_id] += 1
                self._tracked.add(req_id)
            self._stores.submit(self._store, req_id, dst.block_hashes, [int(b) for b in src.block_ids], event)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            for req_id in finished_req_ids:
                if req_id not in self._tracked:
                    continue
                if self._store_jobs.get(req_id):
                    self._waiting_for_store.add(req_id)
                else:
                    self._tracked.discard(req_id)
                    self._store_jobs.pop(req_id, None)
                    self._done_sending.add(req_id)
            sending, self._done_sending = self._done_sending, set()
            recving, self._done_recving = self._done_recving, set()
        return sending or None, recving or None

    def take_stats(self) -> PoolStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, PoolStats()
        return stats

    # --- background jobs -----------------------------------------------------------------------------------

    def _load(self, req_id: str, hashes: list[bytes], block_ids: list[int]) -> None:
        start = time.perf_counter()
        ok, nbytes = False, 0
        try:
            ok, nbytes = self.load(hashes, block_ids)
        except Exception as exc:
            logger.error("npu-kv pool: request %s: load failed (%s: %s)", req_id, type(exc).__name__, exc)
        with self._lock:
            if ok:
                self._stats.data["loaded_blocks"] += len(block_ids)
                self._stats.data["loaded_bytes"] += nbytes
                self._stats.data["load_seconds"] += time.perf_counter() - start
            else:
                self._stats.data["failed"].append(req_id)
            self._done_recving.add(req_id)

    def load(self, hashes: list[bytes], block_ids: list[int]) -> tuple[bool, int]:
        """Read the pool objects of ``hashes`` into blocks ``block_ids``; (whether every block arrived whole, bytes)."""
        if len(hashes) != len(block_ids):
            raise ValueError(f"{len(hashes)} pool blocks for {len(block_ids)} cache blocks")
        store = self.store
        if store is None or not store.available:
            return False, 0
        keys = self._keys(hashes)
        bufs = [self._buffers(b) for b in block_ids]
        res = store.get(keys, [a for a, _ in bufs], [s for _, s in bufs])
        bad = [(k, r) for k, r in zip(keys, res) if r != self.block_bytes]
        if bad:
            logger.warning(
                "npu-kv pool: %d of %d blocks missing, unreadable or of another size (first %s: %s; expected %d "
                "bytes); the prompt is recomputed",
                len(bad),
                len(keys),
                bad[0][0],
                bad[0][1],
                self.block_bytes,
            )
            return False, 0
        return True, self.block_bytes * len(keys)

    def _store(self, req_id: str, hashes: list[bytes], block_ids: list[int], event: Any) -> None:
        start = time.perf_counter()
        stored = errors = 0
        try:
            if event is not None:
                event.synchronize()
            stored, errors = self.save(hashes, block_ids)
        except Exception as exc:
            errors = len(hashes)
            logger.error("npu-kv pool: request %s: store failed (%s: %s)", req_id, type(exc).__name__, exc)
        with self._lock:
            self._stats.data["stored_blocks"] += stored
            self._stats.data["stored_bytes"] += stored * self.block_bytes
            self._stats.data["store_errors"] += errors
            self._stats.data["store_seconds"] += time.perf_counter() - start
            self._store_jobs[req_id] -= 1
            if self._store_jobs[req_id] <= 0 and req_id in self._waiting_for_store:
                self._waiting_for_store.discard(req_id)
                self._tracked.discard(req_id)
                del self._store_jobs[req_id]
                self._done_sending.add(req_id)

    def save(self, hashes: list[bytes], block_ids: list[int]) -> tuple[int, int]:
        """Put blocks ``block_ids`` under ``hashes``, skipping what the pool holds; (blocks stored, errors)."""
        if len(hashes) != len(block_ids):
            raise ValueError(f"{len(hashes)} pool blocks for {len(block_ids)} cache blocks")
        store = self.store
        if store is None or not store.available or (self.replicated and self.tp_rank != 0):
            return 0, 0  # no pool, or another rank stores the shared MLA blocks
        keys = self._keys(hashes)
        present = store.exists(keys)
        todo = [(k, b) for k, b, p in zip(keys, block_ids, present) if not p]
        if not todo:
            return 0, 0
        bufs = [self._buffers(b) for _, b in todo]
        res = store.put([k for k, _ in todo], [a for a, _ in bufs], [s for _, s in bufs])
        errors = [(k, r) for (k, _), r in zip(todo, res) if r != 0]
        if errors:
            logger.warning("npu-kv pool: %d of %d puts failed (first %s: %s)", len(errors), len(todo), *errors[0])
        return len(todo) - len(errors), len(errors)

    def shutdown(self) -> None:
        self._loads.shutdown(wait=True, cancel_futures=False)
        self._stores.shutdown(wait=True, cancel_futures=False)
        if self.store is not None:
            self.store.close()
