# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``kv_transfer_params``: what the proxy, the prefill instance and the decode instance pass each other.

The keys are vLLM's disaggregated-serving protocol (the same ones its NixlConnector uses), so vLLM's own proxy
examples work against these instances too:

- request to the prefill instance: ``{"do_remote_decode": true}`` (and ``max_tokens: 1``);
- the prefill instance's response: ``{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids":
  [...], "remote_engine_id": ..., "remote_host": ..., "remote_port": ..., "tp_size": ..., "remote_request_id": ...}``
  (``remote_request_id``: the prefill instance's id of the request, which the decode side names when it releases the
  blocks; the two instances give one client request different ids);
- request to the decode instance: that response's params, unchanged.

``remote_port`` is the prefill instance's side-channel base port (its TP rank ``r`` listens on ``remote_port + r``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_npu.interface import NPUPluginError


class TransferParamsError(NPUPluginError, ValueError):
    """``kv_transfer_params`` that ask for a remote prefill but cannot be used for one."""


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode instance pulls a request's prompt KV from."""

    block_ids: tuple[int, ...]
    engine_id: str
    host: str
    port: int
    tp_size: int
    request_id: str | None = None

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> RemotePrefill:
        """Validate the prefill side's params; :class:`TransferParamsError` names the bad or missing key."""
        missing = [k for k in ("remote_block_ids", "remote_engine_id", "remote_host", "remote_port") if k not in params]
        if missing:
            raise TransferParamsError(
                f"kv_transfer_params asks for a remote prefill but lacks {missing}; pass the prefill instance's "
                "response kv_transfer_params unchanged"
            )
        blocks = params["remote_block_ids"]
        if not isinstance(blocks, (list, tuple)) or not all(isinstance(b, int) and b >= 0 for b in blocks):
            raise TransferParamsError(f"remote_block_ids must be a list of non-negative ints, got {blocks!r}")
        port, tp = params["remote_port"], params.get("tp_size", 1)
        if not isinstance(port, int) or not 0 < port < 65536:
            raise TransferParamsError(f"remote_port must be a TCP port, got {port!r}")
        if not isinstance(tp, int) or tp < 1:
            raise TransferParamsError(f"tp_size must be a positive int, got {tp!r}")
        rid = params.get("remote_request_id")
        return cls(
            tuple(blocks),
            str(params["remote_engine_id"]),
            str(params["remote_host"]),
            port,
            tp,
            None if rid is None else str(rid),
        )

    def to_params(self) -> dict[str, Any]:
        """The response params of the prefill instance (what the decode request carries)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(self.block_ids),
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "remote_request_id": self.request_id,
        }
