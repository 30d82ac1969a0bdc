# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The worker half of :class:`~vllm_npu.kv.connector.MooncakeConnector` (one per TP rank).

Every worker registers its KV cache with a Mooncake engine. A prefill worker serves its side channel
(:mod:`.side_channel`): the handshake and the decode side's ``done`` messages, which free the held blocks. A decode
worker pulls each receive task on a background thread: handshake with every prefill rank (cached per rank), one
batched Mooncake read per prefill rank, a head scatter when the TP sizes differ, then ``done`` to every prefill
rank (also when the pull failed, so the prefill side never holds blocks for a dead transfer). A failed pull is
reported as finished *and* failed (the connector stats carry it to the scheduler, which recomputes the prompt).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from vllm_npu.interface import current_mode, get_logger

from .engine import PROTOCOLS, TransferEngineHandle
from .layout import (
    HeadSlice,
    LayerLayout,
    LayoutError,
    block_runs,
    describe_layer,
    head_sources,
    plane_view,
    scatter_heads,
)
from .metadata import MooncakeConnectorMetadata, MooncakeTransferStats, RecvTask
from .settings import ConnectorSettings
from .side_channel import AgentMetadata, SideChannelClient, SideChannelServer

logger = get_logger(__name__)


class WorkerSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        block_size: int,
        kv_lora_rank: int | None,
        engine_cls: type | None = None,
    ) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.block_size = block_size
        self.kv_lora_rank = kv_lora_rank
        self._engine_cls = engine_cls
        self.engine: TransferEngineHandle | None = None
        self.layers: dict[str, LayerLayout] = {}
        self.caches: dict[str, torch.Tensor] = {}
        self.server: SideChannelServer | None = None
        self._lock = threading.Lock()
        self._send_deadline: dict[str, float] = {}
        self._notified: dict[str, set[int]] = {}
        self._notify_expected: dict[str, int] = {}
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._stats = MooncakeTransferStats()
        self._agents: dict[tuple[str, int], AgentMetadata] = {}
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"npu-kv-pull-{tp_rank}")

    # --- setup ---------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        mode = current_mode()
        protocol = PROTOCOLS["npu" if mode is not None and mode.value == "npu" else "emulated"]
        self.engine = TransferEngineHandle(self.settings.host, protocol, engine_cls=self._engine_cls)
        seen: set[tuple[int, int]] = set()
        for name, cache in kv_caches.items():
            layout = describe(name, cache, self.kv_lora_rank)
            self.layers[name] = layout
            self.caches[name] = cache
            storage = cache.untyped_storage()
            region = (storage.data_ptr(), storage.nbytes())
            if region not in seen:
                seen.add(region)
                self.engine.register(*region)
        if self.settings.is_producer:
            meta = AgentMetadata(
                self.engine_id,
                self.tp_rank,
                self.tp_size,
                self.engine.session_id,
                self.block_size,
                tuple(self.layers.values()),
            )
            self.server = SideChannelServer(
                self.settings.host, self.settings.base_port + self.tp_rank, meta, self._on_done
            )
        logger.info(
            "npu-kv: %d KV cache layers registered with Mooncake (%s, session %s)%s",
            len(self.layers),
            protocol,
            self.engine.session_id,
            f"; side channel {self.server.address}" if self.server else "",
        )

    # --- prefill side --------------------------------------------------------------------------------------

    def _on_done(self, req_id: str, rank: int, tp_size: int) -> None:
        with self._lock:
            self._notified.setdefault(req_id, set()).add(rank)
            self._notify_expected[req_id] = tp_size
            self._release_if_done(req_id)

    def _release_if_done(self, req_id: str) -> None:
        ranks = self._notified.get(req_id)
        if req_id in self._send_deadline and ranks is not None and len(ranks) >= self._notify_expected[req_id]:
            del self._send_deadline[req_id], self._notified[req_id], self._notify_expected[req_id]
            self._done_sending.add(req_id)

    # --- per step ------------------------------------------------------------------------------------------

    def start_load_kv(self, meta: MooncakeConnectorMetadata) -> None:
        with self._lock:
            for req_id, deadline in meta.reqs_to_send.items():
                self._send_deadline[req_id] = deadline
                self._release_if_done(req_id)
        for req_id, task in meta.reqs_to_recv.items():
            self._pool.submit(self._pull_and_report, req_id, task)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        now = time.monotonic()
        with self._lock:
            for req_id in [r for r, d in self._send_deadline.items() if d < now]:
                logger.warning(
                    "npu-kv: request %s: no decode instance pulled its KV within abort_timeout_s=%s; freeing its "
                    "blocks",
                    req_id,
                    self.settings.abort_timeout_s,
                )
                del self._send_deadline[req_id]
                self._notified.pop(req_id, None)
                self._notify_expected.pop(req_id, None)
                self._done_sending.add(req_id)
                self._stats.data["expired"] += 1
            sending, self._done_sending = self._done_sending, set()
            recving, self._done_recving = self._done_recving, set()
        return sending or None, recving or None

    def take_stats(self) -> MooncakeTransferStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, MooncakeTransferStats()
        return stats

    # --- decode side ---------------------------------------------------------------------------------------

    def _client(self, host: str, port: int) -> SideChannelClient:
        clients: dict[tuple[str, int], SideChannelClient] = self._local.__dict__.setdefault("clients", {})
        if (host, port) not in clients:
            clients[(host, port)] = SideChannelClient(host, port, self.settings.handshake_timeout_s)
        return clients[(host, port)]

    def _agent(self, host: str, port: int) -> AgentMetadata:
        key = (host, port)
        with self._lock:
            agent = self._agents.get(key)
        if agent is None:
            agent = self._client(host, port).metadata()
            if agent.block_size != self.block_size:
                raise LayoutError(
                    f"the prefill instance uses block_size={agent.block_size}, this decode instance "
                    f"{self.block_size}; start both with the same --block-size"
                )
            with self._lock:
                self._agents[key] = agent
        return agent

    def _pull_and_report(self, req_id: str, task: RecvTask) -> None:
        remote = task.remote
        failed = False
        start = time.perf_counter()
        nbytes = 0
        try:
            nbytes = self.pull(task)
        except Exception as exc:
            failed = True
            logger.error(
                "npu-kv: request %s: pulling its KV from %s:%d failed (%s: %s); its prompt is recomputed here",
                req_id,
                remote.host,
                remote.port,
                type(exc).__name__,
                exc,
            )
            with self._lock:
                # A failed handshake may mean the prefill instance restarted: handshake again next time.
                self._agents = {k: v for k, v in self._agents.items() if k[0] != remote.host}
        elapsed = time.perf_counter() - start
        # The prefill instance knows the request by its own id (older peers send none: then both ids agree).
        remote_id = remote.request_id or req_id
        for rank in range(remote.tp_size):
            try:
                self._client(remote.host, remote.port + rank).done(remote_id, self.tp_rank, self.tp_size)
            except Exception as exc:  # the prefill side frees at its timeout instead
                logger.warning("npu-kv: request %s: could not tell prefill rank %d it is done: %s", req_id, rank, exc)
        with self._lock:
            if failed:
                self._stats.data["failed"].append(req_id)
            else:
                self._stats.data["transfers"] += 1
                self._stats.data["bytes"] += nbytes
                self._stats.data["seconds"] += elapsed
            self._done_recving.add(req_id)

    def pull(self, task: RecvTask) -> int:
        """Read the task's blocks into this worker's cache; returns the bytes moved. Raises on any failure."""
        assert self.engine is not None, "register_kv_caches runs before any transfer"
        local_ids = task.local_block_ids
        remote = task.remote
        agents = [self._agent(remote.host, remote.port + r) for r in range(remote.tp_size)]
        if not local_ids:
            return 0
        if len(remote.block_ids) < len(local_ids):
            raise LayoutError(f"the prefill side sent {len(remote.block_ids)} blocks for {len(local_ids)} local blocks")
        plan = _PullPlan(local_ids, remote.block_ids[len(remote.block_ids) - len(local_ids) :])
        seen: set[int] = set()
        for name, layout in self.layers.items():
            if layout.base in seen:
                continue  # a layer sharing another layer's cache
            seen.add(layout.base)
            src = {r: _remote_layer(a, name) for r, a in enumerate(agents)}
            for rank, head_slice in self._sources(layout, src, remote.tp_size):
                if head_slice is None:
                    plan.add_direct(rank, name, layout, src[rank])
                else:
                    plan.add_staged(rank, name, layout, src[rank], head_slice, self.caches[name], self.block_size)
        return self._run(plan, agents)

    def _sources(
        self, layout: LayerLayout, src: dict[int, LayerLayout], remote_tp: int
    ) -> list[tuple[int, HeadSlice | None]]:
        """The prefill ranks one local layer reads from; None: whole blocks, else the heads to stage and scatter."""
        if layout.replicated:
            return [(self.tp_rank % remote_tp, None)]
        slices = head_sources(self.tp_rank, self.tp_size, layout.planes[0].heads, remote_tp, src[0].planes[0].heads)
        direct = (
            len(slices) == 1 and slices[0].count == layout.planes[0].heads == src[slices[0].src_rank].planes[0].heads
        )
        return [(slices[0].src_rank, None)] if direct else [(s.src_rank, s) for s in slices]

    def _run(self, plan: _PullPlan, agents: list[AgentMetadata]) -> int:
        """One batched Mooncake read per prefill rank, then the head scatters; staging buffers registered meanwhile."""
        assert self.engine is not None
        for buf in plan.staging:
            self.engine.register(buf.data_ptr(), buf.numel())
        try:
            total = 0
            for rank, (local_addr, remote_addr, lengths) in plan.reads.items():
                self.engine.read(agents[rank].session_id, local_addr, remote_addr, lengths)
                total += sum(lengths)
            for buf, dst, src_start, dst_start, count in plan.staged:
                scatter_heads(buf, dst, plan.local_ids, src_start, dst_start, count)
        finally:
            for buf in plan.staging:
                self.engine.unregister(buf.data_ptr())
        return total

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.engine is not None:
            self.engine.close()


class _PullPlan:
    """The reads of one pull, batched per prefill rank as ``(local addresses, remote addresses, byte lengths)``, and
    the staging buffers whose heads are scattered into the cache after the reads (TP sizes that differ)."""

    def __init__(self, local_ids: Sequence[int], remote_ids: Sequence[int]) -> None:
        self.local_ids = local_ids
        self.remote_ids = remote_ids
        self.reads: dict[int, tuple[list[int], list[int], list[int]]] = {}
        # (staging buffer, destination plane view, src_start, dst_start, head count) per staged plane.
        self.staged: list[tuple[torch.Tensor, torch.Tensor, int, int, int]] = []

    @property
    def staging(self) -> list[torch.Tensor]:
        return [entry[0] for entry in self.staged]

    def _reads(self, rank: int) -> tuple[list[int], list[int], list[int]]:
        return self.reads.setdefault(rank, ([], [], []))

    def add_direct(self, rank: int, name: str, layout: LayerLayout, rlayout: LayerLayout) -> None:
        """Whole blocks of every plane, read straight into the cache."""
        local_addr, remote_addr, lengths = self._reads(rank)
        for lp, rp in zip(layout.planes, rlayout.planes):
            if lp.block_bytes != rp.block_bytes:
                raise LayoutError(
                    f"layer {name}: a block is {lp.block_bytes} bytes here and {rp.block_bytes} on the "
                    "prefill side; both instances must run the same model, dtype and block size"
                )
            for ls, rs, n in block_runs(self.local_ids, self.remote_ids):
                local_addr.append(layout.base + lp.offset + ls * lp.block_bytes)
                remote_addr.append(rlayout.base + rp.offset + rs * rp.block_bytes)
                lengths.append(n * lp.block_bytes)

    def add_staged(
        self,
        rank: int,
        name: str,
        layout: LayerLayout,
        rlayout: LayerLayout,
        head_slice: HeadSlice,
        cache: torch.Tensor,
        block_size: int,
    ) -> None:
        """Every plane of the remote rank's blocks read into a staging buffer, whose ``head_slice`` heads are then
        scattered into the cache (:func:`.layout.scatter_heads`)."""
        local_addr, remote_addr, lengths = self._reads(rank)
        for i, (lp, rp) in enumerate(zip(layout.planes, rlayout.planes)):
            if lp.head_bytes != rp.head_bytes:
                raise LayoutError(f"layer {name}: head size/dtype differ between the prefill and decode side")
            buf = torch.empty(
                (len(self.local_ids), block_size, rp.heads, rp.head_bytes), dtype=torch.uint8, device=cache.device
            )
            for si, rs, n in block_runs(range(len(self.local_ids)), self.remote_ids):
                local_addr.append(buf.data_ptr() + si * rp.block_bytes)
                remote_addr.append(rlayout.base + rp.offset + rs * rp.block_bytes)
                lengths.append(n * rp.block_bytes)
            dst = plane_view(cache.view(torch.uint8), layout, i)
            self.staged.append((buf, dst, head_slice.src_start, head_slice.dst_start, head_slice.count))


def describe(name: str, cache: Any, kv_lora_rank: int | None) -> LayerLayout:
    if not isinstance(cache, torch.Tensor):
        raise LayoutError(
            f"KV cache {name} is a {type(cache).__name__}, not one tensor; this connector moves the "
            "npu-attention caches (one tensor per layer)"
        )
    return describe_layer(name, cache, kv_lora_rank)


def _remote_layer(agent: AgentMetadata, name: str) -> LayerLayout:
    for layer in agent.layers:
        if layer.name == name:
            return layer
    raise LayoutError(f"the prefill worker {agent.tp_rank} has no KV cache layer {name}; are both running one model?")
