# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The handshake and notification channel between a decode worker and the prefill workers (ZMQ, JSON messages).

Every prefill worker serves one ROUTER socket on ``tcp://host:port`` (port = the instance's side-channel base port +
its TP rank). A decode worker sends it, over a REQ socket:

- ``{"op": "meta"}``: the reply is the worker's :class:`AgentMetadata` (engine id, TP rank and size, its Mooncake
  session ``host:rpc_port``, the layout of every cache layer) — the handshake, once per remote worker;
- ``{"op": "done", "req_id": ..., "rank": r, "tp_size": t}``: decode rank ``r`` of ``t`` has finished reading (or
  gave up on) the request's blocks; the prefill worker frees them once all ``t`` decode ranks said so.

Bulk data never goes over this channel: only the Mooncake engine moves KV.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from vllm_npu.interface import NPUPluginError, get_logger

from .layout import LayerLayout

logger = get_logger(__name__)


class SideChannelError(NPUPluginError, ConnectionError):
    """A prefill worker did not answer on its side channel in time, or answered with an error."""


@dataclass(frozen=True)
class AgentMetadata:
    """What a prefill worker tells a decode worker in the handshake."""

    engine_id: str
    tp_rank: int
    tp_size: int
    session_id: str
    block_size: int
    layers: tuple[LayerLayout, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "session_id": self.session_id,
            "block_size": self.block_size,
            "layers": [layer.to_json() for layer in self.layers],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AgentMetadata:
        return cls(
            str(data["engine_id"]),
            int(data["tp_rank"]),
            int(data["tp_size"]),
            str(data["session_id"]),
            int(data["block_size"]),
            tuple(LayerLayout.from_json(layer) for layer in data["layers"]),
        )


class SideChannelServer:
    """A prefill worker's ROUTER socket, served by a daemon thread until :meth:`close`.

    ``on_done(req_id, rank, tp_size)`` runs on the server thread for every ``done`` message.
    """

    def __init__(self, host: str, port: int, metadata: AgentMetadata, on_done: Callable[[str, int, int], None]) -> None:
        self.address = f"tcp://{host}:{port}"
        self._meta = json.dumps({"ok": True, "meta": metadata.to_json()}).encode()
        self._on_done = on_done
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(self.address)
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise SideChannelError(
                f"cannot listen on {self.address} for the KV side channel ({exc}); choose a free kv_port in "
                "--kv-transfer-config (each TP rank uses kv_port + its rank)"
            ) from exc
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"npu-kv-side-channel-{port}", daemon=True)
        self._thread.start()

    def _reply(self, message: dict[str, Any]) -> bytes:
        op = message.get("op")
        if op == "meta":
            return self._meta
        if op == "done":
            self._on_done(str(message["req_id"]), int(message["rank"]), int(message["tp_size"]))
            return b'{"ok": true}'
        return json.dumps({"ok": False, "error": f"unknown op {op!r}"}).encode()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, _, payload = self._sock.recv_multipart()
            try:
                reply = self._reply(json.loads(payload))
            except Exception as exc:  # a malformed message must not stop the channel
                logger.warning("KV side channel %s: bad message %r: %s", self.address, payload[:200], exc)
                reply = json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}).encode()
            self._sock.send_multipart([ident, b"", reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
        self._ctx.term()


class SideChannelClient:
    """REQ requests to one prefill worker, each bounded by ``timeout_s``. Not thread-safe (one per thread)."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.address = f"tcp://{host}:{port}"
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        sock = self._socket()
        try:
            sock.send(json.dumps(message).encode())
            reply: dict[str, Any] = json.loads(sock.recv())
        except zmq.Again as exc:
            self.close()  # a REQ socket that missed its reply cannot send again
            raise SideChannelError(
                f"the prefill worker at {self.address} did not answer {message.get('op')!r} within "
                f"{self.timeout_ms} ms; is the prefill instance running, and is remote_host/remote_port right?"
            ) from exc
        if not reply.get("ok"):
            raise SideChannelError(f"the prefill worker at {self.address} refused {message}: {reply.get('error')}")
        return reply

    def metadata(self) -> AgentMetadata:
        return AgentMetadata.from_json(self.request({"op": "meta"})["meta"])

    def done(self, req_id: str, rank: int, tp_size: int) -> None:
        self.request({"op": "done", "req_id": req_id, "rank": rank, "tp_size": tp_size})

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
