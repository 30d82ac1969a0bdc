# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A Mooncake store client (``mooncake.store.MooncakeDistributedStore``) behind a small handle that never raises
on the serving path.

Unreachable master at start: the handle reports ``available == False`` and the connector serves without the pool
(every lookup a miss, every load a recompute). The master's port is probed first (``master_timeout_s``): the
store's own ``setup`` retries an unreachable master for about 90 s (20 attempts, measured with
mooncake-transfer-engine-non-cuda 0.3.13.post1) before it returns -1. A master that dies later makes every call
return an error code at once (-900, measured) except a put, which retries for 4-9 s first: after an RPC failure the
handle counts the master as down for :data:`DOWN_S` seconds (lookups miss, loads fail and are recomputed, stores are
dropped, all at once), then probes its port before trying again, so a dead master never holds a finished request's
blocks for long.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from vllm_npu.interface import get_logger

from ..engine import MooncakeUnavailableError
from .config import PoolConfig

logger = get_logger(__name__)

#: Mooncake's error code for a failed RPC to the master (``ErrorCode::RPC_FAIL``).
RPC_FAIL = -900
#: Seconds the handle skips the store after an RPC failure.
DOWN_S = 5.0


def load_store_class() -> type:
    """``mooncake.store.MooncakeDistributedStore``, or :class:`MooncakeUnavailableError` naming the wheels."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise MooncakeUnavailableError(exc) from exc
    cls: type = MooncakeDistributedStore
    return cls


def master_reachable(config: PoolConfig) -> bool:
    """Whether the master's RPC port accepts a TCP connection within ``master_timeout_s``."""
    host, port = config.master_host_port
    try:
        with socket.create_connection((host, port), timeout=config.master_timeout_s):
            return True
    except OSError:
        return False


class PoolStore:
    """One store client. ``segment_size`` bytes of this process's host memory join the pool (0 for the
    scheduler's lookup-only client). Calls are serialised (the connector's threads share it)."""

    def __init__(self, config: PoolConfig, segment_size: int, what: str, store_cls: type | None = None) -> None:
        self.config = config
        self.what = what
        self._lock = threading.Lock()
        self._store: Any = None
        self._registered: list[int] = []
        self._down_until = 0.0
        if not master_reachable(config):
            logger.error(
                "npu-kv pool (%s): the Mooncake master at %s is unreachable (no answer within %.1f s); serving "
                "WITHOUT the KV pool until this instance restarts. Start the pool first (`vllm-npu kv-pool`) or "
                "fix master_server_address.",
                what,
                config.master_server_address,
                config.master_timeout_s,
            )
            return
        store = (store_cls or load_store_class())()
        rc = store.setup(
            config.local_hostname,
            config.metadata_server,
            segment_size,
            config.local_buffer_size,
            config.protocol,
            config.device_name,
            config.master_server_address,
        )
        if rc != 0:
            logger.error(
                "npu-kv pool (%s): MooncakeDistributedStore.setup(%r, %r, master %s, protocol %r) returned %s; "
                "serving WITHOUT the KV pool",
                what,
                config.local_hostname,
                config.metadata_server,
                config.master_server_address,
                config.protocol,
                rc,
            )
            return
        self._store = store
        logger.info("npu-kv pool (%s): connected to the Mooncake master at %s", what, config.master_server_address)

    @property
    def available(self) -> bool:
        return self._store is not None

    def _usable(self) -> bool:
        """Connected, and the master not counted as down (re-probed once the down interval is over)."""
        if self._store is None:
            return False
        if self._down_until == 0.0:
            return True
        if time.monotonic() < self._down_until:
            return False
        if master_reachable(self.config):
            logger.info("npu-kv pool (%s): the Mooncake master answers again", self.what)
            self._down_until = 0.0
            return True
        self._down_until = time.monotonic() + DOWN_S
        return False

    def _check(self, res: list[int], op: str) -> list[int]:
        if RPC_FAIL in res:
            if self._down_until == 0.0:
                logger.error(
                    "npu-kv pool (%s): %s: the Mooncake master at %s does not answer; the pool is skipped until it "
                    "does (requests are computed here)",
                    self.what,
                    op,
                    self.config.master_server_address,
                )
            self._down_until = time.monotonic() + DOWN_S
        return res

    def register(self, ptr: int, nbytes: int) -> bool:
        """Register memory for zero-copy puts and gets; False (logged) when the store refused it."""
        if self._store is None:
            return False
        with self._lock:
            rc = self._store.register_buffer(ptr, nbytes)
        if rc != 0:
            logger.error("npu-kv pool (%s): register_buffer(%#x, %d) returned %s", self.what, ptr, nbytes, rc)
            return False
        self._registered.append(ptr)
        return True

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether the pool holds it (an error counts as absent)."""
        if not keys or not self._usable():
            return [False] * len(keys)
        try:
            with self._lock:
                res = self._check(self._store.batch_is_exist(list(keys)), "batch_is_exist")
        except Exception as exc:  # a store error is a miss, never a failed request
            logger.warning("npu-kv pool (%s): batch_is_exist failed: %s", self.what, exc)
            return [False] * len(keys)
        return [r == 1 for r in res]

    def put(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """Store each key's buffers (concatenated) from registered memory; per key 0 or a negative error code."""
        if not keys:
            return []
        if not self._usable():
            return [RPC_FAIL] * len(keys)
        with self._lock:
            res: list[int] = self._store.batch_put_from_multi_buffers(
                list(keys), [list(a) for a in addrs], [list(s) for s in sizes]
            )
        return self._check(res, "batch_put_from_multi_buffers")

    def get(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """Read each key into its buffers (registered memory); per key the bytes read or a negative error code.
        A stored object of another size than the buffers' total is an error (-600), never a partial read."""
        if not keys:
            return []
        if not self._usable():
            return [RPC_FAIL] * len(keys)
        with self._lock:
            res: list[int] = self._store.batch_get_into_multi_buffers(
                list(keys), [list(a) for a in addrs], [list(s) for s in sizes], False
            )
        return self._check(res, "batch_get_into_multi_buffers")

    def close(self) -> None:
        if self._store is None:
            return
        with self._lock:
            for ptr in self._registered:
                self._store.unregister_buffer(ptr)
            self._registered.clear()
            self._store.close()
            self._store = None
