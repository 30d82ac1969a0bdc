# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The Mooncake transfer engine, loaded on demand, behind a small typed handle.

Both Mooncake builds this package supports expose ``mooncake.engine.TransferEngine``: the NPU build
(``mooncake-transfer-engine-npu``, protocol ``ascend``, device memory registered directly) and the non-CUDA build
(``mooncake-transfer-engine-non-cuda``, protocol ``tcp``, host memory; what the emulated device uses). The engine
runs in peer-to-peer mode (``P2PHANDSHAKE``): no metadata server; a peer is addressed as ``"host:rpc_port"``, the
port each engine picks at ``initialize`` (:attr:`TransferEngineHandle.rpc_port`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from vllm_npu.interface import NPUPluginError

#: The Debian packages the non-CUDA Mooncake wheel links against (it ships no copy of them).
APT_PACKAGES = ("libibverbs1", "librdmacm1", "libnuma1")
APT_LINE = "apt-get install -y " + " ".join(APT_PACKAGES)

#: The transfer protocol per device mode: the NPU build moves device memory over HCCS/RoCE, the emulated device's
#: caches live in host memory and go over TCP.
PROTOCOLS = {"npu": "ascend", "emulated": "tcp"}


class MooncakeUnavailableError(NPUPluginError, ImportError):
    """The Mooncake transfer engine cannot be imported; the message names the wheel and the system packages."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause
        super().__init__(
            f"the Mooncake transfer engine (mooncake.engine) cannot be loaded: {type(cause).__name__}: {cause}. "
            'On Ascend hosts install it with: pip install "npu-platform[kv-ascend]" (mooncake-transfer-engine-npu); '
            'on CPU hosts (emulated device) with: pip install "npu-platform[kv-emulated]" '
            f"(mooncake-transfer-engine-non-cuda), which also needs the system libraries: {APT_LINE}"
        )


class TransferError(NPUPluginError, RuntimeError):
    """A Mooncake call returned an error code."""


def load_transfer_engine_class() -> type:
    """``mooncake.engine.TransferEngine``, or :class:`MooncakeUnavailableError` naming the install commands."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # the wheel is missing, or one of its shared libraries (libibverbs.so.1, ...)
        raise MooncakeUnavailableError(exc) from exc
    engine_cls: type = TransferEngine
    return engine_cls


class TransferEngineHandle:
    """One initialised Mooncake engine in P2P mode.

    ``hostname`` is the address peers reach this process on (127.0.0.1 in the tests); ``protocol`` one of
    :data:`PROTOCOLS`' values. Memory must be registered (:meth:`register`) before it is read from or written to,
    on both sides. Calls are serialised: the engine is shared by the connector's threads.
    """

    def __init__(self, hostname: str, protocol: str, device_name: str = "", engine_cls: type | None = None) -> None:
        cls = engine_cls if engine_cls is not None else load_transfer_engine_class()
        self._engine: Any = cls()
        self._lock = threading.Lock()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError(
                f"Mooncake TransferEngine.initialize({hostname!r}, 'P2PHANDSHAKE', {protocol!r}) returned {rc}; "
                "check that the host address is local and reachable"
            )
        self.hostname = hostname
        self.protocol = protocol
        self.rpc_port: int = int(self._engine.get_rpc_port())
        self._registered: list[tuple[int, int]] = []

    @property
    def session_id(self) -> str:
        """How peers address this engine: ``"host:rpc_port"``."""
        return f"{self.hostname}:{self.rpc_port}"

    def register(self, ptr: int, nbytes: int) -> None:
        """Register ``nbytes`` of memory at address ``ptr`` for transfers (kept until :meth:`close`)."""
        with self._lock:
            rc = self._engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory({ptr:#x}, {nbytes}) returned {rc}")
        self._registered.append((ptr, nbytes))

    def read(self, session_id: str, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]) -> None:
        """Copy ``lengths[i]`` bytes from ``remote[i]`` in the peer ``session_id`` to ``local[i]`` here; blocks."""
        if not (len(local) == len(remote) == len(lengths)):
            raise ValueError(f"read: {len(local)} local, {len(remote)} remote addresses and {len(lengths)} lengths")
        if not local:
            return
        rc = self._engine.batch_transfer_sync_read(session_id, list(local), list(remote), list(lengths))
        if rc < 0:
            raise TransferError(
                f"Mooncake batch_transfer_sync_read from {session_id} ({len(local)} segments, "
                f"{sum(lengths)} bytes) returned {rc}"
            )

    def write(self, session_id: str, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]) -> None:
        """Copy ``lengths[i]`` bytes from ``local[i]`` here to ``remote[i]`` in the peer ``session_id``; blocks."""
        if not (len(local) == len(remote) == len(lengths)):
            raise ValueError(f"write: {len(local)} local, {len(remote)} remote addresses and {len(lengths)} lengths")
        if not local:
            return
        rc = self._engine.batch_transfer_sync_write(session_id, list(local), list(remote), list(lengths))
        if rc < 0:
            raise TransferError(f"Mooncake batch_transfer_sync_write to {session_id} returned {rc}")

    def unregister(self, ptr: int) -> None:
        """Unregister memory registered at ``ptr`` through this handle."""
        with self._lock:
            self._engine.unregister_memory(ptr)
            self._registered = [r for r in self._registered if r[0] != ptr]

    def close(self) -> None:
        """Unregister the memory registered through this handle."""
        with self._lock:
            for ptr, _ in self._registered:
                self._engine.unregister_memory(ptr)
            self._registered.clear()
